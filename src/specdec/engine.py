"""The continuous-batching engine: requests join and leave the running batch between verification steps.

One loop in the project. ``specdec.generate`` adds its prompts at once and steps until they finish;
``specdec serve`` adds requests as they arrive, from another thread, and streams each step's tokens.

A step: admit waiting requests (prefilled as their own small batch, then merged into the running
one: sequences, KV caches and drafter sessions all ``extend``), then one verification of every
running row (PROPOSE -> VERIFY -> ACCEPT, as decode.py describes), then the finished rows leave.
Rows with different sampling settings run as separate batches ("groups"), since the acceptance
rule is applied with one distribution per batch; greedy rows always share one.

Memory: every request reserves its prompt, its max_new_tokens and one block of drafts against
``max_kv_tokens``; admission waits while the budget is full, and a finished or cancelled request
gives its reservation back at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specdec.batch import Sequences, leaving_order
from specdec.decode import (GenerationConfig, cache_capacity, check_context, committed_features, default_draft_tokens,
                            default_tree, stop_counts, verify_block, warn_inexact)
from specdec.backends.target import Target
from specdec.drafters.base import DecodeContext, Drafter, FeatureSpec, Proposal, TargetFeatures, TreeConfig
from specdec.drafters.none import NoDraft
from specdec.models import kernels
from specdec.errors import ContextLengthError, InvalidArgumentError, SpecdecError, UnsupportedModelError
from specdec.processors import GenerationProcessors
from specdec.sampling import SamplingConfig, probabilities, sample
from specdec.stats import Stats


class QueueFullError(SpecdecError):
    """The engine's queue of waiting requests is full (a server answers 503)."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0          # seeds the generator of the request's batch when it opens one
    logprobs: bool = False  # the target's log-probability of every returned token
    request_id: str | None = None


@dataclass
class RequestStats:
    """Speculation of one request: what vLLM counts per engine, per request."""

    steps: int = 0           # verification steps the request took part in
    drafts: int = 0          # steps that verified at least one draft
    draft_tokens: int = 0    # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    new_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification step, the bonus token included (the first token is the prefill's)."""
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0


@dataclass
class Update:
    request_id: str
    tokens: list[int]                  # this step's new tokens of the request, in order
    logprobs: list[float] | None = None
    finish_reason: str | None = None    # "stop" (an EOS token), "length", "cancelled"; None while running
    stats: RequestStats | None = None   # with the final update


