"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's tail.

Tries the longest n-gram first (max_ngram down to min_ngram) over prompt and generated text. When
the continuation runs into the end of the context (the most recent match of a repeating pattern
overlaps the tail), it keeps copying with the same offset through the tokens it has just proposed,
so a repeating pattern yields a full k drafts. It has no distribution, so verification treats each
draft as a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import Sequences
from ..errors import InvalidArgumentError
from .base import DecodeContext, Proposal, StatelessSession


def lookup(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k: int) -> torch.Tensor:
    """k tokens that followed the latest earlier match of the longest matching tail n-gram.

    tokens: [L] long, the whole context. Returns [k] long, or [0] when nothing matches.
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = tokens[length - n:]
        windows = tokens[: length - 1].unfold(0, n, 1)  # [L-n, n]: every window that ends before the last token
        hits = (windows == tail).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            found = tokens[start: start + k]
            if found.shape[0] < k:  # periodic: draft j repeats the token `period` places before it
                period = length - start
                found = tokens[start:].repeat(k // period + 1)[:k]
            return found
    return tokens[:0]


@dataclass(frozen=True)
class PromptLookup:
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "prompt-lookup"

    def __post_init__(self):
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise InvalidArgumentError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}")

    def start(self, context: DecodeContext, seqs: Sequences) -> "PromptLookupSession":
        return PromptLookupSession(self)


class PromptLookupSession(StatelessSession):
    def __init__(self, config: PromptLookup):
        self.config = config

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        batch = seqs.batch_size
        tokens = torch.zeros(batch, k, dtype=torch.long, device=seqs.tokens.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=seqs.tokens.device)
        for row, length in enumerate(seqs.lengths.tolist()):
            found = lookup(seqs.tokens[row, :length], self.config.max_ngram, self.config.min_ngram, k)
            tokens[row, : found.shape[0]] = found
            lengths[row] = found.shape[0]
        return Proposal(tokens, lengths)
