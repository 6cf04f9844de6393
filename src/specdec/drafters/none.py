"""The baseline: no drafts, so every step is one plain autoregressive target step."""

from __future__ import annotations

import torch

from ..batch import Sequences
from .base import DecodeContext, Proposal, StatelessSession


class NoDraft:
    name = "none"

    def start(self, context: DecodeContext, seqs: Sequences) -> "NoDraftSession":
        return NoDraftSession()


class NoDraftSession(StatelessSession):
    def propose(self, seqs: Sequences, k: int) -> Proposal:
        empty = torch.zeros(seqs.batch_size, 0, dtype=torch.long, device=seqs.tokens.device)
        return Proposal(empty, torch.zeros(seqs.batch_size, dtype=torch.long, device=seqs.tokens.device))