@dataclass
class EngineMetrics:
    """Cumulative counters (vLLM's spec-decode names) and the engine's current load."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_tokens_reserved: int = 0
    kv_tokens_budget: int | None = None


@dataclass
class RequestState:
    request: Request
    request_id: str
    reserved: int
    stats: RequestStats = field(default_factory=RequestStats)
    cancelled: bool = False
    tokens: list[int] | None = None  # the whole output, when the engine does not stream


def sampling_key(sampling: SamplingConfig) -> tuple:
    return ("greedy",) if sampling.greedy else (sampling.temperature, sampling.top_k, sampling.top_p)


class Engine:
    """Continuous batching with speculation for one target and one drafter.

    ``add`` and ``cancel`` may be called from any thread; ``step`` from one thread only.
    stream: report every step's tokens in ``Update``s (False: only the final update, with the
    whole output, which keeps a step's bookkeeping on tensors; ``generate`` uses it).
    policy: how many drafts each step verifies (specdec.schedule; None: a fixed k): its ``draft_tokens``
    before drafting, its ``cut`` (optional) of the drafts made, before the target sees them.
    """

    def __init__(self, target, drafter=None, num_draft_tokens: int | None = None, tree: TreeConfig | None = None,
                 max_batch_size: int = 64, max_kv_tokens: int | None = None, max_queue: int = 256, policy=None,
                 stream: bool = True, draft_schedule: str = "constant", max_draft_tokens: int = 32):
        from specdec.schedule import FixedK

        drafter = drafter or NoDraft()
        if tree is not None or not getattr(policy, "needs_confidence", False):  # confidence policies cut chains:
            tree = default_tree(drafter, num_draft_tokens, tree)              # a recorded tree gives way to them
        if num_draft_tokens is None:
            num_draft_tokens = default_draft_tokens(drafter)
        self.config = GenerationConfig(num_draft_tokens=num_draft_tokens, draft_schedule=draft_schedule,
                                       max_draft_tokens=max_draft_tokens, tree=tree)
        if max_batch_size < 1:
            raise InvalidArgumentError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_kv_tokens is not None and max_kv_tokens < 1:
            raise InvalidArgumentError(f"the KV budget must be >= 1 token, got {max_kv_tokens}")
        if tree is not None and not target.backend.supports_trees:
            raise UnsupportedModelError(f"{target.backend.description} cannot verify token trees: "
                                        f"{target.backend.reason or 'it cannot take a tree attention mask'}")
        self.target, self.drafter, self.tree = target, drafter, tree
        self.speculates = not isinstance(drafter, NoDraft)
        self.exact = bool(getattr(target.backend, "exact_numerics", False))
        self.on_kernels = getattr(target.backend, "name", None) == "native"  # specdec's kernels own the cores
        if not self.exact and self.speculates:
            warn_inexact(target)
        self.max_batch_size, self.max_kv_tokens, self.max_queue = max_batch_size, max_kv_tokens, max_queue
        self.stream = stream
        static_tree = int(getattr(drafter, "tree_nodes", 0))  # a drafter's own static tree (Medusa) sets its width
        self.static_tree = static_tree
        self.width = max(self.config.k_limit, static_tree)  # the widest block of drafts a step may verify
        self.carried = int(getattr(drafter, "branch_tokens", 0))  # columns a pass holds beside it (lookahead)
        self.eos = torch.tensor(target.eos_token_ids or [-1], device=target.device)
        self.policy = policy or FixedK()
        self.profile_seconds = 0.0
        self.stats = Stats(drafter=drafter.name, draft_schedule=draft_schedule, batch_size=0,
                           backend=target.backend.description, exact_numerics=self.exact)
        self.metrics = EngineMetrics(kv_tokens_budget=max_kv_tokens)
        self.groups: dict[tuple, Group] = {}
        self.waiting: deque[RequestState] = deque()
        self.states: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.policy.prepare(self)

    # Thread-safe entry points -------------------------------------------------------------------
    def add(self, request: Request) -> str:
        """Queue a request; returns its id. Refuses at once what could never run."""
        if not request.prompt:
            raise InvalidArgumentError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        check_context(self.target, [request.prompt], request.max_new_tokens)
        reserved = len(request.prompt) + request.max_new_tokens + self.width + self.carried + 1
        if self.max_kv_tokens is not None and reserved > self.max_kv_tokens:
            raise ContextLengthError(f"the request needs {reserved} tokens of KV memory (prompt, max_new_tokens and "
                                     f"a block of drafts); the budget is {self.max_kv_tokens}")
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting requests)")
            request_id = request.request_id or f"req-{next(self._ids)}"
            if request_id in self.states:
                raise InvalidArgumentError(f"request id {request_id!r} is already in use")
            state = RequestState(request, request_id, reserved)
            self.states[request_id] = state
            self.waiting.append(state)
            self.metrics.waiting = len(self.waiting)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request; its memory is freed before the next step. False when it is not running or waiting."""
        with self._lock:
            state = self.states.get(request_id)
            if state is None:
                return False
            state.cancelled = True
            return True

    @property
    def layers(self) -> tuple[int, ...]:
        """What the drafter reads of the target (some drafters know it only once a session started)."""
        return (getattr(self.drafter, "features", None) or FeatureSpec()).hidden_layers

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(g.size for g in self.groups.values())

    @property
    def running(self) -> int:
        return sum(g.size for g in self.groups.values())

    # The engine thread -------------------------------------------------------------------------
    def step(self) -> list[Update]:
        """Admit what fits, verify once every running row, let finished rows leave."""
        with kernels.torch_single_threaded(self.on_kernels):
            return self._step()

    def _step(self) -> list[Update]:
        updates: list[Update] = []
        with self._lock:
            cancelled = [s for s in self.states.values() if s.cancelled]
            for state in cancelled:
                if state in self.waiting:
                    self.waiting.remove(state)
                    self._finish(state, "cancelled", updates)
        for group in self.groups.values():
            group.leave({i: "cancelled" for i, s in enumerate(group.states) if s.cancelled}, updates)
        for key, cohort in self._admissions().items():
            group = self.groups.get(key)
            if group is None:
                group = self.groups[key] = Group(self, cohort[0].request.sampling, cohort[0].request.seed)
            group.admit(cohort, updates)
        for key in list(self.groups):
            group = self.groups[key]
            if group.size:
                group.step(self.policy.draft_tokens(self, group), updates)
            if not group.size:
                group.close()
                del self.groups[key]
        self.metrics.running = self.running
        return updates

    def _admissions(self) -> dict[tuple, list[RequestState]]:
        """Waiting requests that fit (first come, first served; none skips the head of the queue)."""
        cohorts: dict[tuple, list[RequestState]] = {}
        with self._lock:
            running = self.running
            while self.waiting and running < self.max_batch_size:
                state = self.waiting[0]
                if (self.max_kv_tokens is not None
                        and self.metrics.kv_tokens_reserved + state.reserved > self.max_kv_tokens):
                    break
                self.waiting.popleft()
                self.metrics.kv_tokens_reserved += state.reserved
                cohorts.setdefault(sampling_key(state.request.sampling), []).append(state)
                running += 1
            self.metrics.waiting = len(self.waiting)
        return cohorts

    def _finish(self, state: RequestState, reason: str, updates: list[Update], tokens=None) -> None:
        """A request ends: its reservation is freed and its final update emitted (call under the lock
        or from the engine thread)."""
        self.states.pop(state.request_id, None)
        updates.append(Update(state.request_id, tokens or [], None, reason, state.stats))

    def free(self, state: RequestState) -> None:
        with self._lock:
            self.metrics.kv_tokens_reserved -= state.reserved

    def record(self, proposed: list[int], accepted: list[int]) -> None:
        """vLLM's counters, from one step's per-row drafts verified and accepted."""
        m = self.metrics
        for p, a in zip(proposed, accepted):
            if p:
                m.num_drafts += 1
                m.num_draft_tokens += p
                m.num_accepted_tokens += a
                if len(m.accepted_per_pos) < p:
                    m.accepted_per_pos.extend([0] * (p - len(m.accepted_per_pos)))
                for j in range(a):
                    m.accepted_per_pos[j] += 1

    def run(self, requests: list[Request]) -> list[RequestState]:
        """Add every request and step until all finish (the one-shot path of ``generate``)."""
        ids = [self.add(r) for r in requests]
        states = [self.states[i] for i in ids]
        while self.has_work:
            self.step()
        return states


