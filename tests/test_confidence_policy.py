"""The confidence policies (schedule.ConfidenceThreshold, schedule.ConfidenceScheduler): they cut each
row's drafts from the drafter's own confidences, and output stays the target's: greedy token for
token on ragged batches, sampling in distribution. The cut reads only what the drafter knew before
each draft (never the target, never the draft itself); refusals are one line.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import specdec
from specdec.backends import hf
from specdec.backends.target import load_target
from specdec.commands.cli import main
from specdec.commands.tiny import build_tokenizer, save_tiny
from specdec.decode import GenerationConfig
from specdec.drafters import DraftModel, NoDraft, PromptLookup, Proposal
from specdec.engine import Engine, Request, generate_ids
from specdec.errors import InvalidArgumentError
from specdec.sampling import SamplingConfig
from specdec.schedule import ConfidenceScheduler, ConfidenceThreshold, admit_by_survival, bucket, parse_policy
from specdec.verify import verify_sampling

from test_greedy_parity import PROMPTS
from test_sampling import P_VALUE, TARGET, chi_square_p, draft_cases, exact_two_token_distribution


# A stand-in for DSpark's confidence head around any chain drafter ----------------------------------------
def hashed_confidence(pending: torch.Tensor, drafts: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """[B, k] c[r, j] in [0.38, 0.98], a hash of row r's pending token and its drafts before j: never of
    draft j, the drafts after it or the target."""
    state = pending.long() * 7919 + salt
    columns = []
    for j in range(drafts.shape[1]):
        unit = ((state * 2654435761) % 1009).double() / 1008  # [B] in [0, 1]
        columns.append(0.98 - 0.6 * unit ** 2)
        state = (state * 31 + drafts[:, j] + 1) % 1_000_003
    return torch.stack(columns, 1).float() if columns else torch.zeros(drafts.shape[0], 0)


class Confident:
    """Any drafter, with ``hashed_confidence`` riding along in its proposals."""

    has_confidence = True

    def __init__(self, inner, salt: int = 0):
        self.inner, self.salt, self.name = inner, salt, f"confident-{inner.name}"

    def __getattr__(self, name):  # features, default_draft_tokens, ...: the wrapped drafter's
        return getattr(self.inner, name)

    def start(self, context, seqs):
        return ConfidentSession(self.inner.start(context, seqs), self.salt)


class ConfidentSession:
    def __init__(self, inner, salt: int):
        self.inner, self.salt = inner, salt

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, seqs, k):
        proposal = self.inner.propose(seqs, k)
        pending = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])[:, 0]
        confidence = hashed_confidence(pending.cpu(), proposal.tokens.cpu(), self.salt).to(proposal.tokens.device)
        return dataclasses.replace(proposal, confidence=confidence)


class Recorder:
    """Wraps a policy's cut: every step's (offered lengths, kept lengths)."""

    def __init__(self, policy):
        self.policy, self.cuts = policy, []
        original = policy.cut

        def cut(engine, group, proposal):
            kept = original(engine, group, proposal)
            self.cuts.append((proposal.lengths.tolist(), kept.lengths.tolist(), kept.k))
            return kept
        policy.cut = cut


def flat_table(*widths: float, sizes=(1,)) -> dict:
    """T(rows, width) = rows x widths[width - 1] seconds (the scheduler scales past the largest size)."""
    return {(b, w): b * t for b in sizes for w, t in enumerate(widths, start=1)}


# Tiny models built here: a target, a second target (another seed) and a draft ---------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("confidence")
    tokenizer = build_tokenizer()
    return {"target": save_tiny(root / "target", "llama", tokenizer, init_std=0.15),
            "other": save_tiny(root / "other", "llama", tokenizer, init_std=0.15, seed=3),
            "draft": save_tiny(root / "draft", "llama", tokenizer, layers=1, seed=7, init_std=0.15),
            "qwen3": save_tiny(root / "qwen3", "qwen3", tokenizer, init_std=0.15)}


@pytest.fixture(scope="module")
def target(models):
    return load_target(models["target"])


BUDGETS = (40, 9, 25, 33, 17)


def run_requests(target, drafter, policy, budgets=BUDGETS, k=4):
    engine = Engine(target, drafter, num_draft_tokens=k, policy=policy, stream=False)
    texts = PROMPTS + ["x = 1\ny = 2\nx = 1\ny = 2\n"]
    prompts = target.encode(texts[: len(budgets)])
    states = engine.run([Request(p, b) for p, b in zip(prompts, budgets)])
    engine.stats.finalize()
    return [s.tokens for s in states], engine


# Greedy: token for token equal to plain decoding -------------------------------------------------------
@pytest.mark.parametrize("arch", ["target", "qwen3"])
def test_greedy_output_equals_plain_decoding_under_both_policies(arch, models):
    target = load_target(models[arch])
    reference, _ = run_requests(target, NoDraft(), None)
    drafters = {"draft-model": lambda: Confident(DraftModel(models["draft"])),
                "prompt-lookup": lambda: Confident(PromptLookup(max_ngram=3), salt=5)}
    policies = {"conf-min": lambda: ConfidenceThreshold(0.7),
                "scheduler": lambda: ConfidenceScheduler(table=flat_table(1.0, 1.05, 1.1, 1.15, 1.2)),
                "scheduler-profiled": lambda: ConfidenceScheduler()}
    for drafter_name, drafter in drafters.items():
        for policy_name, make in policies.items():
            recorder = Recorder(make())
            tokens, engine = run_requests(target, drafter(), recorder.policy)
            assert tokens == reference, f"{drafter_name} {policy_name}"
            stats = engine.stats
            # With this machine's profile, drafting may not pay at all, even at the prior acceptance:
            # the profiled scheduler then never drafts.
            assert stats.drafts_proposed > 0 or policy_name == "scheduler-profiled", \
                f"{drafter_name} {policy_name}: nothing verified"
            kept = [(offered, lengths) for offered, lengths, _ in recorder.cuts]
            assert all(0 <= n <= m for offered, lengths in kept for n, m in zip(lengths, offered))
            assert stats.drafts_cut == sum(m - n for offered, lengths in kept for n, m in zip(lengths, offered))
            # The block is narrowed to the longest row kept: what stats record is what was verified.
            assert all(width == max(lengths, default=0) for _, lengths, width in recorder.cuts)
            assert stats.k_sum == stats.drafts_proposed == sum(sum(lengths) for _, lengths in kept)
            if policy_name != "scheduler-profiled":  # the profile of this machine may keep every draft or none
                assert stats.drafts_cut > 0, f"{drafter_name} {policy_name}: the cut never cut"
                assert any(len(set(lengths)) > 1 for _, lengths in kept), "cuts should differ between rows"


def test_policy_texts_build_the_policies():
    assert isinstance(parse_policy("confidence"), ConfidenceScheduler)
    threshold = parse_policy("conf-min:0.25")
    assert isinstance(threshold, ConfidenceThreshold) and threshold.threshold == 0.25
    assert threshold.name == "conf-min:0.25"


# The cut: prefixes, chosen from drafter-only information ----------------------------------------------
def stub_engine(drafter=None, k: int = 4, rows: int = 8):
    config = SimpleNamespace(draft_schedule="constant", num_draft_tokens=k, k_limit=k)
    return SimpleNamespace(drafter=drafter or Confident(PromptLookup()), speculates=True, tree=None, static_tree=0,
                           config=config, max_batch_size=rows, target=None, profile_seconds=0.0)


def stub_group(rows: int):
    return SimpleNamespace(session=object(), size=rows)


def prepared(policy, k: int = 4, rows: int = 8):
    policy.prepare(stub_engine(k=k, rows=rows))
    return policy


def random_proposal(rows: int, k: int, seed: int) -> Proposal:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 300, (rows, k), generator=generator)
    lengths = torch.randint(0, k + 1, (rows,), generator=generator)
    pending = torch.randint(0, 300, (rows,), generator=generator)
    return Proposal(tokens, lengths, confidence=hashed_confidence(pending, tokens, seed))


def test_cut_lengths_are_prefixes_and_ignore_the_target(models):
    """Same drafts and confidences under two different targets: the same cut. Confidences past a
    row's cut (they read drafts that were not verified) never change it."""
    engines = [Engine(load_target(models[name]), Confident(PromptLookup()), num_draft_tokens=6,
                      policy=ConfidenceScheduler(table=flat_table(1.0, 1.0, 1.2, 1.25, 1.3, 1.35, 1.4)))
               for name in ("target", "other")]
    varied = 0
    for seed in range(20):
        proposal = random_proposal(6, 6, seed)
        group = stub_group(6)
        cuts = [engine.policy.cut(engine, group, proposal).lengths for engine in engines]
        assert torch.equal(cuts[0], cuts[1])
        lengths = cuts[0]
        assert bool((lengths <= proposal.lengths).all())
        varied += len(set(lengths.tolist())) > 1
        # Prefixes: the kept drafts of a row are its first lengths[r]; changing what lies past the
        # cut (draft lengths[r] and later, the confidences that read them) leaves the cut alone.
        generator = torch.Generator().manual_seed(100 + seed)
        tail = torch.arange(6)[None, :] > lengths[:, None]  # c[r, j] for j > lengths[r] reads an unverified draft
        confidence = torch.where(tail, torch.rand(6, 6, generator=generator), proposal.confidence)
        tokens = torch.where(tail, torch.randint(0, 300, (6, 6), generator=generator), proposal.tokens)
        again = engines[1].policy.cut(engines[1], group, dataclasses.replace(proposal, tokens=tokens,
                                                                             confidence=confidence))
        assert torch.equal(again.lengths, lengths)
    assert varied > 5, "cuts should differ between rows"

    threshold = ConfidenceThreshold(0.6)
    for seed in range(10):
        proposal = random_proposal(5, 6, seed)
        lengths = threshold.cut(None, stub_group(5), proposal).lengths
        for row in range(5):
            low = (proposal.confidence[row] < 0.6).nonzero()
            first = int(low[0]) if len(low) else 6
            assert int(lengths[row]) == min(first, int(proposal.lengths[row]))


