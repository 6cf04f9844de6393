"""The continuous-batching engine: requests that join and leave between steps get, token for token,
what each prompt gets alone with plain decoding, for every drafter (the zoo target with every
trained drafter, the zoo's self-drafting variants, tiny models on the transformers backend), also
when the policy switches drafting off and on; KV budgets, cancellation, queues, log-probabilities
and mixed sampling settings.
"""

from __future__ import annotations

import math

import pytest
import torch

import specdec
from specdec.drafters import MTP, DFlash, DraftModel, Eagle, EarlyExit, Lookahead, Medusa, NoDraft, PromptLookup
from specdec.engine import Engine, QueueFullError, Request
from specdec.errors import ContextLengthError, InvalidArgumentError
from specdec.sampling import SamplingConfig
from specdec.schedule import LoadAware, parse_policy
from specdec.zoo import zoo_path

from test_greedy_parity import PROMPTS

# Prompt i arrives before step ARRIVALS[i] with BUDGETS[i] new tokens: rows join a running batch,
# rows leave at the limit while others continue, and a row joins after others have left.
ARRIVALS = (0, 0, 2, 3, 3, 9, 30)
BUDGETS = (24, 7, 30, 12, 18, 20, 9)
TEXTS = PROMPTS + ["def fib(n):\n    if n < 2:\n        return n\n", "for i in range(10):\n    print(i)\n",
                   "# sort a list\nitems = sorted(items)\n"]


class Alternate:
    """A policy that drafts k at even steps and nothing at odd ones (drafting switched off and on)."""

    name = "alternate"
    wants_counts = False

    def __init__(self, k: int):
        self.k, self.calls = k, 0

    def prepare(self, engine):
        pass

    def draft_tokens(self, engine, group):
        self.calls += 1
        return self.k if self.calls % 2 else 0

    def observe(self, engine, group, width, proposed, accepted, timing):
        pass


def run_arrivals(engine: Engine, prompts, budgets=BUDGETS, arrivals=ARRIVALS, sampling=None):
    """Add prompt i before step arrivals[i]; returns each request's streamed tokens."""
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    ids, tokens, finished, step = {}, {}, {}, 0
    while pending or engine.has_work:
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            ids[engine.add(Request(prompts[i], budgets[i], sampling or SamplingConfig()))] = i
        for update in engine.step():
            tokens.setdefault(ids[update.request_id], []).extend(update.tokens)
            if update.finish_reason:
                finished[ids[update.request_id]] = update.finish_reason
        step += 1
    assert len(finished) == len(prompts)
    return [tokens[i] for i in range(len(prompts))], [finished[i] for i in range(len(prompts))]


def alone(target, prompts, budgets=BUDGETS):
    return [specdec.generate(target, [p], max_new_tokens=m).token_ids[0] for p, m in zip(prompts, budgets)]


@pytest.fixture(scope="module")
def zoo_target():
    return specdec.load_target(zoo_path("target"))


@pytest.fixture(scope="module")
def zoo_prompts(zoo_target):
    return zoo_target.encode(TEXTS[: len(ARRIVALS)])


@pytest.fixture(scope="module")
def zoo_reference(zoo_target, zoo_prompts):
    return alone(zoo_target, zoo_prompts)


def zoo_drafters():
    return [("none", lambda: NoDraft(), {}), ("prompt-lookup", lambda: PromptLookup(max_ngram=3), {}),
            ("draft-model", lambda: DraftModel(zoo_path("draft")), {}),
            ("draft-model tree", lambda: DraftModel(zoo_path("draft")),
             {"tree": specdec.TreeConfig(depth=3, topk=2, num_nodes=6)}),
            # the target's own quantized copy: it takes each cohort's prompt from the target's cache
            ("draft-model copy", lambda: DraftModel(zoo_path("target"), quantize="q8_0"), {}),
            ("medusa", lambda: Medusa(zoo_path("medusa")), {}), ("eagle", lambda: Eagle(zoo_path("eagle")), {}),
            ("eagle3 tree", lambda: Eagle(zoo_path("eagle3")), {"tree": specdec.TreeConfig(depth=3, topk=2,
                                                                                          num_nodes=8)}),
            ("dflash", lambda: DFlash(zoo_path("dflash")), {}),
            ("lookahead", lambda: Lookahead(window=3, ngram=4, guesses=3), {}),
            ("lookahead tree", lambda: Lookahead(window=2, ngram=3, guesses=3),
             {"tree": specdec.TreeConfig(depth=2, topk=3, num_nodes=5)})]


