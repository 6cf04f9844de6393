"""Whole forward passes of two builds of kernels.c in one process, each on the model packed as it prefers,
interleaved pass by pass (a slow spell of the host lands on both): least of ROUNDS per width, context 200.

    [ORDER=new,old] python builds_ab.py OLD.so MODEL DTYPE THREADS Ms [ROUNDS]

OLD.so: a build of another kernels.c (kernels.SOURCE pointed at it, kernels.build()); it must export
every function kernels.py declares. ORDER: which model loads first; on the Zen 4 of the twenty-ninth
session the second one ran 3-8% faster whatever its build, so report both orders."""
import os, sys, time, torch
from specdec.models import kernels
old_path, model, dtype, th, Ms = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(m) for m in sys.argv[5].split(",")]
rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 20
from specdec.backends.target import load_target
torch.set_num_threads(th)
sides = {}
for name in os.environ.get("ORDER", "old,new").split(","):
    lib = kernels.load_library(old_path) if name == "old" else kernels.load_library(kernels.build())
    lib.sd_set_threads(th)
    kernels._library = lib
    b = load_target(model, dtype=dtype, backend="native").backend
    g = torch.Generator().manual_seed(0)
    cache = b.new_cache(1, 200 + max(Ms) + 8)
    cache.forward(torch.randint(b.vocab_size, (1, 200), generator=g), None)
    blocks = {M: torch.randint(b.vocab_size, (1, M), generator=g) for M in Ms}
    sides[name] = (lib, cache, blocks)
best = {(n, M): 1e9 for n in sides for M in Ms}
with kernels.torch_single_threaded():
    for r in range(rounds + 1):
        for M in Ms:
            for name, (lib, cache, blocks) in sides.items():
                kernels._library = lib
                s = time.perf_counter()
                cache.forward(blocks[M], None, logits_to_keep=M)
                t = time.perf_counter() - s
                cache.truncate(cache.lengths - M)
                if r: best[name, M] = min(best[name, M], t)
print(kernels.cpu_summary(), model, dtype, th, "threads, order", os.environ.get("ORDER", "old,new"))
for M in Ms:
    print(f"M={M:3d} old {1e3*best['old', M]:7.2f} ms  new {1e3*best['new', M]:7.2f} ms  new/old {best['new', M]/best['old', M]:.3f}  "
          f"T(M)/T(1) old {best['old', M]/best['old', Ms[0]]:.2f} new {best['new', M]/best['new', Ms[0]]:.2f}", flush=True)
