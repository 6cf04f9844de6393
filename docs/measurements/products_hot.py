"""bfloat16 products of the real model's shapes on hot (cached) matrices at 1-16 rows: time, GFLOP/s and the bytes a second that the weights would stream at. python products_hot.py THREADS"""
import sys, time, torch
from specdec.models import kernels
th = int(sys.argv[1]); torch.set_num_threads(th); kernels.set_threads(th)
g = torch.Generator().manual_seed(0)
shapes = [(576, 576), (192, 576), (3072, 576), (576, 1536), (49152, 576)]
for N, K in shapes:
    w = kernels.Matrix.pack((torch.randn(K, N, generator=g) * 0.05).to(torch.bfloat16))
    row = []
    for M in (1, 2, 4, 8, 16):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        out = torch.empty(M, N, dtype=torch.bfloat16)
        reps = max(20, int(3e8 / (N * K * 2 + 1)))
        for _ in range(3): kernels.linear(x, w, out=out)
        ts = []
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(reps): kernels.linear(x, w, out=out)
            ts.append((time.perf_counter() - s) / reps)
        t = min(ts)
        row.append(f"M{M} {t*1e6:7.1f}us {M*N*K*2/t/1e9:6.1f}GF {N*K*2/t/1e9:5.1f}GB/s")
    print(f"{N}x{K}: " + " | ".join(row))