@pytest.mark.parametrize("name,make,options", zoo_drafters(), ids=[d[0] for d in zoo_drafters()])
def test_joins_and_leaves_equal_each_prompt_alone(name, make, options, zoo_target, zoo_prompts, zoo_reference):
    engine = Engine(zoo_target, make(), num_draft_tokens=4, **options)
    tokens, reasons = run_arrivals(engine, zoo_prompts)
    assert tokens == zoo_reference, name
    assert all(r in ("stop", "length") for r in reasons)
    assert engine.metrics.kv_tokens_reserved == 0 and not engine.groups
    if name != "none":
        assert engine.metrics.num_accepted_tokens > 0, "a trained drafter should get drafts accepted"


@pytest.mark.parametrize("name,make,options", zoo_drafters(), ids=[d[0] for d in zoo_drafters()])
def test_prompts_of_unequal_lengths_prefill_in_groups(name, make, options, zoo_target, monkeypatch):
    """A cohort of prompts from 3 to about 200 tokens prefills in several blocks, each as narrow as its
    longest prompt, and every drafter then gives each prompt what it gets alone; sampling draws the same
    tokens as one left-padded block."""
    from specdec import engine as engine_module

    texts = [TEXTS[0], TEXTS[1] * 6, "x", TEXTS[2] * 2, TEXTS[3] * 12, TEXTS[4]]
    prompts = zoo_target.encode(texts)
    budgets = [12] * len(prompts)
    blocks = []
    real_prefill = engine_module.prefill

    def spy(target, tokens, valid, capacity, layers, groups):
        blocks.extend(tokens[torch.tensor(rows)][:, tokens.shape[1] - int(valid[torch.tensor(rows)].sum(1).max()):].shape
                      for rows in groups)
        return real_prefill(target, tokens, valid, capacity, layers, groups)

    monkeypatch.setattr(engine_module, "prefill", spy)
    engine = Engine(zoo_target, make(), num_draft_tokens=4, **options)
    tokens, _ = run_arrivals(engine, prompts, budgets, arrivals=[0] * len(prompts))
    longest = max(len(p) for p in prompts)
    assert len(blocks) >= 3 and sum(rows * width for rows, width in blocks) < len(prompts) * longest / 2
    assert tokens == alone(zoo_target, prompts, budgets), name
    if name != "none":
        return
    sampling = SamplingConfig(1.0, 20, None)
    grouped = run_arrivals(Engine(zoo_target, make()), prompts, budgets, [0] * len(prompts), sampling)
    monkeypatch.setattr(engine_module, "prefill_groups", lambda lengths: [list(range(len(lengths)))])
    dense = run_arrivals(Engine(zoo_target, make()), prompts, budgets, [0] * len(prompts), sampling)
    assert grouped == dense


@pytest.mark.parametrize("name,make,options", zoo_drafters()[1:], ids=[d[0] for d in zoo_drafters()[1:]])
def test_drafting_switched_off_and_on_keeps_the_output(name, make, options, zoo_target, zoo_prompts,
                                                       zoo_reference):
    engine = Engine(zoo_target, make(), num_draft_tokens=3, policy=Alternate(3), **options)
    tokens, _ = run_arrivals(engine, zoo_prompts)
    assert tokens == zoo_reference, name
    assert 0 in engine.stats.k_history and max(engine.stats.k_history) > 0


def nan_caches(monkeypatch):
    """New native KV stores filled with NaN instead of left uninitialised: a column read before a pass wrote
    it (or before it was zeroed as a hole) turns its row's logits to NaN."""
    from specdec.models import llama

    new_kv = llama.new_kv
    monkeypatch.setattr(llama, "new_kv", lambda model, batch, capacity: new_kv(model, batch, capacity).fill_(float("nan")))


