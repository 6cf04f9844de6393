"""T(n) of whole forward passes at context 200 for n = 1, 2, 3, 4, 8, 16: median/best of REPS, ms. python block_times.py THREADS DTYPE MODEL_DIR REPS [TORCH_THREADS]"""
import sys, time, torch
from specdec.models import kernels
from specdec.backends.target import load_target
th = int(sys.argv[1]); dtype = sys.argv[2]; model = sys.argv[3]; reps = int(sys.argv[4]); tt = int(sys.argv[5]) if len(sys.argv) > 5 else th
torch.set_num_threads(tt); kernels.library().sd_set_threads(th)
t = load_target(model, dtype=dtype, backend="native"); b = t.backend
g = torch.Generator().manual_seed(0)
cache = b.new_cache(1, 200 + 80)
cache.forward(torch.randint(b.vocab_size, (1, 200), generator=g), None)
out = []
for M in (1, 2, 3, 4, 8, 16):
    block = torch.randint(b.vocab_size, (1, M), generator=g)
    times = []
    for rep in range(reps):
        s = time.perf_counter()
        cache.forward(block, None, logits_to_keep=M)
        times.append(time.perf_counter() - s)
        cache.truncate(cache.lengths - M)
    times.sort()
    out.append((M, times[len(times) // 2] * 1e3, times[0] * 1e3))
print(" ".join(f"T({m})={med:.2f}/{best:.2f}" for m, med, best in out), "| T16/T1 med %.2f" % (out[-1][1] / out[0][1]))