def test_admission_follows_survival_and_stops_at_the_first_drop():
    confidence = torch.tensor([[0.9, 0.8, 0.7], [0.5, 0.9, 0.9], [1.0, 1.0, 0.2]])
    drafted = torch.tensor([3, 3, 2])
    cost = lambda *seconds: torch.tensor(seconds, dtype=torch.float64)  # noqa: E731
    assert admit_by_survival(confidence, drafted, cost(1, 1, 1, 1)).tolist() == [3, 3, 2]  # width is free
    assert admit_by_survival(confidence, drafted, cost(1, 2, 3, 4)).tolist() == [0, 0, 0]  # width never pays
    # Survivals 1, 1 (row 2), .9, .72 (row 0) pay; row 0's third (.504, a wider block) lowers the rate and
    # ends the search, before row 1's first (.5) is looked at.
    assert admit_by_survival(confidence, drafted, cost(1, 1.1, 1.2, 1.3)).tolist() == [2, 0, 2]
    assert admit_by_survival(confidence[:, :0], drafted * 0, cost(1)).tolist() == [0, 0, 0]


def test_admission_equals_the_search_that_takes_the_best_next_slot_of_any_row():
    """The sorted admission is the search the docstring describes: each round, every row's next draft is a
    candidate, the best survival (ties: lower position, then lower row) is taken while it raises the rate."""
    generator = torch.Generator().manual_seed(5)
    for trial in range(300):
        rows, k = int(torch.randint(1, 7, (1,), generator=generator)), int(torch.randint(1, 6, (1,), generator=generator))
        confidence = torch.rand(rows, k, generator=generator, dtype=torch.float64)
        if trial % 3 == 0:
            confidence = confidence.round(decimals=1)  # ties
        drafted = torch.randint(0, k + 1, (rows,), generator=generator)
        costs = (1.0 + torch.rand(k + 1, generator=generator, dtype=torch.float64).cumsum(0) * 0.2)
        survival = confidence.cumprod(1).tolist()
        kept, tokens, best = [0] * rows, float(rows), rows / float(costs[0])
        while True:
            candidates = [(-survival[r][kept[r]], kept[r], r) for r in range(rows) if kept[r] < int(drafted[r])]
            if not candidates:
                break
            value, j, r = min(candidates)
            longest = max([j + 1] + kept)
            rate = (tokens - value) / float(costs[longest])
            if not rate > best:
                break
            kept[r], tokens, best = kept[r] + 1, tokens - value, rate
        assert admit_by_survival(confidence, drafted, costs).tolist() == kept, trial