@pytest.mark.parametrize("name,make,options", [d for d in zoo_drafters() if d[0] in (
    "none", "draft-model copy", "draft-model tree", "eagle3 tree", "dflash", "lookahead tree")],
    ids=lambda d: d if isinstance(d, str) else "")
def test_caches_read_only_columns_written_before(name, make, options, zoo_target, zoo_prompts, zoo_reference,
                                                 monkeypatch):
    """KV stores are allocated uninitialised (llama.new_kv). Filled with NaN here, requests joining and
    leaving (stores reallocated, rows moved, holes), prompts of unequal lengths read in groups, drafting
    switched off and on, trees and lookahead's branch: each prompt still gets what it gets alone."""
    texts = [TEXTS[0], TEXTS[1] * 6, "x", TEXTS[2] * 2, TEXTS[3] * 12]
    prompts, budgets = zoo_target.encode(texts), [10] * len(texts)
    expected = alone(zoo_target, prompts, budgets)
    nan_caches(monkeypatch)
    engine = Engine(zoo_target, make(), num_draft_tokens=3, policy=Alternate(3), **options)
    assert run_arrivals(engine, zoo_prompts)[0] == zoo_reference, name
    engine = Engine(zoo_target, make(), num_draft_tokens=3, **options)
    assert run_arrivals(engine, prompts, budgets, arrivals=[0] * len(prompts))[0] == expected, name


class OneInFour(Alternate):
    """Drafts k at every fourth step: three plain steps between, so a draft model falls 4+ tokens behind."""

    def draft_tokens(self, engine, group):
        self.calls += 1
        return self.k if self.calls % 4 == 1 else 0


def test_a_copy_of_the_target_catches_up_from_the_targets_cache(zoo_target, zoo_prompts, zoo_reference,
                                                                monkeypatch):
    """After steps that did not draft, the target's quantized copy takes the target's cache again instead of
    reading the tokens it missed: every pass it runs reads one token (the pending one, then each draft),
    under joins and leaves; another draft model reads what it missed."""
    from specdec.backends.native import NativeCache

    widths = {}
    forward = NativeCache.forward

    def recorded(cache, tokens, *args, **kwargs):
        widths.setdefault(id(cache.model), []).append(tokens.shape[1])
        return forward(cache, tokens, *args, **kwargs)

    monkeypatch.setattr(NativeCache, "forward", recorded)
    for drafter, copy in ((DraftModel(zoo_path("target"), quantize="q8_0"), True), (DraftModel(zoo_path("draft")), False)):
        engine = Engine(zoo_target, drafter, num_draft_tokens=3, policy=OneInFour(3))
        assert run_arrivals(engine, zoo_prompts)[0] == zoo_reference
        assert drafter.copies_target == copy
        passes = widths.pop(id(drafter.backend.model))
        if copy:
            assert set(passes) == {1}
        else:
            assert max(passes) >= 4


@pytest.mark.parametrize("variant,drafter", [("layerskip", lambda: EarlyExit()),
                                             ("layerskip", lambda: EarlyExit(reuse_kv=False)),
                                             ("mtp", lambda: MTP()), ("mtp-parallel", lambda: MTP())])
def test_self_drafting_variants_under_joins(variant, drafter):
    target = specdec.load_target(zoo_path(variant))
    prompts = target.encode(TEXTS[: len(ARRIVALS)])
    reference = alone(target, prompts)
    for policy in (None, Alternate(4)):
        engine = Engine(target, drafter(), num_draft_tokens=4, policy=policy)
        assert run_arrivals(engine, prompts)[0] == reference


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_transformers_backend_caches_extend(arch, model_dirs):
    """hf.HFCache (batched with masks) and the draft model's cache on it; GPT-2 on its own backend."""
    target = specdec.load_target(model_dirs[arch], backend="hf")
    target.eos_token_ids = ()
    prompts = target.encode(TEXTS[: len(ARRIVALS)])
    reference = alone(target, prompts)
    for drafter in (NoDraft(), PromptLookup(max_ngram=2), DraftModel(model_dirs[f"{arch}-draft"], backend="hf")):
        engine = Engine(target, drafter, num_draft_tokens=3, policy=Alternate(3))
        assert run_arrivals(engine, prompts)[0] == reference, drafter.name


