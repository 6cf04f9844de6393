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

The confidence policies cut each row's drafts after drafting, from the drafter's own estimate that a
draft is accepted given the drafts before it (DSpark's confidence head, ``Proposal.confidence``).
``ConfidenceThreshold`` keeps a row's drafts up to the first one below a threshold (llama.cpp's
``--spec-draft-conf-min``); ``ConfidenceScheduler`` (DSpark's load-aware prefix scheduler) admits
(row, position) slots in descending survival while LoadAware's rate estimate rises. Both stay
lossless for the same reason: whether draft j of a row is verified depends only on what the drafter
knew before drawing it (its confidence reads the drafts before j) and on the other rows, never on
draft j itself, the drafts after it, or the target.
"""

from __future__ import annotations

import bisect
import time

import torch

from specdec.drafters.base import Proposal
from specdec.errors import InvalidArgumentError


class FixedK:
    """The engine's k (or its heuristic schedule) at every step."""

    name = "fixed"
    wants_counts = False  # observe gets each row's drafts and accepted drafts (a host sync per step)

    def prepare(self, engine) -> None:
        pass

    def draft_tokens(self, engine, group) -> int:
        return engine.config.num_draft_tokens

    def cut(self, engine, group, proposal: Proposal) -> Proposal:
        """The drafts this step verifies, from the step's proposal (after drafting, before the target
        sees it). A cut may read only what the drafter knew before each draft it keeps or drops."""
        return proposal

    def observe(self, engine, group, width: int, proposed: list[int] | None, accepted: list[int] | None,
                timing: dict) -> None:
        """After a step of ``width`` drafts per row (after the cut); timing: seconds of drafting (the
        cut included) and of the whole step."""


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
    table: T(rows, tokens per row) in seconds, measured before (or made up, in tests), in place of
    the start-up profile: widths 1..k + 1 at every batch size it names (past the largest, T scales
    with the rows).
    Costs measured online are pooled by batch size in powers of two.
    """

    name = "load-aware"
    wants_counts = True
    # A position's prior is the estimate before it, and the profile is made non-decreasing in width
    # (the twenty-first session's estimates); the confidence scheduler, whose cut reads survivals
    # corrected step by step, keeps the fixed prior and the raw profile (measured: DSpark served at
    # one client 0.84x plain with these against 1.05x without).
    smoothed = True

    def __init__(self, max_draft_tokens: int | None = None, decay: float = 0.98, prior: float = 0.7,
                 context: int = 64, repeats: int = 3, explore: int = 16, margin: float = 0.2,
                 gain: float = 0.03, table: dict[tuple[int, int], float] | None = None):
        self.max_draft_tokens, self.decay, self.prior, self.explore = max_draft_tokens, decay, prior, explore
        self.margin, self.gain = margin, gain
        self.evidence = 3  # drafting steps observed (any batch size) before a loss counts as clear
        self.undrafted = 0  # steps since the last one that drafted
        self.context, self.repeats = context, repeats
        self.given = dict(table) if table else None
        self.sizes: list[int] = sorted({rows for rows, _ in table}) if table else []
        self.table: dict[tuple[int, int], float] = dict(table or {})  # (rows, tokens per row) -> seconds of one pass
        self.accepted: list[float] = []    # decayed counts per position: accepted
        self.evaluated: list[float] = []   # ... and evaluated (reached: every earlier draft accepted)
        # batch-size pool -> {drafts per row: [seconds of the step's drafting, observations]}
        self.draft_cost: dict[int, dict[int, list]] = {}
        self.overhead = {False: {}, True: {}}  # plain / speculative step: batch size -> [seconds beyond the passes, n]
        self.widths: dict[int, list] = {}  # drafts asked for -> [drafts verified (a drafter's own cut: fewer), n]
        self.enabled = True
        self.last_choice = 0

    def prepare(self, engine) -> None:
        self.enabled = engine.speculates and engine.tree is None and not engine.static_tree
        if not self.enabled:
            return
        if engine.config.draft_schedule != "constant":
            raise InvalidArgumentError(f"the {self.name} policy chooses k itself: use the constant draft schedule")
        self.k_max = min(self.max_draft_tokens or engine.config.num_draft_tokens, engine.config.k_limit)
        if self.given is not None:
            missing = [(rows, width) for rows in self.sizes or [1] for width in range(1, self.k_max + 2)
                       if (rows, width) not in self.given]
            if missing:
                raise InvalidArgumentError(f"the given step-time table lacks (rows, width) {missing[0]}")
            return
        sizes = sizes_up_to(engine.max_batch_size)
        key = (id(engine.target), tuple(sizes), self.k_max + 1)
        if getattr(self, "_profiled", None) == key:  # a policy reused by engine after engine (bench)
            return
        started = time.perf_counter()
        self.sizes = sizes
        self.table = profile(engine.target, self.sizes, self.k_max + 1, self.context, self.repeats)
        if self.smoothed:
            self.table = monotone(self.table)
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
        """P(slot ``position`` (0-based) of a verified block yields an accepted draft | every earlier one did).
        The first position's prior is ``prior``; a later one's is the estimate before it, so a position
        seldom verified (a policy that settled on fewer drafts stops observing the later ones) is taken to
        behave like the one before it, not like the fixed prior: a drafter right 98% of the time is not
        held at 0.7 past the positions it happened to verify."""
        before = self.acceptance(position - 1) if position > 0 else self.prior
        if position < len(self.evaluated) and self.evaluated[position] > 0:
            weight = 2.0  # the prior counts as two observations
            prior = before if self.smoothed else self.prior
            return (self.accepted[position] + weight * prior) / (self.evaluated[position] + weight)
        return before

    @staticmethod
    def nearest(values: dict[int, list], rows: int) -> float:
        """The estimate of the pool nearest ``rows`` (0 before any)."""
        return values[nearest_pool(values, rows)][0] if values else 0.0

    def step_overhead(self, speculative: bool, rows: int) -> float:
        """Seconds a plain or a speculative step spends beyond its passes (the engine's bookkeeping), observed
        online in the nearest batch-size pool. Before any plain step was observed, a plain step's is taken to be
        a speculative one's (which does the same and more; 0 before either), so the first comparisons do not
        charge drafting steps an overhead that plain steps are spared."""
        own = self.overhead[speculative]
        return self.nearest(own if own or speculative else self.overhead[True], rows)

    def drafting_seconds(self, rows: int, k: int) -> float:
        """Seconds a step spends drafting k tokens per row, from the steps observed in the nearest
        batch-size pool: a line a + b k through the costs seen at each k (weighted by how often), so the
        part of a drafting step that does not grow with k (the catch-up, the bookkeeping, in a server the
        threads beside the engine) is not charged once per draft; with one k seen, its cost per draft
        times k. 0 before any drafting step."""
        if not k or not self.draft_cost:
            return 0.0
        points = self.draft_cost[nearest_pool(self.draft_cost, rows)]
        if len(points) == 1:
            (seen, (seconds, _)), = points.items()
            return seconds * k / seen
        weights = {j: count for j, (_, count) in points.items()}
        total = sum(weights.values())
        mean_k = sum(w * j for j, w in weights.items()) / total
        mean_c = sum(w * points[j][0] for j, w in weights.items()) / total
        spread = sum(w * (j - mean_k) ** 2 for j, w in weights.items())
        slope = max(0.0, sum(w * (j - mean_k) * (points[j][0] - mean_c) for j, w in weights.items()) / spread)
        fixed = mean_c - slope * mean_k
        if fixed < 0:  # no fixed part: the line through the origin
            fixed, slope = 0.0, sum(w * j * points[j][0] for j, w in weights.items()) / sum(
                w * j * j for j, w in weights.items())
        return fixed + slope * k

    def rate(self, rows: int, k: int) -> float:
        """Expected committed tokens per second of a step with k drafts per row."""
        survival, tokens = 1.0, 1.0
        for position in range(k):
            survival *= self.acceptance(position)
            tokens += survival
        cost = (self.verified_seconds(rows, k) + self.drafting_seconds(rows, k)
                + self.step_overhead(k > 0, rows))
        return rows * tokens / cost

    def verified_seconds(self, rows: int, k: int) -> float:
        """The verification a step that asks for k drafts pays: T(rows, 1 + the drafts its steps verified on
        average, interpolated between widths; k before any was seen)."""
        width = min(float(k), self.widths[k][0]) if k in self.widths else float(k)
        low = int(width)
        share = width - low
        cost = self.verify_seconds(rows, low + 1)
        return cost if not share else (1 - share) * cost + share * self.verify_seconds(rows, low + 2)

    def draft_tokens(self, engine, group) -> int:
        if not self.enabled:
            return engine.config.num_draft_tokens
        rows = group.size
        rates = [self.rate(rows, j) for j in range(self.k_max + 1)]
        k = 0
        for more in range(1, self.k_max + 1):
            # every k is weighed (a noisy profile can make one width look dear between two cheap ones);
            # a larger k is taken only if it beats the best so far by ``gain``
            if rates[more] > rates[k] * (1 + self.gain):
                k = more
        self.undrafted = 0 if k else self.undrafted + 1
        seen = sum(count for points in self.draft_cost.values() for _, count in points.values()) if not k else 0
        if not k and (0 < seen < self.evidence or self.undrafted > self.explore):
            # A probe drafts at the k that looks best; it is skipped only for a clear loss, judged on
            # costs observed a few times. Until then a plain step that only the drafting seen so far
            # decided is followed by a probe at once: one slow first drafting step (a server's first
            # passes) is not yet a clear loss, nor worth ``explore`` plain steps. (Before any drafting
            # step the estimates charge none, so a plain choice then is the verification's alone.)
            probe = max(range(1, self.k_max + 1), key=rates.__getitem__)
            if seen < self.evidence or rates[probe] >= (1 - self.margin) * rates[0]:
                k, self.undrafted = probe, 0
        self.last_choice = k
        return k

    def observe(self, engine, group, width, proposed, accepted, timing) -> None:
        if not self.enabled:
            return
        # Counted against the drafts asked for: a drafter's own cut (--draft-p-min; prompt lookup without a
        # match) leaves fewer, down to none, and what it dropped gained nothing, at a drafting step's cost.
        asked = max(width, self.last_choice)
        if asked and accepted is not None:
            self.count_acceptance(asked, accepted, proposed, timing.get("budget_cut"))
            blend(self.widths, asked, width, self.decay)
        self.observe_costs(group.size, width, asked, timing)

    def count_acceptance(self, width: int, accepted: list[int], proposed: list[int] | None = None,
                         budget_cut: list[bool] | None = None) -> None:
        """Fold one step's accepted drafts per row into the per-position acceptance estimates.
        budget_cut: rows whose drafts the token budget cut to ``proposed`` (the end of a request)."""
        while len(self.evaluated) < width:
            self.evaluated.append(0.0)
            self.accepted.append(0.0)
        evaluated, taken = [0] * width, [0] * width
        for row, a in enumerate(accepted):
            # Slots 0..a were reached (a accepted, then a rejection or no draft at all: a row that
            # proposes fewer drafts, as prompt lookup without a match, gains nothing from the
            # verified width it does not fill; but slots past a row's token budget were never drafts).
            reach = proposed[row] if budget_cut and budget_cut[row] else width
            for j in range(min(a + 1, reach)):
                evaluated[j] += 1
                taken[j] += j < a
        for j in range(len(self.evaluated)):
            self.evaluated[j] = self.decay * self.evaluated[j] + (evaluated[j] if j < width else 0)
            self.accepted[j] = self.decay * self.accepted[j] + (taken[j] if j < width else 0)

    def observe_costs(self, rows: int, width: int, drafted: int, timing: dict) -> None:
        """Fold one step's timing into the drafting cost (of ``drafted`` drafts per row) and the
        overhead beyond the verification pass of ``width`` drafts per row."""
        if drafted:
            blend(self.draft_cost.setdefault(bucket(rows), {}), drafted, timing["draft"], self.decay)
        extra = max(0.0, timing["step"] - timing["draft"] - self.verify_seconds(rows, width + 1))
        blend(self.overhead[bool(width)], bucket(rows), extra, self.decay)  # a speculative step's bookkeeping costs more


class ConfidenceThreshold(FixedK):
    """llama.cpp's ``--spec-draft-conf-min``: a row keeps its drafts up to (not including) the first
    whose confidence is below ``threshold``."""

    needs_confidence = True

    def __init__(self, threshold: float):
        if not 0.0 < threshold < 1.0:
            raise InvalidArgumentError(f"conf-min:X needs 0 < X < 1, got {threshold:g}")
        self.threshold = threshold
        self.name = f"conf-min:{threshold:g}"

    def prepare(self, engine) -> None:
        require_confidence_head(engine, self.name)

    def cut(self, engine, group, proposal: Proposal) -> Proposal:
        confidence = proposal_confidence(engine, proposal, self.name)  # [B, k]
        slots = torch.arange(proposal.k, device=confidence.device)
        low = (confidence < self.threshold) | (slots >= proposal.lengths[:, None])
        first = torch.where(low, slots, proposal.k).min(1).values if proposal.k else proposal.lengths
        return keep_prefixes(group, proposal, first)


class ConfidenceScheduler(LoadAware):
    """DSpark's load-aware prefix scheduler: each step, (row, position) slots are admitted in
    descending survival s = c_0 c_1 ... c_j while the expected committed tokens per second rise,
    stopping at the first slot that does not raise them (``admit_by_survival``).

    Costs are LoadAware's: the profiled T(rows, width) of the dense verification block (width = 1 +
    the longest row kept), the drafting cost and the overhead observed online. Survivals are the
    drafter's, corrected per position by what earlier steps observed: the accepted drafts at position j
    over the survivals the admitted slots there had predicted (a prior of ``trust`` slots at a ratio of 1),
    then made non-increasing along the row again. A confidence head that promises more than the target
    grants (another domain, another temperature) so stops buying drafts that do not pay.
    Drafting runs at k every step, except after ``patience`` losing steps in a row: steps whose
    expected rate as cut (the kept drafts' corrected survivals, the drafting spent included) is below
    a plain step's, an empty cut among them. One step's confidences swing widely (0.1 to 0.7 for the
    real target's first draft), so a drafter that pays on average loses single steps often: with
    three in a row as the rule, DSpark at one client drafted 30 of 80 steps while its drafting steps
    committed 7% more tokens a second than its plain ones (thirtieth session). Then steps decode plainly (no drafting cost), drafting
    again once every ``explore`` steps to look. The decisions read confidences, costs and earlier
    steps' outcomes only, never whether this step's drafts are right, so they stay lossless. A probe
    costs a whole drafting pass, more than a plain step under load (and the pass enters the context
    that waited meanwhile): each probe that still loses doubles the wait before the next (up to
    ``longest_wait`` steps), one that wins restores ``explore``. No step drafts, probe or not, while
    even the acceptance the target granted so far, at the current batch size's costs, puts a drafting
    step more than ``margin`` below a plain one (a clear loss, as under heavy load: only fewer rows or
    cheaper verification bring drafting back).
    """

    name = "confidence"
    wants_counts = True  # each row's accepted drafts correct the confidences' survivals
    needs_confidence = True
    smoothed = False

    def __init__(self, max_draft_tokens: int | None = None, patience: int = 8, longest_wait: int = 256,
                 trust: float = 8.0, **options):
        super().__init__(max_draft_tokens, **options)
        self.patience, self.longest_wait, self.trust = patience, longest_wait, trust
        self.losing = 0  # steps in a row whose expected rate, drafting included, was below plain decoding's
        self.wait = self.explore  # plain steps before the next probe
        self.probing = False
        self.predicted: list[float] = []  # decayed sums per position: admitted slots' survivals
        self.observed: list[float] = []   # ... and the drafts accepted there
        self.pending: torch.Tensor | None = None  # this step's kept survivals per position [width]

    def prepare(self, engine) -> None:
        require_confidence_head(engine, self.name)
        super().prepare(engine)

    def draft_tokens(self, engine, group) -> int:
        k, self.probing = self.k_max, False
        if self.losing >= self.patience:
            self.undrafted += 1
            if self.undrafted <= self.wait or not self.promising(group.size):
                k = 0
            else:  # probe: draft once to see whether the confidences came back
                self.undrafted, self.probing = 0, True
        elif not self.promising(group.size):
            k = 0  # a clear loss at this batch size (a wave of requests arrived): not even the first steps
        self.last_choice = k
        return k

    def promising(self, rows: int) -> bool:
        """Whether a drafting step of ``rows`` rows, at the acceptance per position the target granted so
        far (every row drafting, the best number of drafts kept), comes within ``margin`` of a plain
        step's rate: its whole drafting pass, the verification and the overhead counted."""
        plain = self.rate(rows, 0)
        spent = self.drafting_seconds(rows, self.k_max) + self.step_overhead(True, rows)
        survival, tokens, best = 1.0, 1.0, 0.0
        for position in range(self.k_max):
            survival *= self.acceptance(position)
            tokens += survival
            best = max(best, rows * tokens / (self.verify_seconds(rows, position + 2) + spent))
        return best >= (1 - self.margin) * plain

    def correction(self, width: int) -> torch.Tensor:
        """Per position j < width: accepted over predicted survival on earlier steps (1 before any)."""
        return torch.tensor(self.ratios(width), dtype=torch.float64)

    def ratios(self, width: int) -> list[float]:
        return [(self.observed[j] + self.trust) / (self.predicted[j] + self.trust) if j < len(self.predicted)
                else 1.0 for j in range(width)]

    def corrected(self, survival: list[list[float]]) -> list[list[float]]:
        """The drafter's survivals (rows of k) scaled by the observed correction, clamped to [0, 1] and
        non-increasing along each row."""
        ratios = self.ratios(len(survival[0]) if survival else 0)
        out = []
        for row in survival:
            lowest, kept = 1.0, []
            for value, ratio in zip(row, ratios):
                lowest = min(lowest, min(1.0, max(0.0, value * ratio)))
                kept.append(lowest)
            out.append(kept)
        return out

    def cut(self, engine, group, proposal: Proposal) -> Proposal:
        # On Python floats: a step's rows x drafts are a few dozen numbers, and tensor operations on them
        # cost more than the arithmetic (0.47 ms a step at one row on the real target, a twentieth of it).
        confidence = proposal_confidence(engine, proposal, self.name)
        rows, width = proposal.tokens.shape[0], min(proposal.k, self.k_max)
        drafting = self.drafting_seconds(rows, proposal.k)  # spent already, in every choice alike
        costs = [self.verify_seconds(rows, n + 1) + drafting + self.step_overhead(n > 0, rows)
                 for n in range(width + 1)]
        raw = survivals(confidence[:, :width]).tolist()
        survival = self.corrected(raw)
        lengths = admit_slots(survival, proposal.lengths.clamp(max=width).tolist(), costs)
        self.pending = [sum(raw[r][j] for r in range(rows) if j < lengths[r]) for j in range(width)]
        kept = sum(survival[r][j] for r in range(rows) for j in range(lengths[r]))
        expected = (rows + kept) / costs[max(lengths) if rows else 0]
        plain = rows / (self.verify_seconds(rows, 1) + self.step_overhead(False, rows))
        self.losing = 0 if expected > plain else self.losing + 1
        if self.probing:
            self.wait = self.explore if not self.losing else min(2 * self.wait, self.longest_wait)
        return keep_prefixes(group, proposal, torch.tensor(lengths, dtype=proposal.lengths.dtype,
                                                           device=proposal.lengths.device))

    def observe(self, engine, group, width, proposed, accepted, timing) -> None:
        self.observe_costs(group.size, width, self.last_choice, timing)
        if width and accepted is not None:
            self.count_acceptance(width, accepted, proposed, timing.get("budget_cut"))  # what ``promising`` expects
        if self.pending is not None and accepted is not None:
            self.count_survival(self.pending, accepted)
        self.pending = None

    def count_survival(self, predicted: list[float], accepted: list[int]) -> None:
        """Fold one step's predicted survivals per position (the kept slots' sums) and accepted drafts
        per row into the correction."""
        width = len(predicted)
        while len(self.predicted) < width:
            self.predicted.append(0.0)
            self.observed.append(0.0)
        for j in range(width):
            self.predicted[j] = self.decay * self.predicted[j] + predicted[j]
            self.observed[j] = self.decay * self.observed[j] + sum(a > j for a in accepted)


def survivals(confidence: torch.Tensor) -> torch.Tensor:
    """s[r, j] = c[r, 0] ... c[r, j] in float64 on the CPU, confidences [B, k] clamped to [0, 1]."""
    return confidence.detach().to("cpu", torch.float64).clamp(0.0, 1.0).cumprod(1)


def admit_by_survival(confidence: torch.Tensor, lengths: torch.Tensor, costs: torch.Tensor) -> torch.Tensor:
    """Drafts kept per row [B]: slots (r, j) in descending survival s[r, j] = c[r, 0] ... c[r, j]
    (ties: the lower position first, then the lower row), each admitted while the rate
    (B + sum of admitted survivals) / costs[longest row admitted] rises; the first slot that does
    not raise it ends the search.

    confidence: [B, k] c[r, j] = P(draft j accepted | drafts before it were); lengths: [B] drafts
    each row has; costs: [k + 1] seconds of a step verifying n = 0..k drafts per row.

    Survival falls along a row, so this order is the one of always taking the best next slot of any
    row: a row's kept drafts are a prefix, and with the stop at the first drop the decision is that
    of a search reading s[r, j] only once drafts 0..j-1 of row r are kept (c[r, j] is a function of
    those); the survivals past each row's first refused slot cannot change it. Whether a draft is
    verified never depends on the draft itself or on the ones after it, which is what keeps
    rejection sampling exact.
    """
    if not confidence.shape[1]:
        return torch.zeros_like(lengths)
    counts = admit_slots(survivals(confidence).tolist(), lengths.tolist(), [float(c) for c in costs])
    return torch.tensor(counts, dtype=lengths.dtype, device=lengths.device)


def admit_slots(survival: list[list[float]], lengths: list[int], costs: list[float]) -> list[int]:
    """``admit_by_survival`` on Python floats: survival[r][j] (non-increasing along each row), each row's
    drafts, costs[n] of a step verifying n drafts per row; the drafts kept per row."""
    rows = len(survival)
    slots = sorted((-survival[r][j], j, r) for r in range(rows)
                   for j in range(min(lengths[r], len(survival[r]))))  # ties: the lower j, then r
    counts, total, longest, best = [0] * rows, 0.0, 0, rows / costs[0]
    for negative, j, r in slots:
        total -= negative
        longest = max(longest, j + 1)
        rate = (rows + total) / costs[longest]
        if not rate > best:  # the first slot that does not raise the rate ends the search
            break
        best = rate
        counts[r] += 1
    return counts


def keep_prefixes(group, proposal: Proposal, lengths: torch.Tensor) -> Proposal:
    """``proposal`` with row r's first lengths[r] drafts, the block narrowed to the longest row kept
    (the verification pass is a dense [rows, width] block). Sessions that ran the block's first
    layers while drafting (``verify_forward``) verify the block as drafted: only the lengths change."""
    kept = proposal.clamp(lengths)
    width = int(kept.lengths.max()) if kept.lengths.numel() else 0
    if width == proposal.k or hasattr(group.session, "verify_forward"):
        return kept

    def narrow(tensor):
        return None if tensor is None else tensor[:, :width]
    return Proposal(narrow(kept.tokens), kept.lengths, narrow(kept.probs), confidence=narrow(kept.confidence))


def require_confidence_head(engine, policy: str) -> None:
    """Refuse, as one line, a drafter without a confidence head or a tree."""
    if not getattr(engine.drafter, "has_confidence", False):
        raise InvalidArgumentError(f"policy {policy} needs a drafter with a confidence head (dspark), "
                                   f"got {engine.drafter.name}")
    if engine.tree is not None or engine.static_tree:
        raise InvalidArgumentError(f"policy {policy} cuts chains of drafts, not token trees")


def proposal_confidence(engine, proposal: Proposal, policy: str) -> torch.Tensor:
    if proposal.confidence is None:
        raise InvalidArgumentError(f"policy {policy} needs a drafter with a confidence head (dspark), "
                                   f"got {engine.drafter.name} without confidences")
    return proposal.confidence


def nearest_pool(values: dict[int, object], rows: int) -> int:
    """The pool (a key of ``values``, which holds at least one) nearest the batch size ``rows``."""
    pool = bucket(rows)
    return min(values, key=lambda b: abs(b.bit_length() - pool.bit_length()))


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


def monotone(table: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """A profiled T(rows, width) made non-decreasing in the width at each batch size: each width takes the
    least time measured at it or any wider width. A pass over more tokens is never cheaper, and a timing
    only ever comes out slow (a one-off, another thread): a sample above a wider pass's is the noise.
    (Raising the wider widths to it instead spread one slow sample to every larger k: served at one
    client, a profile with T(1, 3) 4 ms high held the Q4_1 copy at k = 1.)"""
    out = {}
    for rows, width in sorted(table, reverse=True):
        out[rows, width] = min(table[rows, width], out.get((rows, width + 1), float("inf")))
    return dict(sorted(out.items()))


@torch.inference_mode()
def profile(target, sizes: list[int], widths: int, context: int, repeats: int) -> dict[tuple[int, int], float]:
    """Seconds of one verification pass of b rows x n tokens after ``context`` tokens, n = 1..widths: at
    each batch size the widths timed in turn, ``repeats`` rounds, each width's least time
    (backends.costs.forward_times; a one-off slow spell at start-up once held a served drafter at k = 1)."""
    from specdec.backends.costs import forward_times

    table = {}
    for rows in sizes:
        times = forward_times(target.backend, range(1, widths + 1), context, repeats, rows=rows)
        table.update({(rows, width): seconds for width, seconds in times.items()})
    return table


POLICY_FORMS = "fixed, load-aware, confidence, conf-min:X (0 < X < 1) or static:SIZE=K,..."


def parse_policy(text: str | None, max_draft_tokens: int | None = None):
    """A policy from its command-line form: ``fixed``, ``load-aware``, ``confidence``, ``conf-min:0.5``
    or ``static:1=4,8=2,32=0`` (batch size ``=`` or ``:`` k; vLLM's num_speculative_tokens_per_batch_size)."""
    if text is None or text == "fixed":
        return FixedK()
    if text == "load-aware":
        return LoadAware(max_draft_tokens)
    if text == "confidence":
        return ConfidenceScheduler(max_draft_tokens)
    if text.startswith("conf-min:"):
        value = text.removeprefix("conf-min:")
        try:
            threshold = float(value)
        except ValueError:
            raise InvalidArgumentError(f"conf-min:X takes a number 0 < X < 1, got {value!r}") from None
        return ConfidenceThreshold(threshold)
    if text.startswith("static:"):
        return StaticTable(parse_table(text.removeprefix("static:")))
    raise InvalidArgumentError(f"a policy is {POLICY_FORMS}, got {text!r}")


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
