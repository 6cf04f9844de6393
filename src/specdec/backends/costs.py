"""What a forward pass costs: the timing every cost model here starts from (bench, Medusa's tree choice)."""

from __future__ import annotations

import statistics
import time

import torch


def forward_time(backend, n: int, context: int, repeats: int = 15, hidden_layers: tuple[int, ...] = (),
                 rows: int = 1) -> float:
    """Median seconds of one forward pass of n new tokens per row, ``rows`` rows, after ``context`` cached
    tokens (every token live: the pass itself, with the least bookkeeping a cache does)."""
    generator = torch.Generator().manual_seed(0)
    vocab = backend.vocab_size
    cache = backend.new_cache(rows, context + n + 8)
    device = backend.device
    cache.forward(torch.randint(vocab, (rows, context), generator=generator).to(device), None)
    block = torch.randint(vocab, (rows, n), generator=generator).to(device)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        cache.forward(block, None, logits_to_keep=n, hidden_layers=hidden_layers)
        times.append(time.perf_counter() - start)
        cache.truncate(cache.lengths - n)
    return statistics.median(times[3:])
