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


def pad_columns(values: torch.Tensor, columns: int, fill, left: bool = False) -> torch.Tensor:
    """values [B, T, ...] widened to ``columns`` along dim 1 with ``fill`` (on the right, or the left)."""
    missing = columns - values.shape[1]
    if missing <= 0:
        return values
    pad = values.new_full((values.shape[0], missing, *values.shape[2:]), fill)
    return torch.cat([pad, values] if left else [values, pad], dim=1)


def cat_rows(first: torch.Tensor, second: torch.Tensor, fill=0, left: bool = False) -> torch.Tensor:
    """Rows of both [B, T, ...] tensors, the narrower one padded along dim 1 with ``fill``."""
    columns = max(first.shape[1], second.shape[1])
    return torch.cat([pad_columns(first, columns, fill, left), pad_columns(second, columns, fill, left)])
