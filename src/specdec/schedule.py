"""How many drafts a step verifies: fixed, a per-batch-size table, or chosen from the load.

A policy is asked once per step and group (``draft_tokens``) and told what happened (``observe``).
Whatever it decides, output is unchanged: it decides before the target sees this step's drafts,
from what earlier steps measured, so the choice never depends on whether they will be accepted.

``LoadAware`` maximises expected committed tokens per second. At start-up it times the target's
verification pass T(b, n) for b rows of n tokens on this machine; each step it estimates, for
k = 0, 1, 2, ..., the tokens a step commits (b rows times 1 + the survival probabilities of the
first k drafts, from the acceptance observed at each position) over the step's cost (T(b, k + 1),
k drafts at the drafting cost observed for this batch size, the engine's own overhead), and stops
at the first k that lowers it. Under load the verification of extra drafts costs more than they
return, and the policy drafts less, down to plain decoding.
"""

from __future__ import annotations

import bisect
import time

import torch

from specdec.errors import InvalidArgumentError


class FixedK:
    """The engine's k (or its heuristic schedule) at every step."""

    name = "fixed"
    wants_counts = False  # observe gets each row's drafts and accepted drafts (a host sync per step)

    def prepare(self, engine) -> None:
        pass

    def draft_tokens(self, engine, group) -> int:
        return engine.config.num_draft_tokens

    def observe(self, engine, group, width: int, proposed: list[int] | None, accepted: list[int] | None,
                timing: dict) -> None:
        """After a step of ``width`` drafts per row; timing: seconds of drafting and of the whole step."""


class StaticTable(FixedK):
    """vLLM's ``num_speculative_tokens_per_batch_size``: k by batch size, 0 turning speculation off.

    table: {smallest batch size: k}; a batch of b rows uses the entry of the largest size <= b.
    """

    name = "static"

    def __init__(self, table: dict[int, int]):
        if not table or 1 not in table:
            raise InvalidArgumentError(f"a per-batch-size table needs an entry for batch size 1, got {table}")
        if any(b < 1 or k < 0 for b, k in table.items()):
            raise InvalidArgumentError(f"batch sizes must be >= 1 and draft lengths >= 0, got {table}")
        self.sizes = sorted(table)
        self.table = dict(table)

    def draft_tokens(self, engine, group) -> int:
        size = self.sizes[bisect.bisect_right(self.sizes, group.size) - 1]
        return min(self.table[size], engine.config.k_limit)


