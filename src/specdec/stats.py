"""Statistics every generation returns; benchmarks only read them.

Names follow the serving engines where they overlap: ``mean_accepted_length`` (tau, bonus token
included) is vLLM's "mean acceptance length" and SGLang's ``avg_spec_accept_length``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Stats:
    drafter: str = "none"
    draft_schedule: str = "constant"
    batch_size: int = 0
    backend: str = ""                 # how the target ran: "hf/sdpa", "hf/eager/rowwise", "native"
    exact_numerics: bool = False      # the target computes a row bit for bit alike in any block shape, so
                                      # speculative output equals plain decoding (a drafter's never matter)
    logits_processors: list[str] = field(default_factory=list)  # generation-config processing applied
    cache_bytes: int = 0              # the target's KV cache at the end (preallocated size on native)
    cache_grown: int = 0              # times a preallocated cache had to grow (0 when sized right)
    new_tokens: int = 0
    target_forwards: int = 0          # batched target passes, prefill included
    verify_steps: int = 0             # row-steps: one row verified once
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    drafts_evaluated: int = 0         # drafts the acceptance rule looked at (up to the first rejection)
    tokens_from_steps: int = 0        # sum over row-steps of accepted drafts + 1
    k_sum: int = 0                    # sum over row-steps of drafts proposed (tree nodes), for the mean k
    drafts_cut: int = 0               # drafts the drafter made that the policy's cut left unverified (not
                                      # counted as proposed: acceptance counts what was verified)
    proposed_at: list[int] = field(default_factory=list)   # [j] row-steps proposing >= j+1 drafts
    accepted_at: list[int] = field(default_factory=list)   # [j] row-steps accepting >= j+1 drafts
    accepted_histogram: list[int] = field(default_factory=list)  # [a] row-steps accepting exactly a
    k_history: list[int] = field(default_factory=list)     # k used at each batched step
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    feature_time: float = 0.0         # gathering the target's features of committed tokens for the drafter
                                      # (part of draft_time; computing them is part of the target passes)
    total_time: float = 0.0
    _steps: list = field(default_factory=list, repr=False)  # (proposed [B], accepted [B]) per step
    _cuts: list = field(default_factory=list, repr=False)   # [B] drafts cut per row, per step that cut

    def record_step(self, k: int, proposed: torch.Tensor, accepted: torch.Tensor,
                    nodes: torch.Tensor | None = None) -> None:
        """proposed, accepted: [B] drafts per live row in one verification step (tallied in finalize).

        Trees: ``proposed`` is each row's deepest draft (acceptance is counted per depth) and
        ``nodes`` [B] the drafts it verified; chains verify ``proposed`` drafts.
        """
        self.k_history.append(k)
        self._steps.append((proposed, accepted, proposed if nodes is None else nodes))

    def record_cut(self, dropped: torch.Tensor) -> None:
        """dropped: [B] drafts per row a policy's cut removed from this step's proposal."""
        self._cuts.append(dropped)

    def finalize(self) -> None:
        """Fold the recorded steps into the counters: one pass at the end, nothing in the decode loop."""
        if self._cuts:
            self.drafts_cut += int(torch.cat(self._cuts).sum())
            self._cuts = []
        if not self._steps:
            return
        proposed = torch.cat([p for p, _, _ in self._steps])  # [row-steps]
        accepted = torch.cat([a for _, a, _ in self._steps])
        nodes = torch.cat([n for _, _, n in self._steps])
        self._steps = []
        width = max(max(self.k_history), 1)
        slots = torch.arange(1, width + 1, device=proposed.device)
        rows = proposed.shape[0]
        self.verify_steps += rows
        self.drafts_proposed += int(nodes.sum())
        self.k_sum += int(nodes.sum())
        self.drafts_accepted += int(accepted.sum())
        self.drafts_evaluated += int(accepted.sum()) + int((accepted < proposed).sum())
        self.tokens_from_steps += int(accepted.sum()) + rows
        for name, counts in (("proposed_at", (proposed[:, None] >= slots).sum(0)),
                             ("accepted_at", (accepted[:, None] >= slots).sum(0)),
                             ("accepted_histogram", torch.bincount(accepted, minlength=width + 1))):
            totals = getattr(self, name)
            totals.extend([0] * (len(counts) - len(totals)))
            for j, count in enumerate(counts.tolist()):
                totals[j] += count

    # Derived numbers -------------------------------------------------------------------------
    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens committed per row per target verification, bonus included."""
        return self.tokens_from_steps / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts (vLLM's draft acceptance rate)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    @property
    def alpha(self) -> float:
        """Per-draft acceptance probability: accepted over drafts evaluated before a rejection."""
        return self.drafts_accepted / self.drafts_evaluated if self.drafts_evaluated else 0.0

    @property
    def mean_k(self) -> float:
        return self.k_sum / self.verify_steps if self.verify_steps else 0.0

    @property
    def predicted_mean_accepted_length(self) -> float:
        """(1 - alpha^(k+1)) / (1 - alpha) at the mean k, if drafts were accepted independently."""
        alpha, k = self.alpha, self.mean_k
        if alpha >= 1.0:
            return k + 1.0
        return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of drafts at position j accepted, among row-steps proposing a j-th draft."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def tokens_per_verified_token(self) -> float:
        """Tokens committed per token the target verified (pending token + drafts or tree nodes)."""
        verified = self.k_sum + self.verify_steps
        return self.tokens_from_steps / verified if verified else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        del data["_steps"], data["_cuts"]
        for name in ("mean_accepted_length", "acceptance_rate", "alpha", "mean_k",
                     "predicted_mean_accepted_length", "acceptance_by_position", "tokens_per_second",
                     "tokens_per_verified_token"):
            data[name] = getattr(self, name)
        return data

    def summary(self) -> str:
        lines = [
            f"drafter {self.drafter} ({self.draft_schedule} k, mean k {self.mean_k:.2f}), batch {self.batch_size}, "
            f"backend {self.backend or '?'} ({'exact' if self.exact_numerics else 'inexact'} numerics)"
            + (f", logits processing {', '.join(self.logits_processors)}" if self.logits_processors else ""),
            f"new tokens {self.new_tokens}, target forwards {self.target_forwards}, "
            f"{self.tokens_per_second:.1f} tokens/s",
            f"tau {self.mean_accepted_length:.3f} (predicted from alpha {self.predicted_mean_accepted_length:.3f}), "
            f"alpha {self.alpha:.3f}, acceptance rate {self.acceptance_rate:.3f} "
            f"({self.drafts_accepted}/{self.drafts_proposed})"
            + (f", {self.drafts_cut} more drafts cut by the policy before verification" if self.drafts_cut else ""),
            "acceptance by position " + " ".join(f"{r:.2f}" for r in self.acceptance_by_position),
            "accepted-length histogram " + " ".join(str(c) for c in self.accepted_histogram),
            f"time: prefill {self.prefill_time:.3f}s, draft {self.draft_time:.3f}s, "
            f"verify {self.verify_time:.3f}s, total {self.total_time:.3f}s"
            + (f" (features handed to the drafter {self.feature_time:.3f}s)" if self.feature_time else "") + "; "
            f"target KV cache {self.cache_bytes / 2**20:.2f} MiB",
        ]
        return "\n".join(lines)
