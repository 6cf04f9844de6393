"""Interleaved A/B of whole forward passes (context 200) against another build of kernels.c: min over 15, per block size. PB=BYTES sets this build's split threshold. python forward_ab.py THREADS DTYPE OTHER.so MODEL [Ms]"""
import sys, time, torch
from specdec.models import kernels
from specdec.backends.target import load_target
th = int(sys.argv[1]); dtype = sys.argv[2]
torch.set_num_threads(th)
new = kernels.library(); old = kernels.load_library(sys.argv[3])
for lib in (new, old): lib.sd_set_threads(th)
import os
if os.environ.get("PB"): new.sd_set_parallel_bytes(int(os.environ["PB"]))
t = load_target(sys.argv[4], dtype=dtype, backend="native")
b = t.backend
Ms = [int(a) for a in (sys.argv[5] if len(sys.argv) > 5 else "1,2,4,5,8,16").split(",")]
g = torch.Generator().manual_seed(0)
cache = b.new_cache(1, 200 + 80)
cache.forward(torch.randint(b.vocab_size, (1, 200), generator=g), None)
print(kernels.cpu_summary(), sys.argv[4], dtype, th, "threads")
for M in Ms:
    block = torch.randint(b.vocab_size, (1, M), generator=g)
    best = {"old": 1e9, "new": 1e9}
    for rep in range(15):
        for name, lib in (("old", old), ("new", new)):
            kernels._library = lib
            s = time.perf_counter()
            cache.forward(block, None, logits_to_keep=M)
            best[name] = min(best[name], time.perf_counter() - s)
            cache.truncate(cache.lengths - M)
    print(f"M={M:3d} old {1e3*best['old']:7.2f} ms  new {1e3*best['new']:7.2f} ms  new/old {best['new']/best['old']:.2f}", flush=True)