def test_kv_budget_makes_admission_wait(zoo_target, zoo_prompts, zoo_reference):
    need = max(len(p) + m for p, m in zip(zoo_prompts, BUDGETS)) + 4 + 1
    engine = Engine(zoo_target, DraftModel(zoo_path("draft")), num_draft_tokens=4, max_kv_tokens=2 * need)
    peak = waited = 0
    ids = [engine.add(Request(p, m)) for p, m in zip(zoo_prompts, BUDGETS)]
    tokens = {i: [] for i in ids}
    while engine.has_work:
        for update in engine.step():
            tokens[update.request_id].extend(update.tokens)
        peak = max(peak, engine.metrics.kv_tokens_reserved)
        assert engine.metrics.kv_tokens_reserved <= 2 * need
        waited = max(waited, engine.metrics.waiting)
    assert [tokens[i] for i in ids] == zoo_reference
    assert peak > need, "two requests should have run side by side"
    assert waited >= len(ids) - 3, "the budget should have held requests back"
    with pytest.raises(ContextLengthError, match="budget"):
        Engine(zoo_target, max_kv_tokens=10).add(Request(zoo_prompts[0], 16))


def test_cancel_frees_memory_at_once(zoo_target, zoo_prompts):
    engine = Engine(zoo_target, PromptLookup(), num_draft_tokens=4, max_batch_size=2)
    first, second, third = (engine.add(Request(p, 100)) for p in zoo_prompts[:3])
    engine.step()
    assert engine.running == 2 and engine.metrics.waiting == 1
    reserved = engine.metrics.kv_tokens_reserved
    assert engine.cancel(first) and engine.cancel(third)
    updates = engine.step()
    assert {u.request_id: u.finish_reason for u in updates if u.finish_reason} == {first: "cancelled",
                                                                                   third: "cancelled"}
    assert engine.running == 1 and engine.metrics.waiting == 0
    assert engine.metrics.kv_tokens_reserved == reserved - (len(zoo_prompts[0]) + 100 + 5)
    assert engine.cancel(second)
    engine.step()
    assert engine.metrics.kv_tokens_reserved == 0 and not engine.has_work and not engine.groups
    assert not engine.cancel("no-such-request")


def test_queue_bound_and_bad_requests(zoo_target, zoo_prompts):
    engine = Engine(zoo_target, max_queue=2)
    engine.add(Request(zoo_prompts[0], 4))
    engine.add(Request(zoo_prompts[1], 4))
    with pytest.raises(QueueFullError):
        engine.add(Request(zoo_prompts[2], 4))
    with pytest.raises(ContextLengthError, match="context window"):
        Engine(zoo_target).add(Request([1] * zoo_target.max_positions, 4))
    with pytest.raises(InvalidArgumentError):
        Engine(zoo_target).add(Request([], 4))
    with pytest.raises(InvalidArgumentError):
        Engine(zoo_target).add(Request(zoo_prompts[0], 0))


def test_logprobs_are_the_targets(zoo_target, zoo_prompts):
    """Each returned token's log-probability equals log_softmax of one whole pass over the output."""
    engine = Engine(zoo_target, DraftModel(zoo_path("draft")), num_draft_tokens=4)
    ids = [engine.add(Request(p, 16, logprobs=True)) for p in zoo_prompts[:3]]
    got = {i: ([], []) for i in ids}
    while engine.has_work:
        for u in engine.step():
            got[u.request_id][0].extend(u.tokens)
            got[u.request_id][1].extend(u.logprobs or [])
    for prompt, i in zip(zoo_prompts, ids):
        tokens, logprobs = got[i]
        assert len(logprobs) == len(tokens) == 16
        sequence = torch.tensor([prompt + tokens])
        cache = zoo_target.new_cache(1, sequence.shape[1] + 4)
        logits, _ = zoo_target.forward(cache, sequence, logits_to_keep=sequence.shape[1])
        expected = torch.log_softmax(logits[0, len(prompt) - 1: -1].float(), -1)
        expected = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
        assert all(math.isfinite(x) and x <= 0 for x in logprobs)


