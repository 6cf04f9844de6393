"""Per-row bookkeeping of a KV cache, so rows of a batch can accept different numbers of drafts.

Layout: the cache holds ``T`` columns for every row; ``valid[b, t]`` says whether column ``t`` of
row ``b`` holds a live token. Rows are left-padded at prefill, and a rollback simply marks a row's
rejected columns invalid (they become holes that attention masks out), then drops trailing columns
that no row uses. Positions count live tokens only, so a row with holes computes exactly what it
would compute alone. When holes pile up, ``compact`` gathers each row's live columns to the right
and frees the rest, so memory stays proportional to the longest row.

``RaggedCache`` owns that bookkeeping; a backend subclasses it with the storage of the keys and
values and the forward pass (``hf.HFCache``, ``hf.RowwiseCache``, ``native.NativeCache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def lower_triangle(n: int, device=None) -> torch.Tensor:
    """[n, n] bool, True on and below the diagonal. Not ``torch.tril``: that one opens a parallel
    region even for a 2 x 2 mask, and the pool's threads then spin on the cores the kernels' threads
    need (measured: a 2-token forward pass of SmolLM2-135M 36.5 ms instead of 28.4 at 2 threads)."""
    index = torch.arange(n, device=device)
    return index[:, None] >= index[None, :]


@dataclass(frozen=True)
class Window:
    """Which earlier tokens a layer kind attends to, in live-token positions."""

    sliding: int | None = None  # a query at position p sees keys at positions > p - sliding
    chunk: int | None = None    # a query sees keys of its own chunk (position // chunk) only


FULL = Window()


class RaggedCache:
    """Validity and lengths per row. One rollback primitive: ``truncate``."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu", max_positions: int | None = None):
        # Drafts past a row's budget are computed (the batch shares one shape) but never kept;
        # clamping their positions keeps models with learned position tables in range.
        self.max_position = (max_positions or 2**62) - 1
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, T]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)   # [B] live tokens per row
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, T] of each column

    @property
    def columns(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 1,
                hidden_layers: tuple[int, ...] = (), block_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """Append a block of columns and run the model on it.

        tokens, valid: [B, n]; invalid entries are holes (their outputs are meaningless); valid None: none.
        logits_to_keep: the last m columns (int; 0 = all), or a LongTensor [B, m] of block columns.
        block_mask: [B, n, m] bool (m >= n): which of the last m columns (the m - n columns before
        the block, then the block) each new token sees; earlier live columns are always seen.
        None: causal within the block. Token trees use it with explicit ``positions`` (depths).
        positions: [B, n] explicit positions of the new tokens (None: live tokens counted in order).
        Returns logits [B, logits_to_keep, V] for the last columns and hidden [B, n, L, H] or None.
        """
        dense = valid is None
        if dense:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        past, positions = self.append(valid, positions, dense)
        return self._run(tokens, positions, past, logits_to_keep, hidden_layers, block_mask)

    def append(self, valid: torch.Tensor, positions: torch.Tensor | None = None, dense: bool = False):
        """The bookkeeping of a new block of columns (valid [B, n]); returns (its first column,
        positions [B, n]). dense: every entry of ``valid`` is True (the caller knows; fewer operations)."""
        past = self.columns
        if dense and positions is None:
            n = valid.shape[1]
            positions = self.lengths[:, None] + self._offsets(n)
            if self.max_position < 2**62 - 1:
                positions = positions.clamp(0, self.max_position)
            self.valid = torch.cat([self.valid, valid], dim=1)
            self.positions = torch.cat([self.positions, positions], dim=1)
            self.lengths = self.lengths + n
            return past, positions
        rank = valid.cumsum(1)  # [B, n] live tokens up to and including each column
        if positions is None:
            positions = self.lengths[:, None] + rank - 1
        positions = positions.clamp(0, self.max_position)
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)
        self.lengths = self.lengths + rank[:, -1]
        return past, positions

    def _offsets(self, n: int) -> torch.Tensor:
        """arange(n) on the cache's device, kept for the block widths that recur every step."""
        offsets = getattr(self, "_offset_cache", None)
        if offsets is None or offsets.shape[0] < n:
            offsets = self._offset_cache = torch.arange(max(n, 64), device=self.lengths.device)
        return offsets[:n]

    def visible(self, positions: torch.Tensor, past: int, block_mask: torch.Tensor | None,
                window: Window = FULL) -> torch.Tensor:
        """Which columns each new token attends to: [B, n, T] bool.

        Key positions count live columns, so windows are measured in tokens, not columns, and a row
        with holes sees exactly the keys it would see alone.
        """
        n = positions.shape[1]
        tree = block_mask is not None
        if not tree:
            block_mask = lower_triangle(n, positions.device)[None]
        start = past + n - block_mask.shape[2]  # first column the block mask covers
        seen = torch.cat([self.valid[:, None, :start].expand(-1, n, -1),
                          block_mask & self.valid[:, None, start:]], dim=2)  # [B, n, T]
        if window.sliding is None and window.chunk is None:
            return seen
        key_positions = self.positions  # [B, T]
        query, key = positions[:, :, None], key_positions[:, None, :]
        if window.sliding is not None:
            seen = seen & (query - key < window.sliding)
        if window.chunk is not None:
            seen = seen & (query // window.chunk == key // window.chunk)
        return seen

    def truncate(self, lengths: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Keep only the first ``lengths[b]`` live tokens of each row (lengths: [B]).

        keep: [B, m] bool over the last m columns, for trees: the branches not taken are dropped
        first, so the accepted path's columns (written at their depths) line up after the context.
        """
        if keep is not None:
            self.valid[:, self.columns - keep.shape[1]:] &= keep
        live_rank = self.valid.long().cumsum(1)  # [B, T]
        self.valid = self.valid & (live_rank <= lengths[:, None])
        self.lengths = torch.minimum(self.lengths, lengths)
        used = self.valid.any(0).nonzero()
        stop = int(used[-1]) + 1 if used.numel() else 0
        if stop < self.columns:
            self.valid = self.valid[:, :stop]
            self.positions = self.positions[:, :stop]
        self._truncated(stop)

    def forget(self, stop: int) -> None:
        """Drop every column from ``stop`` on, live or not: a block that was read for its outputs alone
        (lookahead's branch) leaves the cache as it was before, the columns before ``stop`` untouched."""
        if stop >= self.columns:
            return
        self.lengths = self.lengths - self.valid[:, stop:].sum(1)
        self.valid = self.valid[:, :stop]
        self.positions = self.positions[:, :stop]
        self._truncated(stop)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (finished rows leave the batch)."""
        self.valid = self.valid.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self._select_rows(index)

    def extend(self, other: "RaggedCache") -> None:
        """Append the rows of ``other`` (a cache of the same model holding requests that join the batch).

        The narrower cache gets holes on the right (invalid columns), so both have the same columns;
        every row keeps its live tokens, positions and order.
        """
        from specdec.batch import cat_rows

        columns = max(self.columns, other.columns)
        self._extend(other, columns)
        self.valid = cat_rows(self.valid, other.valid, False)
        self.positions = cat_rows(self.positions, other.positions, 0)
        self.lengths = torch.cat([self.lengths, other.lengths])

    def compact(self, slack: float = 0.5, minimum: int = 32) -> bool:
        """Right-align each row's live columns when holes exceed ``slack`` of the cache (or ``minimum``)."""
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if self.columns - longest <= max(minimum, int(slack * longest)):
            return False
        # A stable sort on validity puts each row's holes first and its live columns after, in order.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.columns - longest:]
        self.valid = self.valid.gather(1, order)
        self.positions = self.positions.gather(1, order)
        self._gather_columns(order)
        return True

    # Storage hooks of a backend.
    def _run(self, tokens, positions, past, logits_to_keep, hidden_layers, block_mask):
        raise NotImplementedError

    def _truncated(self, stop: int) -> None:
        """Columns from ``stop`` on are unused by every row (self.lengths is already updated)."""
        raise NotImplementedError

    def _select_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    def _gather_columns(self, order: torch.Tensor) -> None:
        """Column ``order[b, t]`` of row b becomes its column t. order: [B, T']."""
        raise NotImplementedError

    def _extend(self, other: "RaggedCache", columns: int) -> None:
        """Storage of ``other``'s rows after this cache's, both ``columns`` wide (the bookkeeping follows)."""
        raise NotImplementedError

    @property
    def memory_bytes(self) -> int:
        return 0