PREFILL_SLACK = 1.25  # a prefill group's longest prompt: at most this times its shortest, plus PREFILL_EXTRA
PREFILL_EXTRA = 16


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """Rows of a cohort prefilled together: in order of prompt length, a new group whenever a prompt is
    longer than PREFILL_SLACK times the group's shortest plus PREFILL_EXTRA. One left-padded block for
    prompts of 35 and 431 tokens computes 431 columns for both; groups bound the padding computed."""
    order = sorted(range(len(lengths)), key=lambda row: lengths[row])
    groups: list[list[int]] = []
    for row in order:
        if groups and lengths[row] <= PREFILL_SLACK * lengths[groups[-1][0]] + PREFILL_EXTRA:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def prefill(target: Target, tokens: torch.Tensor, valid: torch.Tensor, capacity: int, layers: tuple[int, ...],
            groups: list[list[int]]):
    """(cache, logits [B, 1, V], hidden [B, T, L, H] or None) of the left-padded prompts ``tokens`` [B, T],
    each group of rows its own block, as narrow as its longest prompt. A row's numbers do not depend on
    its block on a backend with exact numerics, so only the columns computed change; the caches join in
    the cohort's row order (rows of narrower groups get holes on the right)."""
    if len(groups) == 1:
        cache = target.new_cache(tokens.shape[0], capacity)
        logits, hidden = target.forward(cache, tokens, valid, logits_to_keep=1, hidden_layers=layers)
        return cache, logits, hidden
    width = tokens.shape[1]
    whole = target.new_cache(tokens.shape[0], capacity)
    parts = []
    for rows in groups:
        index = torch.tensor(rows, device=tokens.device)
        used = int(valid[index].sum(1).max())
        part = target.new_cache(len(rows), used)  # as wide as its prompts (transformers' caches grow anyway)
        parts.append((index, used, *target.forward(part, tokens[index, width - used:], valid[index, width - used:],
                                                   logits_to_keep=1, hidden_layers=layers), part))
    order = torch.cat([index for index, *_ in parts])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    if hasattr(whole, "place"):  # the native cache: each group's rows written into the cohort's one store
        whole.place([(index, part) for index, *_, part in parts])
        cache = whole
    else:  # the groups' caches joined one after the other, the rows put back in the cohort's order
        cache = parts[0][-1]
        for *_, part in parts[1:]:
            cache.extend(part)
        cache.select_rows(inverse)
    logits = torch.cat([part_logits for _, _, part_logits, *_ in parts])[inverse]
    hidden = None
    if layers:
        first = parts[0][3]
        hidden = first.new_zeros(tokens.shape[0], width, *first.shape[2:])
        for index, used, _, part_hidden, _ in parts:
            hidden[index, width - used:] = part_hidden
    return cache, logits, hidden