def test_mixed_sampling_settings_run_side_by_side(zoo_target, zoo_prompts, zoo_reference):
    """Greedy requests stay exact beside sampled ones (each setting is its own batch)."""
    engine = Engine(zoo_target, DraftModel(zoo_path("draft")), num_draft_tokens=4)
    greedy = [engine.add(Request(p, m)) for p, m in zip(zoo_prompts[:4], BUDGETS)]
    sampled = [engine.add(Request(p, 12, SamplingConfig(0.8, top_k=20), seed=3)) for p in zoo_prompts[:3]]
    tokens = {i: [] for i in greedy + sampled}
    while engine.has_work:
        for u in engine.step():
            tokens[u.request_id].extend(u.tokens)
    assert [tokens[i] for i in greedy] == zoo_reference[:4]
    assert all(len(tokens[i]) <= 12 for i in sampled)
    assert len({tuple(tokens[i]) for i in sampled}) > 1


def test_request_stats_count_acceptance(zoo_target, zoo_prompts):
    engine = Engine(zoo_target, DraftModel(zoo_path("draft")), num_draft_tokens=4)
    engine.add(Request(zoo_prompts[0], 30))
    final = None
    while engine.has_work:
        final = [u for u in engine.step() if u.finish_reason] or final
    stats = final[0].stats
    assert stats.new_tokens == 30 and 0 < stats.drafts <= stats.steps  # the last step may have no budget to draft
    assert stats.accepted_tokens <= stats.draft_tokens <= 4 * stats.steps
    assert stats.mean_acceptance_length == pytest.approx(29 / stats.steps)
    m = engine.metrics
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (stats.drafts, stats.draft_tokens,
                                                                         stats.accepted_tokens)
    assert m.accepted_per_pos[0] >= m.accepted_per_pos[-1] and sum(m.accepted_per_pos) == stats.accepted_tokens


# ---------------------------------------------------------------------------------------------
# Policies: how many drafts a step verifies.

def test_static_table_by_batch_size(zoo_target, zoo_prompts, zoo_reference):
    engine = Engine(zoo_target, DraftModel(zoo_path("draft")), num_draft_tokens=4,
                    policy=parse_policy("static:1=4,3=2,5=0"))
    sizes = []
    original = engine.policy.draft_tokens
    engine.policy.draft_tokens = lambda e, g: sizes.append((g.size, original(e, g))) or sizes[-1][1]
    assert run_arrivals(engine, zoo_prompts)[0] == zoo_reference
    assert {k for b, k in sizes if b >= 5} == {0} and {k for b, k in sizes if b < 3} == {4}
    assert {k for b, k in sizes if 3 <= b < 5} == {2}
    with pytest.raises(InvalidArgumentError):
        parse_policy("static:2=4")
    with pytest.raises(InvalidArgumentError):
        parse_policy("static:1=four")


def synthetic(verify, acceptance: float, k_max: int = 4, sizes=(1, 2, 4, 8)):
    policy = LoadAware(k_max)
    policy.enabled, policy.k_max, policy.sizes = True, k_max, list(sizes)
    policy.table = {(b, n): verify(b, n) for b in sizes for n in range(1, k_max + 2)}
    policy.evaluated, policy.accepted = [1e6] * k_max, [acceptance * 1e6] * k_max
    return policy


class Rows:
    def __init__(self, size):
        self.size = size


