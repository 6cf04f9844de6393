"""The committed tokens of every live row: the one thing drafters read to propose."""

from __future__ import annotations

import torch


class Sequences:
    """Prompt plus generated tokens per row. tokens: [B, capacity], lengths: [B].

    The capacity must exceed the longest row by the widest block ever appended (k + 1 columns).
    """

    def __init__(self, prompts: list[list[int]], capacity: int, pad_token_id: int,
                 device: torch.device | str = "cpu"):
        self.tokens = torch.full((len(prompts), capacity), pad_token_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            self.tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)  # [B]

    @classmethod
    def widened(cls, other: "Sequences", columns: int, pad_token_id: int) -> "Sequences":
        """A copy of ``other`` with ``columns`` more of capacity (a scratch copy that can grow apart)."""
        copy = cls.__new__(cls)
        copy.tokens = torch.cat([other.tokens, other.tokens.new_full((other.batch_size, columns), pad_token_id)], 1)
        copy.lengths = other.lengths.clone()
        return copy

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def append(self, new_tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append the first counts[b] entries of new_tokens[b] (new_tokens: [B, n], counts: [B]).

        All n columns are written (the capacity has room for them); entries past a row's length
        are never read and get overwritten by the next append.
        """
        columns = self.lengths[:, None] + torch.arange(new_tokens.shape[1], device=new_tokens.device)
        self.tokens.scatter_(1, columns, new_tokens)
        self.lengths = self.lengths + counts

    def window(self, starts: torch.Tensor, stops: torch.Tensor, pad_token_id: int):
        """Tokens [starts[b], stops[b]) of each row, left-padded to one block.

        Returns (tokens [B, n], valid [B, n]) with n = max(stops - starts).
        """
        n = int((stops - starts).max()) if starts.numel() else 0
        columns = stops[:, None] - n + torch.arange(n, device=starts.device)  # [B, n]
        valid = columns >= starts[:, None]
        tokens = self.tokens.gather(1, columns.clamp_min(0))
        return tokens.masked_fill(~valid, pad_token_id), valid

    def row(self, index: int) -> list[int]:
        return self.tokens[index, : int(self.lengths[index])].tolist()

    def select_rows(self, index: torch.Tensor) -> None:
        self.tokens = self.tokens.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)

    def extend(self, other: "Sequences") -> None:
        """Append the rows of ``other`` (requests joining the batch); the capacity becomes the larger one."""
        self.tokens = cat_rows(self.tokens, other.tokens)  # entries past a row's length are never read
        self.lengths = torch.cat([self.lengths, other.lengths])


def pad_columns(values: torch.Tensor, columns: int, fill) -> torch.Tensor:
    """values [B, T, ...] widened to ``columns`` along dim 1 with ``fill`` on the right."""
    missing = columns - values.shape[1]
    if missing <= 0:
        return values
    pad = values.new_full((values.shape[0], missing, *values.shape[2:]), fill)
    return torch.cat([values, pad], dim=1)


def cat_rows(first: torch.Tensor, second: torch.Tensor, fill=0) -> torch.Tensor:
    """Rows of both [B, T, ...] tensors, the narrower one padded along dim 1 with ``fill``."""
    columns = max(first.shape[1], second.shape[1])
    return torch.cat([pad_columns(first, columns, fill), pad_columns(second, columns, fill)])


def keep_rows(store: torch.Tensor, index: torch.Tensor, dim: int = 0,
              used: tuple[int, int] | None = None) -> torch.Tensor:
    """``store`` with rows ``index`` (along ``dim``) first, for a batch whose rows leave.

    Rows that can move in place do, and the same store comes back (its rows past len(index) are
    free): a row moves to a slot before its own (rows kept in order), or from past the kept rows into
    a leaving row's slot (``leaving_order``'s order: one copy per leaving row). ``used`` = (dim, n):
    only the first n entries along that dim are live (a cache's written columns), so only those move.
    Any other order: a new store of just those rows."""
    rows = index.tolist()
    kept = len(rows)
    if len(set(rows)) < kept or any(row < slot for slot, row in enumerate(rows)):
        return store.index_select(dim, index)
    for slot, row in enumerate(rows):
        if row != slot:
            source, target = store.select(dim, row), store.select(dim, slot)
            if used is not None:
                axis = used[0] - (used[0] > dim)  # the dim in the row's slice
                source, target = source.narrow(axis, 0, used[1]), target.narrow(axis, 0, used[1])
            target.copy_(source)
    return store


def leaving_order(size: int, leaving) -> list[int]:
    """The rows that stay when rows ``leaving`` leave a batch of ``size``, in their new order: each
    leaving row's slot below the new size is taken by the last rows, the others keep theirs, so a
    departure moves one row of every per-row store instead of every row after it (``keep_rows``)."""
    gone = set(leaving)
    kept = size - len(gone)
    movers = [row for row in range(kept, size) if row not in gone]
    order = list(range(kept))
    for hole, mover in zip(sorted(row for row in gone if row < kept), movers):
        order[hole] = mover
    return order


class Backlog:
    """Feature columns [B, m, F] (with valid [B, m]) that wait for a drafter, appended step after step.

    One buffer, grown by doubling and reused after ``clear``, so appending a step's columns copies
    those columns only (a concatenation per step would copy the whole backlog every step, and a
    drafter that is not asked for drafts under load lets it grow for as long as a request lives).
    Rows that leave and rows that join are moved within it, as the target's cache moves its rows."""

    def __init__(self, batch_size: int):
        self.batch_size, self.m = batch_size, 0
        self.store: torch.Tensor | None = None  # [rows >= B, capacity, F]
        self.mask: torch.Tensor | None = None   # [rows, capacity] bool

    def waiting(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(states [B, m, F], valid [B, m]) of the waiting columns, or (None, None) when none wait."""
        if not self.m:
            return None, None
        return self.store[:self.batch_size, :self.m], self.mask[:self.batch_size, :self.m]

    def clear(self) -> None:
        self.m = 0

    def _room(self, rows: int, columns: int, like: torch.Tensor) -> None:
        """A store of at least ``rows`` rows and ``columns`` columns holding the waiting columns."""
        have_rows, have_columns = (0, 0) if self.store is None else self.store.shape[:2]
        if rows <= have_rows and columns <= have_columns and like.dtype == self.store.dtype:
            return
        rows = rows if rows <= have_rows else max(rows, 2 * have_rows)
        columns = columns if columns <= have_columns else max(columns, 2 * have_columns)
        store = like.new_zeros(rows, columns, like.shape[-1])
        mask = torch.zeros(rows, columns, dtype=torch.bool, device=like.device)
        if self.m:
            store[:self.batch_size, :self.m] = self.store[:self.batch_size, :self.m]
            mask[:self.batch_size, :self.m] = self.mask[:self.batch_size, :self.m]
        self.store, self.mask = store, mask

    def append(self, states: torch.Tensor, valid: torch.Tensor) -> None:
        """Columns states [B, n, F] / valid [B, n] after the waiting ones."""
        n = states.shape[1]
        self._room(self.batch_size, self.m + n, states if self.store is None else self.store)
        self.store[:self.batch_size, self.m:self.m + n] = states
        self.mask[:self.batch_size, self.m:self.m + n] = valid
        self.m += n

    def select_rows(self, index: torch.Tensor) -> None:
        if self.m:
            self.store = keep_rows(self.store, index, used=(1, self.m))  # the waiting columns only
            self.mask = keep_rows(self.mask, index, used=(1, self.m))
        self.batch_size = index.numel()

    def extend(self, other: "Backlog") -> None:
        """Append ``other``'s rows, each row's waiting columns first, holes (invalid) after."""
        joining = other.batch_size
        if self.m or other.m:
            self._room(self.batch_size + joining, max(self.m, other.m), self.store if self.m else other.store)
            first, rows = self.batch_size, slice(self.batch_size, self.batch_size + joining)
            self.mask[:first, self.m:other.m] = False
            self.mask[rows, :max(self.m, other.m)] = False
            if other.m:
                self.store[rows, :other.m] = other.store[:joining, :other.m]
                self.mask[rows, :other.m] = other.mask[:joining, :other.m]
            self.m = max(self.m, other.m)
        self.batch_size += joining
