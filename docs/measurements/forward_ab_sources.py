"""Interleaved A/B of whole forward passes (30 layers and the head, context 200) between two versions of
kernels.c, built and loaded side by side: the library alternates every repetition, medians per block size,
and the logits of both compared bitwise. On a machine whose speed drifts between runs (a shared host),
only such interleaved ratios mean anything.
python forward_ab_sources.py THREADS MODEL A.c B.c REPS [Ms] [DTYPE]   e.g. A.c from `git show REV:src/specdec/models/kernels.c`"""
import sys, time, torch
from pathlib import Path
from specdec.models import kernels
from specdec.backends.target import load_target
th, model, src_a, src_b, reps = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
Ms = [int(m) for m in sys.argv[6].split(",")] if len(sys.argv) > 6 else [1, 3, 8, 16]
dtype = sys.argv[7] if len(sys.argv) > 7 else "bfloat16"
torch.set_num_threads(th)
libs = []
orig = kernels.SOURCE
for src in (src_a, src_b):
    text = Path(src).read_text()
    if "sd_set_dynamic" not in text: text += "\nvoid sd_set_dynamic(int on) { (void)on; }\n"
    tmp = Path(f"/tmp/ab_{len(libs)}.c"); tmp.write_text(text)
    kernels.SOURCE = tmp
    libs.append(kernels.load_library(kernels.build()))
    libs[-1].sd_set_threads(th)
kernels.SOURCE = orig
kernels._library = libs[0]
t = load_target(model, dtype=dtype, backend="native"); b = t.backend
g = torch.Generator().manual_seed(0)
cache = b.new_cache(1, 200 + 80)
cache.forward(torch.randint(b.vocab_size, (1, 200), generator=g), None)
for M in Ms:
    block = torch.randint(b.vocab_size, (1, M), generator=g)
    times = {0: [], 1: []}; outs = {}
    for rep in range(reps):
        for v in ((0, 1) if rep % 2 == 0 else (1, 0)):
            kernels._library = libs[v]
            s = time.perf_counter()
            out = cache.forward(block, None, logits_to_keep=M)
            times[v].append(time.perf_counter() - s)
            cache.truncate(cache.lengths - M)
            outs[v] = (out[0] if isinstance(out, tuple) else out).clone()
    med = {v: sorted(x)[len(x) // 2] * 1e3 for v, x in times.items()}
    print(f"M={M:3d} A {med[0]:6.2f} ms  B {med[1]:6.2f} ms  B/A {med[1]/med[0]:.3f}  same={torch.equal(outs[0], outs[1])}", flush=True)
