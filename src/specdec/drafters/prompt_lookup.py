"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's tail.

With a tree config it offers several continuations instead: the most recent occurrences of the
longest matching n-gram first (then shorter n-grams), merged into one prefix tree per row.

Tries the longest n-gram first (max_ngram down to min_ngram) over prompt and generated text. When
the continuation runs into the end of the context (the most recent match of a repeating pattern
overlaps the tail), it keeps copying with the same offset through the tokens it has just proposed,
so a repeating pattern yields a full k drafts. It has no distribution, so verification treats each
draft as a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.batch import Sequences
from specdec.errors import InvalidArgumentError
from specdec.drafters.base import DecodeContext, Proposal, StatelessSession, TreeConfig


def continuation(tokens: torch.Tensor, start: int, k: int) -> torch.Tensor:
    """k tokens from ``start``; past the end of the context, a repeating pattern keeps its period."""
    found = tokens[start: start + k]
    if found.shape[0] < k:  # periodic: draft j repeats the token `period` places before it
        period = tokens.shape[0] - start
        found = tokens[start:].repeat(k // period + 1)[:k]
    return found


def longest_occurring(shortest: int, longest: int, occurs) -> int:
    """The largest n in [shortest, longest] with ``occurs(n)``, or shortest - 1 where there is none, bisected: a
    context's n-token tail that occurs somewhere makes its (n-1)-token tail occur (one place on), so ``occurs``
    holds up to some n and fails beyond it."""
    found, absent = shortest - 1, longest + 1
    while absent - found > 1:
        n = (found + absent) // 2
        found, absent = (n, absent) if occurs(n) else (found, n)
    return found


def match_starts(tokens: torch.Tensor, max_ngram: int, min_ngram: int):
    """Where continuations of the context's tail start: longest tail n-gram first, and for each n
    the most recent earlier occurrence first. tokens: [L] long, the whole context."""
    length = tokens.shape[0]
    found: dict[int, list[int]] = {}
    ids = tokens.cpu().numpy()  # numpy's small operations cost a fraction of torch's (a drafting step makes several)

    def hits(n: int) -> list[int]:  # window starts, in order, of every earlier occurrence of the n-token tail
        if n not in found:  # windows that end before the last token, narrowed token by token
            starts = np.flatnonzero(ids[: length - n] == ids[length - n])
            for j in range(1, n):
                starts = starts[ids[starts + j] == ids[length - n + j]]
            found[n] = starts.tolist()
        return found[n]

    longest = longest_occurring(min_ngram, min(max_ngram, length - 1), lambda n: bool(hits(n)))
    for n in range(longest, min_ngram - 1, -1):  # the longer tails, which do not occur, have nothing to yield
        for hit in reversed(hits(n)):
            yield hit + n


def lookup_many(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k: int, matches: int) -> list[list[int]]:
    """Up to ``matches`` distinct continuations of k tokens, in the order of ``match_starts``."""
    found: list[list[int]] = []
    for start in match_starts(tokens, max_ngram, min_ngram):
        candidate = continuation(tokens, start, k).tolist()
        if candidate not in found:
            found.append(candidate)
            if len(found) == matches:
                break
    return found


def prefix_tree(paths: list[list[int]], num_nodes: int) -> tuple[list[int], list[int], list[int]]:
    """Merge token paths into one prefix tree; (tokens, parents, depths) of its first num_nodes nodes by depth.

    Earlier paths come first within a depth, so a cap keeps the most recent matches' tokens.
    """
    children: dict[tuple[int, int], int] = {}
    nodes: list[tuple[int, int, int]] = []  # (depth, parent node, token)
    for path in paths:
        parent = -1
        for depth, token in enumerate(path, 1):
            key = (parent, token)
            if key not in children:
                children[key] = len(nodes)
                nodes.append((depth, parent, token))
            parent = children[key]
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i][0], i))[:num_nodes]
    new_index = {old: new for new, old in enumerate(order)}
    return ([nodes[i][2] for i in order], [new_index.get(nodes[i][1], -1) for i in order],
            [nodes[i][0] for i in order])


def lookup(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k: int) -> torch.Tensor:
    """k tokens that followed the latest earlier match of the longest matching tail n-gram.

    tokens: [L] long, the whole context. Returns [k] long, or [0] when nothing matches.
    """
    start = next(match_starts(tokens, max_ngram, min_ngram), None)
    return tokens[:0] if start is None else continuation(tokens, start, k)


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
        return PromptLookupSession(self, context.tree)


class PromptLookupSession(StatelessSession):
    def __init__(self, config: PromptLookup, tree: TreeConfig | None = None):
        self.config, self.tree = config, tree

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        if self.tree is not None:
            return self._propose_tree(seqs)
        batch = seqs.batch_size
        tokens = torch.zeros(batch, k, dtype=torch.long, device=seqs.tokens.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=seqs.tokens.device)
        for row, length in enumerate(seqs.lengths.tolist()):
            found = lookup(seqs.tokens[row, :length], self.config.max_ngram, self.config.min_ngram, k)
            tokens[row, : found.shape[0]] = found
            lengths[row] = found.shape[0]
        return Proposal(tokens, lengths)

    def _propose_tree(self, seqs: Sequences) -> Proposal:
        """Several matches (up to ``topk``), ``depth`` tokens each, merged into one prefix tree per row."""
        tree, device = self.tree, seqs.tokens.device
        rows = []
        for row, length in enumerate(seqs.lengths.tolist()):
            paths = lookup_many(seqs.tokens[row, :length], self.config.max_ngram, self.config.min_ngram,
                                tree.depth, tree.topk)
            rows.append(prefix_tree(paths, tree.num_nodes))
        return tree_proposal(rows, device)


def tree_proposal(rows: list[tuple[list[int], list[int], list[int]]], device, width: int | None = None,
                  chain: bool = False) -> Proposal:
    """A Proposal from each row's (tokens, parents, depths), padded to ``width`` (default: the widest row);
    ``chain``: the rows are paths, proposed as chains."""
    width = width or max(1, max(len(tokens) for tokens, _, _ in rows))
    lengths = torch.tensor([len(t) for t, _, _ in rows], dtype=torch.long, device=device)
    if chain:  # one tensor from the padded lists (a staged draft model asks for a chain every pass)
        return Proposal(torch.tensor([list(t) + [0] * (width - len(t)) for t, _, _ in rows], dtype=torch.long,
                                     device=device), lengths)
    table = torch.zeros(3, len(rows), width, dtype=torch.long)  # tokens, parents, depths
    table[1] = -1
    for row, columns in enumerate(rows):
        table[:, row, : len(columns[0])] = torch.tensor(columns, dtype=torch.long).reshape(3, -1)
    tokens, parents, depths = table.to(device)
    return Proposal(tokens, lengths, None, parents, depths)
