"""KV cache with a length per row, so rows of a batch can accept different numbers of drafts.

Layout: the HF cache holds ``T`` columns for every row; ``valid[b, t]`` says whether column ``t`` of
row ``b`` holds a live token. Rows are left-padded at prefill, and a rollback simply marks a row's
rejected columns invalid (they become holes that attention masks out), then drops trailing columns
that no row uses. Positions count live tokens only, so a row with holes computes exactly what it
would compute alone. When holes pile up, ``compact`` gathers each row's live columns to the right
and frees the rest, so memory stays proportional to the longest row.
"""

from __future__ import annotations

import torch

from . import hf


class KVCache:
    """A HF DynamicCache plus per-row validity and lengths. One rollback primitive: ``truncate``."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu", max_positions: int | None = None):
        # Drafts past a row's budget are computed (the batch shares one shape) but never kept;
        # clamping their positions keeps models with learned position tables in range.
        self.max_position = (max_positions or 2**62) - 1
        self.hf_cache = hf.new_cache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, T]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)   # [B] live tokens per row
        self._checked = False

    @property
    def columns(self) -> int:
        return self.valid.shape[1]

    def forward(self, model, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int,
                hidden_layers: tuple[int, ...] = ()):
        """Append a block of columns and run the model on it.

        tokens, valid: [B, n]; invalid entries are holes (their outputs are meaningless).
        Returns logits [B, logits_to_keep, V] for the last columns and hidden [B, n, L, H] or None.
        """
        rank = valid.cumsum(1)  # [B, n] live tokens up to and including each column
        positions = (self.lengths[:, None] + rank - 1).clamp_(0, self.max_position)
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.lengths = self.lengths + rank[:, -1]
        logits, hidden = hf.forward(model, tokens, self.valid, positions, self.hf_cache,
                                    logits_to_keep, hidden_layers)
        if not self._checked:
            hf.check_rollback(self.hf_cache)
            self._checked = True
        return logits, hidden

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first ``lengths[b]`` live tokens of each row (lengths: [B])."""
        live_rank = self.valid.long().cumsum(1)  # [B, T]
        self.valid = self.valid & (live_rank <= lengths[:, None])
        self.lengths = torch.minimum(self.lengths, lengths)
        used = self.valid.any(0).nonzero()
        stop = int(used[-1]) + 1 if used.numel() else 0
        if stop < self.columns:
            hf.slice_columns(self.hf_cache, 0, stop)
            self.valid = self.valid[:, :stop]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (finished rows leave the batch)."""
        hf.select_rows(self.hf_cache, index)
        self.valid = self.valid.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)

    def compact(self, slack: float = 0.5, minimum: int = 32) -> bool:
        """Right-align each row's live columns when holes exceed ``slack`` of the cache (or ``minimum``)."""
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if self.columns - longest <= max(minimum, int(slack * longest)):
            return False
        # A stable sort on validity puts each row's holes first and its live columns after, in order.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.columns - longest:]
        hf.gather_columns(self.hf_cache, order)
        self.valid = self.valid.gather(1, order)
        return True