def test_scheduler_drafts_less_when_wide_blocks_are_dear():
    kept = {}
    for name, widths in (("cheap", (1.0, 1.0, 1.01, 1.02, 1.03)), ("middle", (1.0, 1.1, 1.2, 1.3, 1.4)),
                         ("dear", (1.0, 1.6, 2.2, 2.8, 3.4))):
        policy = prepared(ConfidenceScheduler(table=flat_table(*widths, sizes=(1, 2, 4, 8))))
        kept[name] = sum(int(policy.cut(None, stub_group(8), random_proposal(8, 4, seed)).lengths.sum())
                         for seed in range(10))
    assert kept["cheap"] > kept["middle"] > kept["dear"]
    # Verification that costs the same for any width keeps every draft with a chance.
    policy = prepared(ConfidenceScheduler(table=flat_table(1.0, 1.0, 1.0, 1.0, 1.0, sizes=(1, 2, 4, 8))))
    proposal = random_proposal(8, 4, 0)
    assert torch.equal(policy.cut(None, stub_group(8), proposal).lengths, proposal.lengths)


def test_scheduler_stops_drafting_after_empty_cuts_and_probes_again():
    """A close call (a draft would cost 20% more verification; the target's acceptance, as assumed before
    any outcome, might pay for it) is probed, less and less often while it loses."""
    policy = prepared(ConfidenceScheduler(table=flat_table(1.0, 1.2, 1.4, 1.6, 1.8, sizes=(1, 2, 4, 8)),
                                          patience=3, explore=4))
    group, choices = stub_group(4), []
    hopeless = lambda k: Proposal(torch.randint(0, 300, (4, k)), torch.full((4,), k),  # noqa: E731
                                  confidence=torch.zeros(4, k))
    for step in range(40):
        k = policy.draft_tokens(None, group)
        choices.append(k)
        if k:
            assert not bool(policy.cut(None, group, hopeless(k)).lengths.any())
    # Three empty cuts, then plain steps with a probe after 4 of them; each losing probe doubles the wait.
    probes = [step for step, k in enumerate(choices) if k]
    assert probes == [0, 1, 2, 7, 16, 33], choices
    # A probe that wins (confident drafts, verification that costs nothing more) restores the first wait.
    policy.table = flat_table(1.0, 1.0, 1.0, 1.0, 1.0, sizes=(1, 2, 4, 8))
    while not policy.draft_tokens(None, group):
        pass
    policy.cut(None, group, Proposal(torch.randint(0, 300, (4, 4)), torch.full((4,), 4),
                                     confidence=torch.full((4, 4), 0.95)))
    assert (policy.losing, policy.wait) == (0, 4)


