"""Lookahead decoding: n-grams harvested from Jacobi iterations that ride along in the verification pass.

No second model and no training. Each row keeps a window of ``ngram - 1`` levels by ``window`` columns
of guessed tokens, and every verification pass carries the window after the verified block (the
*lookahead branch*). Column i reads as one sequence continuing the pending token p:

    p, L0[0], L0[1], ..., L0[i], L1[i], L2[i], ..., L_{N-2}[i]      (positions P, P+1, ..., P+1+i+N-2)

so the level-0 tokens form one causal run shared by every column, and each column climbs its own
levels. The target's argmax at the top level of column i is a new guess; the column's tokens from
L0[i] up, followed by that guess, make an n-gram: L0[i] is its key, the N - 1 tokens above it its
value. The levels then shift down by one (level 0 leaves, the guesses become the new top level), a
Jacobi iteration per step.

The n-grams go into a pool per row (``guesses`` most recent values per key), seeded with the prompt's
n-grams and fed the committed text's as it grows. Drafts are the pool's values keyed by the pending
token, newest first: the first as a chain of k, or up to ``topk`` of them merged into a prefix tree.

Exact by construction: the verified rows never see the branch's columns, and the branch's keys and
values leave the cache before verification returns, so the target computes exactly what plain
verification of the same drafts computes. The drafts are point masses (no distribution), verified by
exact match (greedy) or the q = 1 rule (sampling). The window advances by argmax in both modes.

The method's (W, N, G): ``window``, ``ngram``, ``guesses`` (the reference implementation's WINDOW_SIZE,
LEVEL, GUESS_SET_SIZE; TensorRT-LLM's lookahead_config [W, N, G]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.batch import Sequences
from specdec.backends.cache import lower_triangle
from specdec.drafters.base import DecodeContext, Proposal
from specdec.drafters.prompt_lookup import prefix_tree, tree_proposal
from specdec.errors import InvalidArgumentError, UnsupportedModelError
from specdec.models import kernels


class NgramPool:
    """Continuations of ``size`` tokens per key token, the most recently added first, at most
    ``capacity`` per key (an added value already held moves to the front)."""

    def __init__(self, size: int, capacity: int):
        self.size, self.capacity = size, capacity
        self.values: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, value: tuple[int, ...]) -> None:
        held = self.values.setdefault(key, [])
        if value in held:
            held.remove(value)
        held.insert(0, value)
        del held[self.capacity:]

    def add_text(self, tokens: list[int], start: int = 0) -> None:
        """Every n-gram of ``tokens`` whose key sits at ``start`` or later (and whose value is whole)."""
        for key in range(start, len(tokens) - self.size):
            self.add(tokens[key], tuple(tokens[key + 1: key + 1 + self.size]))

    def get(self, key: int) -> list[tuple[int, ...]]:
        return self.values.get(key, [])


def branch_layout(window: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [m, m] bool, offsets [m] long) of the lookahead branch, m = levels * window tokens in level-major
    order (token j * window + i is level j, column i): which branch tokens each one sees, and its position
    after the pending token's. Every branch token also sees the pending token and the committed context."""
    level = torch.arange(levels).repeat_interleave(window)
    column = torch.arange(window).repeat(levels)
    seen_level, seen_column = level[None, :], column[None, :]
    shared_run = (seen_level == 0) & (seen_column <= column[:, None])           # L0[0..i]
    own_column = (seen_level >= 1) & (seen_column == column[:, None]) & (seen_level <= level[:, None])
    return shared_run | own_column, 1 + column + level


@dataclass(frozen=True)
class Lookahead:
    window: int = 2      # W: columns of the Jacobi window (on CPUs every column costs N - 1 rows of each pass)
    ngram: int = 4       # N: n-gram length (the window holds N - 1 levels; drafts are N - 1 tokens deep)
    guesses: int = 4     # G: values kept per key in the pool (a tree takes up to its topk of them)
    seed: int = 0        # the window's first guesses: tokens of the prompt, drawn with this seed
    name: str = "lookahead"

    def __post_init__(self):
        if self.window < 1 or self.ngram < 2 or self.guesses < 1:
            raise InvalidArgumentError(f"lookahead needs window >= 1, ngram >= 2 and guesses >= 1, got window "
                                       f"{self.window}, ngram {self.ngram}, guesses {self.guesses}")

    @property
    def default_draft_tokens(self) -> int:
        """k when none is asked for: the pool's n-grams are N - 1 drafts deep."""
        return self.ngram - 1

    @property
    def setting(self) -> str:
        return f"W={self.window} N={self.ngram} G={self.guesses}"

    @property
    def branch_tokens(self) -> int:
        """Tokens the lookahead branch adds to every verification pass."""
        return self.window * (self.ngram - 1)

    def start(self, context: DecodeContext, seqs: Sequences) -> "LookaheadSession":
        backend = context.target.backend
        if not backend.supports_trees:
            raise UnsupportedModelError(f"{backend.description} cannot run lookahead's window, which needs a "
                                        f"block attention mask: {backend.reason or 'it takes none'}")
        return LookaheadSession(self, context, seqs)


