"""What a forward pass costs: the timing every cost model here starts from (bench, Medusa's tree choice)."""

from __future__ import annotations

import statistics
import time

import torch


def forward_time(backend, n: int, context: int, repeats: int = 15, hidden_layers: tuple[int, ...] = ()) -> float:
    """Median seconds of one forward pass of n new tokens at batch 1 after ``context`` cached tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab = backend.vocab_size
    cache = backend.new_cache(1, context + n + 8)
    device = backend.device
    cache.forward(torch.randint(vocab, (1, context), generator=generator).to(device),
                  torch.ones(1, context, dtype=torch.bool, device=device))
    block = torch.randint(vocab, (1, n), generator=generator).to(device)
    everyone = torch.ones(1, n, dtype=torch.bool, device=device)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        cache.forward(block, everyone, logits_to_keep=n, hidden_layers=hidden_layers)
        times.append(time.perf_counter() - start)
        cache.truncate(cache.lengths - n)
    return statistics.median(times[3:])
