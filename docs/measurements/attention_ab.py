"""Interleaved A/B of the attention kernel against another build (/tmp/old.so): python attention_ab.py THREADS [OLD.so]"""
import time, torch, sys
from specdec.models import kernels
old = kernels.load_library(sys.argv[2] if len(sys.argv) > 2 else "/tmp/old.so"); new = kernels.library()
th = int(sys.argv[1])
for lib in (old, new): lib.sd_set_threads(th)
g = torch.Generator().manual_seed(0)
print(kernels.cpu_summary(), th, "threads; 30 calls of attention (9 query heads, 3 key heads, D 64), min of 15")
for dtype in (torch.float32, torch.bfloat16):
  for n, T in ((1, 200), (1, 1000), (3, 200), (5, 200)):
    q = torch.randn(1, n, 9, 64, generator=g).to(dtype); kv = torch.randn(2, 1, 3, T, 64, generator=g).to(dtype)
    vis = torch.ones(1, n, T, dtype=torch.bool); out = torch.empty(1, n, 9 * 64, dtype=dtype)
    best = {"old": 1e9, "new": 1e9}
    for rep in range(15):
        for name, lib in (("old", old), ("new", new)):
            kernels._library = lib
            s = time.perf_counter()
            for _ in range(30): kernels.attention(q, kv[0], kv[1], vis, out, 0.125)
            best[name] = min(best[name], time.perf_counter() - s)
    print(f"{str(dtype)[6:]:9s} n={n} T={T:4d}: old {best['old']*1e3:.3f} ms new {best['new']*1e3:.3f} ms new/old {best['new']/best['old']:.2f}")
kernels._library = new
