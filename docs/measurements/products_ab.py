"""Interleaved A/B of the products of SmolLM2-135M (all 30 layers and the head) against another build of kernels.c: min over 9 repeats, per row count. python products_ab.py THREADS DTYPE OTHER.so [Ms] [MODEL]"""
import sys, time, torch
from specdec.models import kernels
from specdec.backends.target import load_target
th = int(sys.argv[1]); dtype = sys.argv[2]
torch.set_num_threads(th)
new = kernels.library(); old = kernels.load_library(sys.argv[3])
for lib in (new, old): lib.sd_set_threads(th)
t = load_target(sys.argv[5] if len(sys.argv) > 5 else "smollm2-135m", dtype=dtype, backend="native")
m = t.backend.model
mats = [getattr(l, n) for l in m.layers for n in ("qkv", "o", "gate_up", "down")] + [m.head]
dt = getattr(torch, dtype)
Ms = [int(a) for a in (sys.argv[4] if len(sys.argv) > 4 else "1,2,4,5,8,16,17,32").split(",")]
def run(M, lib):
    kernels._library = lib
    xs = {K: torch.randn(M, K).to(dt) for K in {w.rows for w in mats}}
    outs = {N: torch.empty(M, N, dtype=dt) for N in {w.cols for w in mats}}
    s = time.perf_counter()
    for w in mats:
        kernels.linear(xs[w.rows], w, out=outs[w.cols])
    return time.perf_counter() - s
print(kernels.cpu_summary(), dtype, th, "threads")
for M in Ms:
    best = {"old": 1e9, "new": 1e9}
    for rep in range(9):
        for name, lib in (("old", old), ("new", new)):
            best[name] = min(best[name], run(M, lib))
    print(f"M={M:3d} old {1e3*best['old']:7.2f} ms  new {1e3*best['new']:7.2f} ms  new/old {best['new']/best['old']:.2f}", flush=True)
kernels._library = new
