"""A prompt's prefill (the whole forward pass of L tokens into an empty cache, the last logits kept) with two builds
of kernels.c in one process, interleaved pass by pass: least of ROUNDS per length, milliseconds.

    python docs/measurements/prefill_ab.py OLD.so MODEL DTYPE L1,L2,... [ROUNDS]

OLD.so: a build of another kernels.c (kernels.SOURCE pointed at it, kernels.build()). 2 threads; the last
logits of both builds are compared bit for bit.
"""
import sys
import time

import torch

from specdec.backends.target import load_target
from specdec.models import kernels

old_path, model, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
lengths = [int(n) for n in sys.argv[4].split(",")]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 10
torch.set_num_threads(2)
builds = {"old": kernels.load_library(old_path), "new": kernels.library()}
for lib in builds.values():
    lib.sd_set_threads(2)
backend = load_target(model, dtype=dtype, backend="native").backend
generator = torch.Generator().manual_seed(0)
prompts = {n: torch.randint(backend.vocab_size, (1, n), generator=generator) for n in lengths}
best, last = {}, {}
with kernels.torch_single_threaded():
    for round_ in range(rounds + 1):
        for n in lengths:
            for name in (("old", "new") if round_ % 2 else ("new", "old")):
                kernels._library = builds[name]
                cache = backend.new_cache(1, n + 8)
                started = time.perf_counter()
                logits, _ = cache.forward(prompts[n], None, logits_to_keep=1)
                seconds = time.perf_counter() - started
                if round_:
                    best[name, n] = min(best.get((name, n), float("inf")), seconds)
                last[name, n] = logits
kernels._library = builds["new"]
print(kernels.cpu_summary(), model, dtype, "2 threads, least of", rounds, "interleaved rounds")
for n in lengths:
    old, new = best["old", n], best["new", n]
    same = torch.equal(last["old", n], last["new", n])
    print(f"prefill of {n:4d} tokens: old {1e3 * old:7.1f} ms, new {1e3 * new:7.1f} ms ({new / old:.2f}x); "
          f"last logits {'identical' if same else 'DIFFER'}", flush=True)