def test_scheduler_does_not_draft_a_clear_loss_until_the_load_falls():
    """Under load a draft costs as much as a plain step (5x the verification here, at 2 rows and more):
    no drafting step at all, not the first ones and no probe; one row, where width is free, drafts."""
    def table(cost):
        return {(rows, width): rows * (1.0 if rows == 1 else cost(width)) for rows in (1, 2, 4, 8)
                for width in range(1, 6)}

    policy = prepared(ConfidenceScheduler(table=table(lambda w: 4.0 * w - 3.0), patience=3, explore=4))
    group, alone = stub_group(8), stub_group(1)
    assert not any(policy.draft_tokens(None, group) for _ in range(300))
    assert max(policy.draft_tokens(None, alone) for _ in range(8)) == 4

    # A close call at 8 rows (a draft doubles the verification): drafting is tried at the acceptance
    # assumed before any outcome, but not once the target granted a third of the first drafts at one row.
    close = table(float)
    assert prepared(ConfidenceScheduler(table=close, patience=3, explore=4)).draft_tokens(None, group) == 4
    policy = prepared(ConfidenceScheduler(table=close, patience=3, explore=4))
    for step in range(12):
        k = policy.draft_tokens(None, alone)
        assert k == 4
        lengths = policy.cut(None, alone, Proposal(torch.randint(0, 300, (1, k)), torch.full((1,), k),
                                                   confidence=torch.full((1, k), 0.9))).lengths
        policy.observe(None, alone, int(lengths.max()), lengths.tolist(), [int(step % 3 == 0)],
                       {"draft": 0.0, "step": 1.0})
    assert policy.losing == 0 and policy.draft_tokens(None, group) == 0


