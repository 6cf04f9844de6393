"""1. PROPOSE: the protocol every drafter implements.

A ``Drafter`` is the reusable part (loaded weights, settings). ``start`` opens a ``DraftSession`` for
one generation call, holding per-call state such as a KV cache. The decode loop only talks to these
two protocols; it never branches on which drafter it drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..batch import Sequences
from ..sampling import SamplingConfig


@dataclass(frozen=True)
class Proposal:
    """Drafts for every live row."""

    tokens: torch.Tensor              # [B, k] long; slots at or past `lengths` are padding
    lengths: torch.Tensor             # [B] long, drafts per row, 0..k
    probs: torch.Tensor | None = None  # [B, k, V] distributions the drafts were sampled from; None = one-hot

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    def clamp(self, max_lengths: torch.Tensor) -> "Proposal":
        """Limit rows to max_lengths[b] drafts (no row drafts past its token budget)."""
        return Proposal(self.tokens, torch.minimum(self.lengths, max_lengths), self.probs)


@dataclass(frozen=True)
class DecodeContext:
    """What a drafter may read about the generation it joins."""

    target: object                 # specdec.target.Target
    sampling: SamplingConfig
    generator: torch.Generator | None
    max_new_tokens: int
    max_draft_tokens: int          # upper bound on k for this call (adaptive k never exceeds it)
    cache_capacity: int | None = None  # columns a KV cache of this call may need (preallocating backends)


class DraftSession(Protocol):
    def propose(self, seqs: Sequences, k: int) -> Proposal:
        """Up to k drafts per row continuing ``seqs``."""

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        """After verification: ``seqs`` now holds the committed tokens; num_accepted: [B]."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only rows ``index`` (finished rows leave the batch)."""


class Drafter(Protocol):
    name: str

    def start(self, context: DecodeContext, seqs: Sequences) -> DraftSession:
        """Validate against the target and open the per-call state."""


class StatelessSession:
    """Base for sessions with nothing to update or select: prompt lookup, the no-draft baseline."""

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, index: torch.Tensor) -> None:
        pass