def test_load_aware_drafts_less_as_verification_gets_dearer():
    # Verification whose cost grows with every token (a saturated accelerator): drafts at 0.5 never pay.
    assert synthetic(lambda b, n: 1e-3 * b * n, 0.5).draft_tokens(None, Rows(4)) == 0
    # A pass that costs the same for 1 or 5 tokens: every draft pays.
    assert synthetic(lambda b, n: 1e-3 * b, 0.5).draft_tokens(None, Rows(4)) == 4
    # Cost flat up to 8 tokens a pass, then linear: small batches draft, large ones do not.
    policy = synthetic(lambda b, n: 1e-3 * max(1.0, b * n / 8), 0.8)
    choices = [policy.draft_tokens(None, Rows(b)) for b in (1, 2, 4, 8)]
    assert choices[0] == 4 and choices[-1] == 0 and choices == sorted(choices, reverse=True)
    # Draft acceptance falling with position: the search stops at the first draft that lowers the rate.
    policy = synthetic(lambda b, n: 1e-3 * (1 + 0.3 * (n - 1)), 0.9)
    policy.accepted = [0.9e6, 0.9e6, 0.05e6, 0.9e6]
    assert policy.draft_tokens(None, Rows(1)) == 2


def test_load_aware_charges_a_drafting_steps_fixed_part_once():
    """Drafting cost as a line a + b k through the costs seen at each k (served at one client: 6.5 ms for
    one draft, 18 ms for four, a fixed part from the catch-up, the bookkeeping and the server's threads):
    four drafts are not charged four times one, and a drafter right 98% of the time drafts its most.
    With one k seen, that k's cost per draft times k; a line that would start below 0 goes through it."""
    policy = LoadAware(max_draft_tokens=4, table={(1, n): 1e-3 * (9 + 0.5 * (n - 1)) for n in range(1, 6)})
    policy.k_max = 4
    policy.evaluated, policy.accepted = [60.0, 30.0, 20.0, 10.0], [59.0, 29.5, 19.7, 9.8]
    policy.overhead = {False: {1: [0.3e-3, 50]}, True: {1: [3e-3, 33]}}
    policy.draft_cost = {1: {1: [6.5e-3, 30], 4: [18e-3, 3]}}
    assert policy.drafting_seconds(1, 4) == pytest.approx(18e-3, rel=0.02)
    assert policy.drafting_seconds(1, 2) == pytest.approx(10.3e-3, rel=0.02)
    assert policy.draft_tokens(None, Rows(1)) == 4
    policy.draft_cost = {1: {1: [6.5e-3, 30]}}
    assert policy.drafting_seconds(1, 4) == pytest.approx(26e-3)
    policy.draft_cost = {1: {1: [5e-3, 10], 2: [12e-3, 10]}}     # no fixed part: the line through 0
    assert policy.drafting_seconds(1, 1) == pytest.approx(5.8e-3)
    assert policy.drafting_seconds(1, 0) == 0.0


def test_the_profile_times_widths_in_turn_and_keeps_each_ones_least(timed_backend):
    """A slow spell of the machine during the start-up profile (here 12 passes in a row at 5x their cost)
    lands on every width alike and leaves no width's estimate above its own cost, where timing each width's
    passes one after the other put the whole spell on one or two widths."""
    from specdec.backends import costs

    def cost(width, layers, call):
        return (1e-3 * (1 + 0.1 * width) if width <= 8 else 0.0) * (5 if 20 <= call < 32 else 1)

    backend, _ = timed_backend(cost)
    times = costs.forward_times(backend, range(1, 6), 16, repeats=3)
    assert times == pytest.approx({n: 1e-3 * (1 + 0.1 * n) for n in range(1, 6)})


