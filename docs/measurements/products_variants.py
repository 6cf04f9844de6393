"""Products of SmolLM2-135M (30 layers + head) per build of kernels.c, all builds loaded in one process and interleaved, best of 7 per row count, ms. python products_variants.py THREADS DTYPE Ms A.c B.c ... (MODEL=folder, default the zoo's smollm2-135m)"""
import sys, time, torch, os
from pathlib import Path
from specdec.models import kernels
from specdec.backends.target import load_target
th = int(sys.argv[1]); dtype = sys.argv[2]; Ms = [int(m) for m in sys.argv[3].split(",")]; srcs = sys.argv[4:]
torch.set_num_threads(th)
libs = []
orig = kernels.SOURCE
for i, src in enumerate(srcs):
    tmp = Path(f"/tmp/pv_{i}.c"); tmp.write_text(Path(src).read_text()); kernels.SOURCE = tmp
    libs.append(kernels.load_library(kernels.build())); libs[-1].sd_set_threads(th)
kernels.SOURCE = orig
kernels._library = libs[0]
from specdec.zoo import zoo_path
model = os.environ.get("MODEL") or str(zoo_path("smollm2-135m"))
t = load_target(model, dtype=dtype, backend="native"); m = t.backend.model
mats = [getattr(l, n) for l in m.layers for n in ("qkv", "o", "gate_up", "down")] + [m.head]
dt = t.backend.dtype
for M in Ms:
    xs = {K: torch.randn(M, K).to(dt) for K in {w.rows for w in mats}}
    outs = {N: torch.empty(M, N, dtype=dt) for N in {w.cols for w in mats}}
    best = [1e9] * len(libs)
    for rep in range(7):
        for i, lib in enumerate(libs):
            kernels._library = lib
            s = time.perf_counter()
            for w in mats: kernels.linear(xs[w.rows], w, out=outs[w.cols])
            best[i] = min(best[i], time.perf_counter() - s)
    print(f"M={M:3d} " + "  ".join(f"{Path(s).stem} {b*1e3:6.2f}" for s, b in zip(srcs, best)), flush=True)