def test_scheduler_stops_drafting_when_drafting_costs_more_than_the_kept_drafts_gain():
    """Cuts that keep drafts (verification is cheap) but whose drafting, spent before the cut, makes the
    step slower than a plain one count as losing steps too; confident drafts keep it drafting."""
    table = flat_table(1.0, 1.0, 1.0, 1.0, 1.0, sizes=(1, 2, 4, 8))
    for confident, drafting in ((0.05, 2.0), (0.95, 0.1)):
        policy = prepared(ConfidenceScheduler(table=table, patience=2, explore=100))
        group, choices = stub_group(4), []
        for step in range(6):
            k = policy.draft_tokens(None, group)
            choices.append(k)
            if k:
                policy.draft_cost[bucket(4)] = {k: [drafting, 1]}  # seconds of the step's drafting, as observed online
                proposal = Proposal(torch.randint(0, 300, (4, k)), torch.full((4,), k),
                                    confidence=torch.full((4, k), confident))
                assert bool(policy.cut(None, group, proposal).lengths.any())  # verifying them pays once drafted
        assert choices == ([4, 4, 0, 0, 0, 0] if confident < 0.5 else [4] * 6), (confident, choices)


def test_scheduler_corrects_confidences_that_promise_more_than_the_target_grants():
    """A confidence head that says 0.9 where the target accepts nothing (another domain, another
    temperature): after a few observed steps the scheduler's survivals fall to what it saw, its cuts
    empty and it stops drafting. The same confidences, borne out, keep it drafting."""
    table = flat_table(1.0, 1.05, 1.1, 1.15, 1.2, sizes=(1, 2, 4, 8))
    for granted in (0, 4):
        policy = prepared(ConfidenceScheduler(table=table, patience=2, explore=100))
        group, choices, kept = stub_group(4), [], []
        for step in range(24):
            k = policy.draft_tokens(None, group)
            choices.append(k)
            if not k:
                policy.observe(None, group, 0, None, None, {"draft": 0.0, "step": 4.0})
                continue
            proposal = Proposal(torch.randint(0, 300, (4, k)), torch.full((4,), k),
                                confidence=torch.full((4, k), 0.9))
            lengths = policy.cut(None, group, proposal).lengths
            kept.append(int(lengths.sum()))
            width = int(lengths.max())
            policy.observe(None, group, width, lengths.tolist(), lengths.clamp(max=granted).tolist(),
                           {"draft": 0.0, "step": 4.0 * table[1, width + 1]})
        assert kept[0] == 16  # before any outcome the drafter's word is taken: 0.9, .81, .73, .66 pay
        if granted:
            assert choices == [4] * 24 and min(kept) == 16, (choices, kept)
            assert float(policy.correction(4).min()) > 0.99
        else:
            assert kept[-1] == 0 and choices[-8:] == [0] * 8, (choices, kept)
            assert float(policy.correction(1)[0]) < 0.5


# Sampling: the output follows the target's own distribution --------------------------------------------
def cut_chain(draft: torch.Tensor, cut, rows: int = 4, batches: int = 10000, seed: int = 0):
    """Batches of ``rows`` rows, each drafting 2 tokens from ``draft`` [2, V] and verified against TARGET
    after ``cut`` (drafts [n, 2], confidence [n, 2] -> lengths [n])."""
    generator = torch.Generator().manual_seed(seed)
    n = rows * batches
    tokens = torch.stack([torch.multinomial(draft[j], n, replacement=True, generator=generator) for j in range(2)], 1)
    # c[r, 0]: the drafter's own guess before drafting (random here); c[r, 1] reads draft 0.
    first = 0.3 + 0.7 * torch.rand(n, generator=generator)
    confidence = torch.stack([first, torch.where(tokens[:, 0] <= 2, 0.95, 0.35)], 1)
    lengths = cut(tokens, confidence)
    accepted, nxt = verify_sampling(TARGET.expand(n, -1, -1), tokens, lengths, draft.expand(n, -1, -1), generator)
    emitted = torch.cat([tokens, nxt[:, None]], dim=1)
    emitted.scatter_(1, accepted[:, None], nxt[:, None])
    return lengths, accepted, emitted