class Group:
    """The running rows of one sampling setting: their sequences, the target's KV cache and the
    drafter's session, all with one row per request."""

    def __init__(self, engine: Engine, sampling: SamplingConfig, seed: int):
        self.engine, self.sampling = engine, sampling
        target = engine.target
        self.generator = torch.Generator(device=target.device).manual_seed(seed)
        self.states: list[RequestState] = []
        self.seqs = self.cache = self.session = None
        self.verify_forward = None
        self.processors: GenerationProcessors | None = None
        self.k = engine.config.num_draft_tokens  # the heuristic schedule's state
        self.empty: Proposal | None = None
        self._ones: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.states)

    def ones(self) -> torch.Tensor:
        """[B] ones (kept until the rows change)."""
        if self._ones is None:
            self._ones = torch.ones(self.size, dtype=torch.long, device=self.seqs.tokens.device)
        return self._ones

    def admit(self, cohort: list[RequestState], updates: list[Update]) -> None:
        """Prefill the cohort as its own batch, then merge it into the running rows."""
        engine, target = self.engine, self.engine.target
        device, pad = target.device, target.pad_token_id
        prompts = [s.request.prompt for s in cohort]
        budgets = [s.request.max_new_tokens for s in cohort]
        longest = max(len(p) for p in prompts)
        config = GenerationConfig(num_draft_tokens=engine.config.num_draft_tokens, max_new_tokens=max(budgets),
                                  draft_schedule=engine.config.draft_schedule,
                                  max_draft_tokens=engine.config.max_draft_tokens, tree=engine.tree)
        ragged = engine.stream or len(prompts) > 1
        capacity = cache_capacity(prompts, config, engine.static_tree, ragged=ragged) + engine.carried
        seqs = Sequences(prompts, longest + max(budgets) + engine.width + 2, pad, device=device)
        context = DecodeContext(target, self.sampling, self.generator, max(budgets), engine.width, capacity, engine.tree)
        session = engine.drafter.start(context, seqs)
        shared = hasattr(session, "share_cache")  # self-drafting: the drafter runs the target's first layers in it
        processors = GenerationProcessors.for_target(target, prompts, budgets)
        stats = engine.stats
        if processors is not None:
            stats.logits_processors = sorted(set(stats.logits_processors) | set(processors.names))

        # Prefill: the whole prompt, left-padded; its last logits give the first new token.
        tick = time.perf_counter()
        prompt_lengths = seqs.lengths.clone()
        budget = torch.tensor(budgets, device=device)
        tokens, valid = seqs.window(torch.zeros_like(seqs.lengths), seqs.lengths, pad)
        groups = prefill_groups(prompt_lengths.tolist()) if target.backend.exact_numerics and not shared \
            else [list(range(len(prompts)))]
        cache, logits, hidden = prefill(target, tokens, valid, capacity, engine.layers, groups)
        if shared:
            session.share_cache(cache)
        elif hasattr(session, "adopt_prompt"):  # a copy of the target drafting: the prompt's keys and values
            session.adopt_prompt(cache)
        if processors is not None:
            logits = processors.apply(seqs, prompt_lengths, logits, budgets=budget)
        first = kernels.argmax(logits[:, -1]) if self.sampling.greedy else sample(
            probabilities(logits[:, -1], self.sampling), self.generator)
        stats.target_forwards += 1  # the prefill, however many blocks it took
        stats.prefill_time += time.perf_counter() - tick
        seqs.append(first[:, None], torch.ones_like(seqs.lengths))
        if engine.layers:  # the prompt's features, right-aligned with the pending (first) token already
            tick = time.perf_counter()
            session.observe(seqs, TargetFeatures(hidden, valid))
            stats.draft_time += time.perf_counter() - tick
        done = (budget <= 1) | torch.isin(first, engine.eos)

        if self.seqs is None:
            self.seqs, self.cache, self.session, self.processors = seqs, cache, session, processors
            self.prompt_lengths, self.budget, self.remaining = prompt_lengths, budget, budget - 1
            self.verify_forward = getattr(session, "verify_forward", None) or target.forward
        else:
            self.session.extend(session)  # first: a session may still read each side's own Sequences
            self.seqs.extend(seqs)
            self.cache.extend(cache)
            self.processors = GenerationProcessors.merged(self.processors, processors)
            self.prompt_lengths = torch.cat([self.prompt_lengths, prompt_lengths])
            self.budget = torch.cat([self.budget, budget])
            self.remaining = torch.cat([self.remaining, budget - 1])
        self.states.extend(cohort)
        self.empty = self._ones = None
        for state in cohort:
            state.stats.new_tokens = 1
        if engine.stream:
            firsts = first.tolist()
            logprobs = self._logprobs(logits[:, -1:], first[:, None]) if any(s.request.logprobs for s in cohort) else None
            for row, state in enumerate(cohort):
                updates.append(Update(state.request_id, [firsts[row]],
                                      logprobs[row][:1] if logprobs and state.request.logprobs else None))
        self._leave_done(torch.cat([torch.zeros(self.size - len(cohort), dtype=torch.bool, device=device), done]),
                         updates)

    def step(self, k: int, updates: list[Update]) -> None:
        """One verification of every row with up to k drafts (0: plain decoding, no drafting)."""
        engine, seqs, cache, session = self.engine, self.seqs, self.cache, self.session
        stats, layers, sampling = engine.stats, engine.layers, self.sampling
        if engine.config.draft_schedule == "heuristic":
            k = self.k
        drafting = engine.speculates and k > 0
        started = tick = time.perf_counter()
        if drafting:
            drafted_in_full = session.propose(seqs, k)
            offered = drafted_in_full.clamp(self.remaining - 1)
            cut = getattr(engine.policy, "cut", None)  # what the policy keeps of it (a policy without cut: all)
            proposal = offered if cut is None else cut(engine, self, offered)
            if proposal is not offered:
                stats.record_cut(offered.lengths - proposal.lengths)
            forward = self.verify_forward
        else:
            if self.empty is None:
                self.empty = Proposal(torch.zeros(self.size, 0, dtype=torch.long, device=seqs.tokens.device),
                                      torch.zeros(self.size, dtype=torch.long, device=seqs.tokens.device))
            proposal, forward = self.empty, engine.target.forward
        drafted = time.perf_counter() - tick
        stats.draft_time += drafted

        tick = time.perf_counter()
        processors = self.processors
        process = processors and (lambda lg: processors.apply(seqs, self.prompt_lengths, lg, proposal.tokens,
                                                               proposal.parents, budgets=self.budget))
        verified = verify_block(forward, cache, seqs, proposal, sampling, self.generator, process, layers)
        num_accepted, next_token, accepted, keep, hidden = verified[:5]
        if proposal.k:
            # Commit: pending token + accepted drafts stay in the target cache; the rest is rolled back.
            cache.truncate(cache.lengths - proposal.lengths + num_accepted, keep)
            cache.compact()
            new_tokens = torch.cat([accepted, next_token[:, None]], dim=1)
            new_tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
            counts, hit_eos = stop_counts(new_tokens, num_accepted + 1, engine.eos)
            counts = torch.minimum(counts, self.remaining)
        else:  # plain decoding: one token per row, and every live row has room for it
            new_tokens = next_token[:, None]
            hit_eos = torch.isin(next_token, engine.eos)
            counts = self.ones()
        seqs.append(new_tokens, counts)
        self.remaining = self.remaining - counts
        done = hit_eos | (self.remaining <= 0)
        stats.target_forwards += 1
        stats.verify_time += time.perf_counter() - tick

        tick = time.perf_counter()
        if drafting:
            session.accepted(seqs, num_accepted)
        if layers:
            feature_tick = time.perf_counter()
            features = committed_features(hidden, keep, counts)
            stats.feature_time += time.perf_counter() - feature_tick
            session.observe(seqs, features)
        stats.draft_time += time.perf_counter() - tick
        if proposal.is_tree:
            deepest = proposal.depths().max(1).values if proposal.k else proposal.lengths
            stats.record_step(int(deepest.max()) if proposal.k else 0, deepest, num_accepted, proposal.lengths)
        else:
            stats.record_step(proposal.k, proposal.lengths, num_accepted)
        if engine.config.draft_schedule == "heuristic" and drafting:
            full = bool((num_accepted == proposal.lengths).all())
            self.k = min(self.k + 2, engine.config.k_limit) if full else max(1, self.k - 1)
        proposed = accepted = None
        if engine.stream or (engine.policy.wants_counts and drafting):  # a step cut to no drafts counts too
            proposed = (proposal.depths().max(1).values if proposal.is_tree and proposal.k
                        else proposal.lengths).tolist()
            accepted = num_accepted.tolist()
        if engine.stream:
            self._report(proposed, accepted, new_tokens, counts, verified[5], keep, updates)
        timing = {"draft": drafted + time.perf_counter() - tick, "step": time.perf_counter() - started}
        if engine.policy.wants_counts and drafting and accepted is not None and not proposal.is_tree:
            # rows the token budget cut short: their unfilled width says nothing of the drafter
            timing["budget_cut"] = (offered.lengths < drafted_in_full.lengths).tolist()
        engine.policy.observe(engine, self, proposal.k, proposed, accepted, timing)
        self._leave_done(done, updates)

    def _report(self, proposed, accepted, new_tokens, counts, logits, keep, updates) -> None:
        """Each row's tokens of this step, its speculation counters, its log-probabilities when asked.
        proposed, accepted: each row's drafts verified (trees: the deepest) and accepted."""
        counts_, tokens = counts.tolist(), new_tokens.tolist()
        self.engine.record(proposed, accepted)
        logprobs = None
        if any(s.request.logprobs for s in self.states):
            if keep is None:
                columns = None
            else:  # the accepted path's columns in order (the root first)
                width = keep.shape[1]
                columns = torch.where(keep, torch.arange(width, device=keep.device), width).sort(dim=1).values
                columns = columns[:, : new_tokens.shape[1]].clamp(max=width - 1)
            chosen = logits if columns is None else logits.gather(
                1, columns[:, :, None].expand(-1, -1, logits.shape[-1]))
            logprobs = self._logprobs(chosen[:, : new_tokens.shape[1]], new_tokens)
        for row, state in enumerate(self.states):
            s = state.stats
            s.steps += 1
            if proposed[row]:
                s.drafts += 1
                s.draft_tokens += proposed[row]
                s.accepted_tokens += accepted[row]
            n = counts_[row]
            s.new_tokens += n
            updates.append(Update(state.request_id, tokens[row][:n],
                                  logprobs[row][:n] if logprobs is not None and state.request.logprobs else None))

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> list[list[float]]:
        """log p(token) under the target's (processed, unwarped) logits [B, n, V] of tokens [B, n]."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(2, tokens[:, : logp.shape[1], None]).squeeze(2).tolist()

    def _leave_done(self, done: torch.Tensor, updates: list[Update]) -> None:
        if not bool(done.any()):
            return
        rows = done.nonzero().squeeze(1).tolist()
        self.leave({i: "stop" if self._ends_in_eos(i) else "length" for i in rows}, updates)

    def _ends_in_eos(self, row: int) -> bool:
        last = self.seqs.tokens[row, int(self.seqs.lengths[row]) - 1]
        return bool(torch.isin(last, self.engine.eos))

    def leave(self, reasons: dict[int, str], updates: list[Update]) -> None:
        """Rows ``reasons`` (row -> finish reason) leave the batch: their updates are final, their memory freed."""
        if not reasons:
            return
        engine = self.engine
        keep_rows = leaving_order(self.size, reasons)  # the last rows fill the leaving ones' slots
        for row, reason in reasons.items():
            state = self.states[row]
            if not engine.stream:  # the whole output with the final update
                start, stop = int(self.prompt_lengths[row]), int(self.seqs.lengths[row])
                state.tokens = self.seqs.tokens[row, start:stop].tolist()
            engine.free(state)
            with engine._lock:
                engine._finish(state, reason, updates, state.tokens)
        self.states = [self.states[i] for i in keep_rows]
        self.empty = self._ones = None
        if not keep_rows:
            self._record_cache()
            return
        index = torch.tensor(keep_rows, device=self.seqs.tokens.device)
        self.seqs.select_rows(index)
        self.cache.select_rows(index)
        self.session.select_rows(index)
        self.prompt_lengths, self.budget, self.remaining = (self.prompt_lengths[index], self.budget[index],
                                                            self.remaining[index])

    def _record_cache(self) -> None:
        stats = self.engine.stats
        if self.cache is not None:
            stats.cache_bytes = max(stats.cache_bytes, self.cache.memory_bytes)
            stats.cache_grown += getattr(self.cache, "grown", 0)

    def close(self) -> None:
        self.seqs = self.cache = self.session = None


ENGINE_READY = True


# ---------------------------------------------------------------------------------------------
# generate: the engine's one-shot client (every prompt joins at once; it steps until all finish).

@dataclass
class GenerationOutput:
    token_ids: list[list[int]]   # new tokens of each prompt, EOS included when generated
    texts: list[str] | None      # decoded new tokens, when the target has a tokenizer
    stats: Stats


def generate(target: Target, prompts, drafter: Drafter | None = None, num_draft_tokens: int | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, draft_schedule: str = "constant",
             tree: TreeConfig | None = None) -> GenerationOutput:
    """Generate from a batch of prompts, losslessly sped up by ``drafter``.

    A prompt is a string, a list of token ids, or a conversation: a list of {"role", "content"} dicts
    that the target's chat template renders (``Target.encode``); forms may mix within a batch.

    ``tree``: verify token trees (``TreeConfig(depth, topk, num_nodes)``) instead of chains of k.
    ``num_draft_tokens``: k, the drafts per step (default: the drafter's own, else 5).
    """
    tree = default_tree(drafter, num_draft_tokens, tree)
    if num_draft_tokens is None:
        num_draft_tokens = default_draft_tokens(drafter)
    config = GenerationConfig(num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens,
                              sampling=SamplingConfig(temperature, top_k, top_p), seed=seed,
                              draft_schedule=draft_schedule, tree=tree)
    return generate_ids(target, target.encode(prompts), drafter or NoDraft(), config)


def generate_ids(target: Target, prompts: list[list[int]], drafter: Drafter,
                 config: GenerationConfig, policy=None) -> GenerationOutput:
    """The one-shot path: every prompt joins the engine at once, and it steps until all finish.
    policy: drafts per step (specdec.schedule; None: config's k and schedule)."""
    check_context(target, prompts, config.max_new_tokens)
    started = time.perf_counter()
    engine = Engine(target, drafter, num_draft_tokens=config.num_draft_tokens, tree=config.tree,
                    max_batch_size=max(1, len(prompts)), max_queue=max(1, len(prompts)), stream=False,
                    draft_schedule=config.draft_schedule, max_draft_tokens=config.max_draft_tokens, policy=policy)
    stats = engine.stats
    stats.batch_size = len(prompts)
    if config.max_new_tokens == 0:
        return _finish(target, [[] for _ in prompts], stats, started)
    # One batch, one seed: the generator of the first (only) group is seeded with config.seed.
    requests = [Request(list(p), config.max_new_tokens, config.sampling, config.seed) for p in prompts]
    states = engine.run(requests)
    return _finish(target, [s.tokens for s in states], stats, started)


def _finish(target: Target, outputs: list[list[int]], stats: Stats, started: float) -> GenerationOutput:
    stats.finalize()
    stats.new_tokens = sum(len(o) for o in outputs)
    stats.total_time = time.perf_counter() - started
    texts = None if target.tokenizer is None else [target.decode(o) for o in outputs]
    return GenerationOutput(outputs, texts, stats)
