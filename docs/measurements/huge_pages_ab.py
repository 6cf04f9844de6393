"""Weights in transparent huge pages or not: whole forward passes of the real target loaded twice in one
process, once with its packed weights moved to huge pages (kernels.move_to_huge_pages, the default) and once
with the move turned off, interleaved pass by pass, least of ROUNDS per width, context 200, 2 threads.

    [ORDER=huge,plain] python docs/measurements/huge_pages_ab.py MODEL DTYPE Ms [ROUNDS]

ORDER: which copy loads first (the default plain,huge); report both orders. Prints the logits' identity too.
"""
import os
import sys
import time

import torch

from specdec.backends.target import load_target
from specdec.models import kernels
from specdec.zoo import zoo_path

model, dtype, sizes = sys.argv[1], sys.argv[2], [int(m) for m in sys.argv[3].split(",")]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 30
order = os.environ.get("ORDER", "plain,huge").split(",")
torch.set_num_threads(2)
kernels.set_threads(2)
sides, threshold = {}, kernels.HUGE_PAGES_FROM
for name in order:
    kernels.HUGE_PAGES_FROM = threshold if name == "huge" else float("inf")
    backend = load_target(zoo_path(model), dtype=dtype, backend="native").backend
    generator = torch.Generator().manual_seed(0)
    cache = backend.new_cache(1, 200 + max(sizes) + 8)
    cache.forward(torch.randint(backend.vocab_size, (1, 200), generator=generator), None)
    sides[name] = (cache, {n: torch.randint(backend.vocab_size, (1, n), generator=generator) for n in sizes})
kernels.HUGE_PAGES_FROM = threshold
huge = [line for line in open("/proc/meminfo") if line.startswith("AnonHugePages")]
best, logits = {}, {}
with kernels.torch_single_threaded():
    for round_ in range(rounds + 1):
        for n in sizes:
            for name, (cache, blocks) in sides.items():
                started = time.perf_counter()
                out, _ = cache.forward(blocks[n], None, logits_to_keep=n)
                elapsed = time.perf_counter() - started
                logits[name, n] = out.clone()
                cache.truncate(cache.lengths - n)
                if round_:
                    best[name, n] = min(best.get((name, n), float("inf")), elapsed)
print(kernels.cpu_summary(), model, dtype, "2 threads, order", ",".join(order), "|", huge[0].strip() if huge else "")
for n in sizes:
    print(f"n={n:3d}: plain {1e3 * best['plain', n]:6.2f} ms, huge pages {1e3 * best['huge', n]:6.2f} ms "
          f"({best['huge', n] / best['plain', n]:.3f}x); logits {'identical' if torch.equal(logits['plain', n], logits['huge', n]) else 'DIFFER'}")