def test_load_aware_estimates_a_drafter_right_most_of_the_time():
    """Positions a policy stopped verifying take the estimate of the one before (not the fixed prior), a
    profile's slow sample does not hide the wider passes (a wider pass is never cheaper), and one slow first
    drafting step is not yet a clear loss: the next step probes at the k that looks best."""
    from specdec.schedule import monotone

    policy = synthetic(lambda b, n: 1e-3, 0.98)
    policy.evaluated, policy.accepted = [50.0, 1.0, 0.0, 0.0], [49.0, 1.0, 0.0, 0.0]
    assert policy.acceptance(0) == pytest.approx(0.97, abs=0.01)
    assert policy.acceptance(3) == pytest.approx(policy.acceptance(1), abs=0.01)
    assert policy.acceptance(3) > 0.95                                                      # not the prior 0.7
    assert monotone({(1, 1): 2.0, (1, 2): 3.0, (1, 3): 2.5, (2, 1): 4.0, (2, 2): 3.5}) == \
        {(1, 1): 2.0, (1, 2): 2.5, (1, 3): 2.5, (2, 1): 3.5, (2, 2): 3.5}
    # A profile with one slow sample (width 3) does not hide the wider passes: a drafter right 98% of the
    # time at a draft cost of a third of a pass drafts its most, as it does on the clean profile.
    clean = {(1, n): 1e-3 * (1 + 0.05 * n) for n in range(1, 6)}
    for table in (clean, {**clean, (1, 3): 3e-3}):
        policy = LoadAware(max_draft_tokens=4, table=monotone(table))
        policy.k_max, policy.draft_cost = 4, {1: {4: [1.4e-3, 8]}}
        policy.evaluated, policy.accepted = [50.0, 0.0, 0.0, 0.0], [49.0, 0.0, 0.0, 0.0]
        assert policy.draft_tokens(None, Rows(1)) == 4
    # One drafting step seen, made dear by a one-off: drafting looks like a clear loss, yet the next step
    # probes (no ``explore`` plain steps first), and so on until the costs were seen ``evidence`` times.
    policy = synthetic(lambda b, n: 1e-3, 0.98)
    policy.draft_cost = {1: {4: [0.2, 1]}}
    assert policy.draft_tokens(None, Rows(1)) >= 1
    # A row the token budget cut to 2 drafts, both accepted, shows no rejection at the third slot.
    for cut, third in ((True, 0.0), (False, 1.0)):
        policy.evaluated, policy.accepted = [0.0] * 4, [0.0] * 4
        policy.count_acceptance(4, [2], [2], [cut])
        assert policy.evaluated[:3] == [1.0, 1.0, third] and policy.accepted[:3] == [1.0, 1.0, 0.0]
    # Seen often enough, the same loss is clear: no probe.
    policy.draft_cost, policy.undrafted = {1: {4: [0.2, policy.evidence]}}, 0
    assert not any(policy.draft_tokens(None, Rows(1)) for _ in range(policy.explore + 2))
    # A step whose drafter cut every draft (--draft-p-min) asked for 2: a rejection at the first position, and
    # its drafting cost charged to the 2 drafts asked for (it gained nothing for it).
    policy = synthetic(lambda b, n: 1e-3, 0.98)
    policy.evaluated, policy.accepted, policy.last_choice = [0.0] * 4, [0.0] * 4, 2
    policy.observe(None, Rows(1), 0, [0], [0], {"draft": 3e-3, "step": 5e-3})
    assert policy.evaluated[:2] == [1.0, 0.0] and policy.accepted[:2] == [0.0, 0.0]
    assert policy.draft_cost == {1: {2: [3e-3, 1]}}
    # ... and its verification as wide as its steps verified: none yet, T(1); 1.5 drafts on average: halfway.
    policy.table = {(b, n): 1e-3 * n for b in policy.sizes for n in range(1, 6)}
    assert policy.verified_seconds(1, 2) == pytest.approx(1e-3) and policy.verified_seconds(1, 3) == pytest.approx(4e-3)
    policy.widths = {2: [1.5, 4]}
    assert policy.verified_seconds(1, 2) == pytest.approx(2.5e-3)


def test_load_aware_profiles_and_stays_exact(zoo_target, zoo_prompts, zoo_reference):
    engine = Engine(zoo_target, DraftModel(zoo_path("draft")), num_draft_tokens=4, max_batch_size=8,
                    policy=LoadAware())
    policy = engine.policy
    assert engine.profile_seconds > 0 and policy.sizes == [1, 2, 4, 8]
    assert set(policy.table) == {(b, n) for b in (1, 2, 4, 8) for n in range(1, 6)}
    assert all(t > 0 for t in policy.table.values())
    assert run_arrivals(engine, zoo_prompts)[0] == zoo_reference
    assert policy.evaluated and policy.draft_cost
    # Plain decoding and trees are left alone.
    assert not Engine(zoo_target, policy=LoadAware()).policy.enabled
