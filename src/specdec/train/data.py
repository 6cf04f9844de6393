"""Token streams and deterministic batch sampling for the trainers.

A batch is a pure function of (seed, step): random window offsets into one
long token stream. Resuming therefore only needs the step number as the data
position, and any sequence length can be sampled from the same stream.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tokenizers import Tokenizer

from specdec.errors import SpecdecError

_STEP_STRIDE = 1_000_003


class DataError(SpecdecError):
    """The token stream is too short for the requested windows."""


def encode_stream(texts: Sequence[str], tokenizer: Tokenizer, eos_id: int) -> torch.Tensor:
    """All documents as one stream, each followed by ``eos_id``; shape [N] int64."""
    pieces: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        pieces.extend(encoding.ids)
        pieces.append(eos_id)
    return torch.tensor(pieces, dtype=torch.long)


def step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    """A generator seeded only by (seed, step, salt), independent of global RNG state."""
    return torch.Generator().manual_seed((seed * _STEP_STRIDE + step) * 7 + salt)


def sample_windows(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len`` tokens; shape [B, T]."""
    limit = stream.numel() - seq_len
    if limit <= 0:
        raise DataError(f"token stream of {stream.numel()} tokens is shorter than one window of {seq_len}")
    starts = torch.randint(0, limit + 1, (batch_size,), generator=generator)  # [B]
    offsets = torch.arange(seq_len)  # [T]
    return stream[starts[:, None] + offsets[None, :]]  # [B, T]


def eval_windows(stream: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows covering the stream, evenly thinned to ``limit``; shape [N, T]."""
    count = stream.numel() // seq_len
    if count == 0:
        raise DataError(f"validation stream of {stream.numel()} tokens is shorter than one window of {seq_len}")
    windows = stream[: count * seq_len].view(count, seq_len)  # [N, T]
    if limit is not None and limit < count:
        index = torch.linspace(0, count - 1, limit).round().long()
        windows = windows[index]
    return windows