def scheduler_cut(rows: int, costs):
    def cut(tokens, confidence):
        drafted = torch.full((rows,), 2)
        return torch.cat([admit_by_survival(c, drafted, costs) for c in confidence.split(rows)])
    return cut


@pytest.mark.parametrize("case", ["uniform", "skewed", "disjoint-second"])
def test_cut_chains_follow_the_target_at_each_position(case):
    draft = draft_cases()[case]
    cut = scheduler_cut(4, torch.tensor([1.0, 1.15, 1.3], dtype=torch.float64))
    lengths, accepted, emitted = cut_chain(draft, cut)
    assert set(lengths.tolist()) == {0, 1, 2}, "the cut should vary"
    assert chi_square_p(emitted[:, 0], TARGET[0]) > P_VALUE
    assert chi_square_p(emitted[accepted >= 1, 1], TARGET[1]) > P_VALUE


def test_a_cut_that_reads_the_draft_itself_is_caught():
    """Keeping draft 0 only when it is a token the draft under-weights biases the output: the check has power."""
    draft = draft_cases()["skewed"]
    likes = TARGET[0] > draft[0]

    def peeking(tokens, confidence):
        return torch.where(likes[tokens[:, 0]], 2, 0)
    _, _, emitted = cut_chain(draft, peeking)
    assert chi_square_p(emitted[:, 0], TARGET[0]) < 1e-6


@pytest.mark.parametrize("policy", ["confidence", "conf-min:0.6"])
def test_generate_samples_the_target_under_the_confidence_policies(policy, models, target):
    """The first token a speculative step samples (the second of the output: the first comes from the
    prefill), jointly with the first, follows the warped target."""
    target.eos_token_ids = ()
    prompt = target.encode(["x = x + 1\nx = x"])[0]
    config = SamplingConfig(1.0, 6, None)
    exact = exact_two_token_distribution(hf.load_causal_lm(models["target"]), prompt, config)
    drafter = Confident(DraftModel(models["draft"]))  # another model: drafts are rejected too (the residual)
    samples, verified, cut, accepted = [], 0, 0, 0
    for seed in range(3):
        # Two flat widths, then dear ones: rows whose confidence beats the best second draft keep one.
        made = (ConfidenceScheduler(table=flat_table(1.0, 1.0, 3.0, 3.0)) if policy == "confidence"
                else parse_policy(policy))
        generation = GenerationConfig(num_draft_tokens=3, max_new_tokens=4, sampling=config, seed=seed)
        out = generate_ids(target, [prompt] * 1500, drafter, generation, made)
        samples += [a * target.vocab_size + b for a, b, *_ in out.token_ids]
        verified, cut = verified + out.stats.drafts_proposed, cut + out.stats.drafts_cut
        accepted += out.stats.drafts_accepted
    assert verified > accepted > 0 and cut > 0
    assert chi_square_p(torch.tensor(samples), exact) > P_VALUE


# Refusals: one line ----------------------------------------------------------------------------------
def test_refusals_are_one_line(target):
    for policy in ("confidence", "conf-min:0.5"):
        with pytest.raises(InvalidArgumentError) as error:
            Engine(target, PromptLookup(), num_draft_tokens=4, policy=parse_policy(policy))
        assert str(error.value) == f"policy {policy} needs a drafter with a confidence head (dspark), got prompt-lookup"
        with pytest.raises(InvalidArgumentError, match="not token trees"):
            Engine(target, Confident(PromptLookup()), tree=specdec.TreeConfig(2, 2, 3), policy=parse_policy(policy))
    for text in ("conf-min:1.5", "conf-min:0", "conf-min:high", "confidence:2"):
        with pytest.raises(InvalidArgumentError) as error:
            parse_policy(text)
        assert "\n" not in str(error.value)

    class Silent(Confident):
        """Claims a confidence head, proposes without confidences."""

        def start(self, context, seqs):
            return self.inner.start(context, seqs)
    engine = Engine(target, Silent(PromptLookup()), num_draft_tokens=4, policy=ConfidenceThreshold(0.5))
    with pytest.raises(InvalidArgumentError, match="without confidences"):
        engine.run([Request(target.encode(["x = 1\nx = 1\n"])[0], 8)])