class LoadAware(FixedK):
    """Drafts per step chosen from the profiled cost of verification and the observed acceptance.

    max_draft_tokens: the most drafts a step may verify (default: the engine's k).
    decay: weight of the past in the acceptance and cost estimates (per step; the first estimates
    are plain means, so one slow first step does not stick).
    prior: acceptance assumed at a position before any draft there was verified.
    explore: after this many steps without drafting, one step drafts a token when drafting is
    estimated within ``margin`` of plain decoding (so the estimates of a close call stay current when
    the text changes; a clear loss is not probed, since keeping a drafter current costs too).
    gain: a draft is added only if it raises the expected rate by this share (the estimates are
    noisy, and a wrong draft under load costs more than a missed one at low load).
    Costs measured online are pooled by batch size in powers of two.
    """

    name = "load-aware"
    wants_counts = True

    def __init__(self, max_draft_tokens: int | None = None, decay: float = 0.98, prior: float = 0.7,
                 context: int = 64, repeats: int = 3, explore: int = 16, margin: float = 0.2,
                 gain: float = 0.03):
        self.max_draft_tokens, self.decay, self.prior, self.explore = max_draft_tokens, decay, prior, explore
        self.margin, self.gain = margin, gain
        self.undrafted = 0  # steps since the last one that drafted
        self.context, self.repeats = context, repeats
        self.sizes: list[int] = []
        self.table: dict[tuple[int, int], float] = {}   # (rows, tokens per row) -> seconds of one pass
        self.accepted: list[float] = []    # decayed counts per position: accepted
        self.evaluated: list[float] = []   # ... and evaluated (reached: every earlier draft accepted)
        self.draft_cost: dict[int, list] = {}  # batch size -> [seconds per draft token, observations]
        self.overhead = {False: {}, True: {}}  # plain / speculative step: batch size -> [seconds beyond the passes, n]
        self.enabled = True
        self.last_choice = 0

    def prepare(self, engine) -> None:
        self.enabled = engine.speculates and engine.tree is None and not engine.static_tree
        if not self.enabled:
            return
        if engine.config.draft_schedule != "constant":
            raise InvalidArgumentError("the load-aware policy chooses k itself: use the constant draft schedule")
        self.k_max = min(self.max_draft_tokens or engine.config.num_draft_tokens, engine.config.k_limit)
        sizes = sizes_up_to(engine.max_batch_size)
        key = (id(engine.target), tuple(sizes), self.k_max + 1)
        if getattr(self, "_profiled", None) == key:  # a policy reused by engine after engine (bench)
            return
        started = time.perf_counter()
        self.sizes = sizes
        self.table = profile(engine.target, self.sizes, self.k_max + 1, self.context, self.repeats)
        self._profiled = key
        engine.profile_seconds = time.perf_counter() - started

    # Estimates --------------------------------------------------------------------------------
    def verify_seconds(self, rows: int, width: int) -> float:
        """T(rows, width), interpolated linearly in the batch size between profiled sizes."""
        sizes = self.sizes
        if rows >= sizes[-1]:
            return self.table[sizes[-1], width] * rows / sizes[-1]
        upper = bisect.bisect_left(sizes, rows)
        if sizes[upper] == rows or upper == 0:
            return self.table[sizes[upper], width]
        low, high = sizes[upper - 1], sizes[upper]
        share = (rows - low) / (high - low)
        return (1 - share) * self.table[low, width] + share * self.table[high, width]

    def acceptance(self, position: int) -> float:
        """P(slot ``position`` (0-based) of a verified block yields an accepted draft | every earlier one did)."""
        if position < len(self.evaluated) and self.evaluated[position] > 0:
            weight = 2.0  # the prior counts as two observations
            return (self.accepted[position] + weight * self.prior) / (self.evaluated[position] + weight)
        return self.acceptance(position - 1) if position > 0 else self.prior

    @staticmethod
    def nearest(values: dict[int, list], rows: int) -> float:
        """The estimate of the pool nearest ``rows`` (0 before any)."""
        pool = bucket(rows)
        return values[min(values, key=lambda b: abs(b.bit_length() - pool.bit_length()))][0] if values else 0.0

    def rate(self, rows: int, k: int) -> float:
        """Expected committed tokens per second of a step with k drafts per row."""
        survival, tokens = 1.0, 1.0
        for position in range(k):
            survival *= self.acceptance(position)
            tokens += survival
        cost = (self.verify_seconds(rows, k + 1) + k * self.nearest(self.draft_cost, rows)
                + self.nearest(self.overhead[k > 0], rows))
        return rows * tokens / cost

    def draft_tokens(self, engine, group) -> int:
        if not self.enabled:
            return engine.config.num_draft_tokens
        rows, best, k = group.size, self.rate(group.size, 0), 0
        plain = best
        while k < self.k_max:
            candidate = self.rate(rows, k + 1)
            if candidate <= best * (1 + self.gain):
                break  # the first draft that does not raise the expected rate ends the search
            best, k = candidate, k + 1
        self.undrafted = 0 if k else self.undrafted + 1
        if not k and self.undrafted > self.explore and self.rate(rows, 1) >= (1 - self.margin) * plain:
            k, self.undrafted = 1, 0
        self.last_choice = k
        return k

    def observe(self, engine, group, width, proposed, accepted, timing) -> None:
        if not self.enabled:
            return
        rows = group.size
        if width:
            while len(self.evaluated) < width:
                self.evaluated.append(0.0)
                self.accepted.append(0.0)
            evaluated, taken = [0] * width, [0] * width
            for a in accepted:
                # Slots 0..a were reached (a accepted, then a rejection or no draft at all: a row that
                # proposes fewer drafts, as prompt lookup without a match, gains nothing from the
                # verified width it does not fill).
                for j in range(min(a + 1, width)):
                    evaluated[j] += 1
                    taken[j] += j < a
            for j in range(len(self.evaluated)):
                self.evaluated[j] = self.decay * self.evaluated[j] + (evaluated[j] if j < width else 0)
                self.accepted[j] = self.decay * self.accepted[j] + (taken[j] if j < width else 0)
            blend(self.draft_cost, bucket(rows), timing["draft"] / width, self.decay)
        extra = max(0.0, timing["step"] - timing["draft"] - self.verify_seconds(rows, width + 1))
        blend(self.overhead[bool(width)], bucket(rows), extra, self.decay)  # a speculative step's bookkeeping costs more


def bucket(rows: int) -> int:
    """The pool of a batch size: the power of two at or below it."""
    return 1 << (rows.bit_length() - 1)


def blend(estimates: dict[int, list], key: int, new: float, decay: float) -> None:
    """Fold an observation into estimates[key] = [value, count]: the mean of the first ones, then a
    moving average that forgets at ``decay`` per observation."""
    value, count = estimates.get(key, (0.0, 0))
    weight = max(1.0 / (count + 1), 1.0 - decay)
    estimates[key] = [value + weight * (new - value), count + 1]


def sizes_up_to(largest: int) -> list[int]:
    """Batch sizes the profile measures: powers of two up to ``largest``, and ``largest``."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


@torch.inference_mode()
def profile(target, sizes: list[int], widths: int, context: int, repeats: int) -> dict[tuple[int, int], float]:
    """Seconds of one verification pass of b rows x n tokens after ``context`` tokens, n = 1..widths
    (medians of ``repeats`` passes, backends.costs)."""
    from specdec.backends.costs import forward_time

    return {(rows, width): forward_time(target.backend, width, context, repeats, rows=rows)
            for rows in sizes for width in range(1, widths + 1)}


def parse_policy(text: str | None, max_draft_tokens: int | None = None):
    """A policy from its command-line form: ``fixed``, ``load-aware`` or ``static:1=4,8=2,32=0``
    (batch size ``=`` or ``:`` k; vLLM's num_speculative_tokens_per_batch_size)."""
    if text is None or text == "fixed":
        return FixedK()
    if text == "load-aware":
        return LoadAware(max_draft_tokens)
    if text.startswith("static:"):
        return StaticTable(parse_table(text.removeprefix("static:")))
    raise InvalidArgumentError(f"a policy is fixed, load-aware or static:SIZE=K,..., got {text!r}")


def parse_table(text: str) -> dict[int, int]:
    """'1:4,8:2,32:0' (or with '=') -> {1: 4, 8: 2, 32: 0}."""
    table = {}
    try:
        for entry in text.split(","):
            size, k = entry.replace("=", ":").split(":")
            table[int(size)] = int(k)
    except ValueError:
        raise InvalidArgumentError(f"a per-batch-size table is SIZE:K,... like 1:4,8:2,32:0, got {text!r}")
    return table
