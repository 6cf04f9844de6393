"""The baseline: no drafts, so every step is one plain autoregressive target step."""

from __future__ import annotations

import torch

from specdec.batch import Sequences
from specdec.drafters.base import DecodeContext, Proposal, StatelessSession


class NoDraft:
    name = "none"

    def start(self, context: DecodeContext, seqs: Sequences) -> "NoDraftSession":
        return NoDraftSession()


class NoDraftSession(StatelessSession):
    def __init__(self):
        self.empty: Proposal | None = None  # one empty proposal per batch size, made once

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        if self.empty is None or self.empty.tokens.shape[0] != seqs.batch_size:
            device = seqs.tokens.device
            self.empty = Proposal(torch.zeros(seqs.batch_size, 0, dtype=torch.long, device=device),
                                  torch.zeros(seqs.batch_size, dtype=torch.long, device=device))
        return self.empty