@pytest.mark.parametrize("modes,message", [
    (["plain", "dspark@conf-min:1.5"], "conf-min:X needs 0 < X < 1"),
    (["dspark@sometimes"], "a policy is"),
    (["dflash@plain"], "plain"),
    (["nosuch@fixed"], "nosuch"),
])
def test_bench_serve_refuses_bad_modes_in_one_line(modes, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench-serve", "--modes", *modes, "--concurrency", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


# specdec bench --policies and bench-serve's per-mode drafters ------------------------------------------
def test_bench_runs_each_chain_drafter_once_more_per_policy(models, target):
    from specdec.commands.bench import format_table, run_bench

    target.eos_token_ids = ()
    prompts = target.encode(["x = x + 1\nx = x + 1\n", "def f(a):\n    return a\n"])
    confident = Confident(DraftModel(models["draft"]))
    result = run_bench(target, prompts, draft=DraftModel(models["draft"]), ks=[2, 3], max_new_tokens=10,
                       progress=False, with_transformers=False, drafters=(("draft-model", confident),),
                       policies=("static:1=2", "conf-min:0.6"))
    assert result["outputs_identical"], result["mismatches"]
    rows = {row["method"]: row for row in result["rows"]}
    for label in ("specdec draft-model k=3 static:1=2", "specdec prompt-lookup k=3 static:1=2"):
        assert rows[label]["policy"] == "static:1=2"
    # The threshold drives only the drafter with confidences; fixed-k rows stay beside it.
    assert [row["method"] for row in result["rows"] if row["policy"] == "conf-min:0.6"] == [
        "specdec draft-model k=3 conf-min:0.6"]
    assert rows["specdec draft-model k=2"]["policy"] is None
    assert "conf-min:0.6" in format_table(result)
    with pytest.raises(InvalidArgumentError, match="policy confidence can drive none"):
        run_bench(target, prompts, ks=[2], max_new_tokens=4, progress=False, with_transformers=False,
                  policies=("confidence",))


def test_bench_serve_modes_name_their_drafters():
    from specdec.serve.bench import Mode, parse_mode, resolve_mode

    assert parse_mode("plain") == Mode("plain", "none")
    assert parse_mode("conf-min:0.5") == Mode("conf-min:0.5", None, None, "conf-min:0.5")
    assert parse_mode("DSPARK=/some/where/dspark-4b@confidence") == Mode("dspark=dspark-4b@confidence", "dspark",
                                                                         "/some/where/dspark-4b", "confidence")
    args = SimpleNamespace(drafter="dspark", draft="/d/dspark")
    assert resolve_mode(parse_mode("confidence"), args, False).folder == "/d/dspark"
    assert resolve_mode(parse_mode("dspark@fixed"), args, False).folder == "/d/dspark"
    zoo = resolve_mode(parse_mode("dflash@fixed"), args, True)
    assert zoo.drafter == "dflash" and zoo.folder.endswith("dflash")
    with pytest.raises(InvalidArgumentError, match="dflash=DIR@fixed"):
        resolve_mode(parse_mode("dflash@fixed"), args, False)
    with pytest.raises(InvalidArgumentError, match="as --drafter"):
        resolve_mode(parse_mode("mtp@fixed"), args, True)


def test_bench_serve_compares_drafters_in_one_run(tmp_path):
    output = tmp_path / "serve.json"
    code = main(["bench-serve", "--in-process", "--modes", "plain", "prompt-lookup@fixed", "static:1=2",
                 "--concurrency", "1", "--requests-per-client", "1", "--max-tokens", "4", "--output", str(output)])
    assert code == 0
    modes = json.loads(output.read_text())["modes"]
    assert list(modes) == ["plain", "prompt-lookup@fixed", "static:1=2"]
    assert [(m["drafter"], m["policy"]) for m in modes.values()] == [
        ("none", None), ("prompt-lookup", "fixed"), ("draft-model", "static:1=2")]
    assert all(w["errors"] == 0 for m in modes.values() for w in m["waves"])
