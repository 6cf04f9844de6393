"""Median T(M) of whole forward passes at context 200 with kernels built from one source, in its own process (alternate builds by running it for each in turn: one library and one thread pool per process). python forward_build.py SRC.c MODEL_DIR DTYPE Ms REPS"""
import sys, time, torch
from pathlib import Path
from specdec.models import kernels
src, model, dtype, Ms, reps = sys.argv[1], sys.argv[2], sys.argv[3], [int(m) for m in sys.argv[4].split(",")], int(sys.argv[5])
tmp = Path(f"/tmp/fs_{Path(src).stem}.c"); tmp.write_text(Path(src).read_text()); kernels.SOURCE = tmp
kernels._library = kernels.load_library(kernels.build())
from specdec.backends.target import load_target
torch.set_num_threads(2); kernels.set_threads(2)
t = load_target(model, dtype=dtype, backend="native"); b = t.backend
g = torch.Generator().manual_seed(0)
cache = b.new_cache(1, 200 + 80)
cache.forward(torch.randint(b.vocab_size, (1, 200), generator=g), None)
out = []
for M in Ms:
    block = torch.randint(b.vocab_size, (1, M), generator=g)
    ts = []
    for rep in range(reps):
        s = time.perf_counter(); cache.forward(block, None, logits_to_keep=M); ts.append(time.perf_counter() - s)
        cache.truncate(cache.lengths - M)
    ts.sort(); out.append(f"T{M} {ts[len(ts)//2]*1e3:.2f}")
print(Path(src).stem, Path(model).name, dtype, " ".join(out), flush=True)