class LookaheadSession:
    def __init__(self, config: Lookahead, context: DecodeContext, seqs: Sequences):
        self.config, self.tree = config, context.tree
        levels = config.ngram - 1
        self.mask, self.offsets = (t.to(seqs.tokens.device) for t in branch_layout(config.window, levels))
        self.pools: list[NgramPool] = []
        self.seen: list[int] = []  # committed tokens of each row already in its pool
        generator = torch.Generator().manual_seed(config.seed)
        windows = []
        for row, length in enumerate(seqs.lengths.tolist()):
            tokens = seqs.tokens[row, :length].cpu()
            pool = NgramPool(levels, config.guesses)
            pool.add_text(tokens.tolist())
            self.pools.append(pool)
            self.seen.append(length)
            picks = torch.randint(length, (levels, config.window), generator=generator)
            windows.append(tokens[picks])
        self.window = torch.stack(windows).to(seqs.tokens.device)  # [B, levels, W]

    # -- drafting ------------------------------------------------------------------------------------
    def propose(self, seqs: Sequences, k: int) -> Proposal:
        pending = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])[:, 0].tolist()
        device = seqs.tokens.device
        if self.tree is None:  # the newest n-gram of each row, as a chain
            chains = [list(found[0][:k]) if found else [] for found in map(NgramPool.get, self.pools, pending)]
            return tree_proposal([(c, list(range(-1, len(c) - 1)), list(range(1, len(c) + 1))) for c in chains], device,
                                 width=k, chain=True)
        depth = min(self.tree.depth, self.config.ngram - 1)
        rows = [prefix_tree([list(value[:depth]) for value in pool.get(token)[: self.tree.topk]], self.tree.num_nodes)
                for pool, token in zip(self.pools, pending)]
        return tree_proposal(rows, device)

    def verify_forward(self, cache, tokens, valid, logits_to_keep: int = 1, hidden_layers=(), block_mask=None,
                       positions=None):
        """Target.forward over [pending, drafts] with the lookahead branch after it; returns what the block
        alone returns, and advances the window from the branch's outputs."""
        batch, n = tokens.shape
        levels, width = self.window.shape[1:]
        m = levels * width
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        start = cache.lengths[:, None]  # the pending token's position
        if positions is None:
            positions = start + valid.long().cumsum(1) - 1
        mask = torch.zeros(batch, n + m, n + m, dtype=torch.bool, device=tokens.device)
        mask[:, :n, :n] = lower_triangle(n, tokens.device)[None] if block_mask is None else block_mask
        mask[:, n:, 0] = True  # the pending token
        mask[:, n:, n:] = self.mask
        keep = torch.cat([torch.arange(n, device=tokens.device),
                          n + (levels - 1) * width + torch.arange(width, device=tokens.device)])
        columns = cache.columns
        logits, hidden = cache.forward(torch.cat([tokens, self.window.reshape(batch, m)], 1),
                                       torch.cat([valid, valid.new_ones(batch, m)], 1),
                                       keep.expand(batch, -1), hidden_layers, mask,
                                       torch.cat([positions, start + self.offsets], 1))
        cache.forget(columns + n)  # the branch's columns: read for their outputs alone
        self._advance(kernels.argmax(logits[:, n:]))
        logits = logits[:, :n]
        if logits_to_keep:
            logits = logits[:, n - logits_to_keep:]
        return logits, None if hidden is None else hidden[:, :n]

    def _advance(self, guesses: torch.Tensor) -> None:
        """The top level's outputs [B, W]: harvest each column's n-gram, then shift the levels down."""
        window = torch.cat([self.window, guesses[:, None]], 1)  # [B, levels + 1, W]
        for pool, grams in zip(self.pools, window.permute(0, 2, 1).tolist()):  # [W, levels + 1] per row
            for gram in grams:
                pool.add(gram[0], tuple(gram[1:]))
        self.window = window[:, 1:].contiguous()

    # -- bookkeeping ---------------------------------------------------------------------------------
    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        """The committed text's new n-grams join each row's pool."""
        size = self.config.ngram - 1
        for row, length in enumerate(seqs.lengths.tolist()):
            first = max(0, self.seen[row] - size)
            self.pools[row].add_text(seqs.tokens[row, first:length].tolist())
            self.seen[row] = length

    def select_rows(self, index: torch.Tensor) -> None:
        rows = index.tolist()
        self.pools = [self.pools[i] for i in rows]
        self.seen = [self.seen[i] for i in rows]
        self.window = self.window.index_select(0, index)

    def extend(self, other: "LookaheadSession") -> None:
        self.pools += other.pools
        self.seen += other.seen
        self.window = torch.cat([self.window, other.window])
