"""DraftModel takes a directory, a transformers model or a Target (self-draft), and refuses anything else."""

from __future__ import annotations

import pytest

import specdec
from specdec.drafters import DraftModel
from specdec.errors import InvalidArgumentError, SpecdecError
from specdec.backends.target import load_target


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_target_drafts_for_itself(model_dirs, backend):
    target = load_target(model_dirs["llama"], backend=backend)
    target.eos_token_ids = ()
    draft = DraftModel(target)
    assert draft.backend is target.backend and draft.path == target.path
    plain = specdec.generate(target, "def f(x):", max_new_tokens=12)
    out = specdec.generate(target, "def f(x):", drafter=draft, num_draft_tokens=3, max_new_tokens=12)
    assert out.token_ids == plain.token_ids
    assert out.stats.alpha == 1.0  # the same numerics propose what the target verifies


def test_wrong_draft_model_types_are_one_line_errors(model_dirs):
    native = load_target(model_dirs["llama"], backend="native")
    with pytest.raises(InvalidArgumentError, match="pass the Target itself"):
        DraftModel(native.model)  # None on the native backend
    with pytest.raises(InvalidArgumentError, match="got int"):
        DraftModel(42)


def test_p_min_cuts_the_draft_models_chains_and_keeps_the_output(model_dirs):
    """llama.cpp's --draft-p-min on a draft model: a row stops before its first draft the draft model gives
    its top token less than p_min, each row on its own; greedy output stays plain decoding's (a ragged
    batch with rows ending at EOS and at the limit, and alone) and sampling keeps the target's distribution."""
    from specdec.sampling import SamplingConfig
    from test_exact_generation import assert_equal_to, bfloat16_with_eos, sampled_pairs, sampling_case
    from test_sampling import P_VALUE, chi_square_p

    target, prompts, reference = bfloat16_with_eos(model_dirs["llama"])
    counts = []
    for p_min in (None, 0.05, 0.2, 0.5, 0.95):
        drafter = DraftModel(model_dirs["llama-draft"], dtype="bfloat16", p_min=p_min)
        assert_equal_to(target, prompts, reference, [(drafter, dict(num_draft_tokens=4))], 40)
        stats = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=40).stats
        counts.append(stats.drafts_proposed / stats.target_forwards)
    assert counts == sorted(counts, reverse=True) and any(0 < c < counts[0] for c in counts), counts
    config = SamplingConfig(1.0, 6, None)
    target, prompt, exact = sampling_case(model_dirs["llama"], config)
    drafter = DraftModel(model_dirs["llama-draft"], dtype="bfloat16", p_min=0.3)
    assert chi_square_p(sampled_pairs(target, prompt, drafter, config), exact) > P_VALUE


class Guesser:
    """A staged drafter for tests: ``guess(row tokens, k)`` -> that row's guesses (any length)."""

    name = "guesser"

    def __init__(self, guess):
        self.guess = guess

    def start(self, context, seqs):
        return self

    def propose(self, seqs, k):
        import torch

        from specdec.drafters.base import Proposal

        rows = [self.guess(seqs.row(b), k)[:k] for b in range(seqs.batch_size)]
        tokens = torch.zeros(seqs.batch_size, k, dtype=torch.long)
        for b, row in enumerate(rows):
            tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        return Proposal(tokens, torch.tensor([len(row) for row in rows]))


def counted_passes(monkeypatch, model):
    """A list that grows by one for each forward pass of native ``model``'s caches."""
    from specdec.backends.native import NativeCache

    passes, forward = [], NativeCache.forward

    def counted(cache, *args, **kwargs):
        if cache.model is model:
            passes.append(1)
        return forward(cache, *args, **kwargs)

    monkeypatch.setattr(NativeCache, "forward", counted)
    return passes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_staged_draft_model_drafts_its_own_tokens_in_fewer_passes(model_dirs, dtype, monkeypatch):
    """staged=: a drafter without a model guesses for the draft model, which checks its guesses a pass at a
    time and keeps those its own argmax agrees with. The drafts are the ones it drafts one token a pass
    (every step alike: the same stats), so the output is plain decoding's, in a ragged batch, with wrong
    guesses of every length, with p_min cuts and at temperature > 0 (where it drafts one token a pass)."""
    import random

    import torch

    from specdec.drafters.prompt_lookup import PromptLookup

    target = load_target(model_dirs["llama"], backend="native", dtype=dtype)
    copy = load_target(model_dirs["llama"], backend="native", dtype=dtype, quantize="q8_0")
    copy.eos_token_ids = ()
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61, 62, 60], [3] * 12, [8, 9]]
    plain = specdec.generate(target, prompts, max_new_tokens=24).token_ids
    chance = random.Random(0)
    guessers = {"prompt lookup": PromptLookup(),
                "wrong guesses": Guesser(lambda row, k: [chance.randrange(90) for _ in range(chance.randrange(k + 1))]),
                "the copy's own": None}
    for p_min in (None, 0.3):
        alone = DraftModel(model_dirs["llama"], dtype=getattr(torch, dtype), quantize="q8_0", p_min=p_min, staged="none")
        passes = counted_passes(monkeypatch, alone.backend.model)
        reference = specdec.generate(target, prompts, drafter=alone, num_draft_tokens=6, max_new_tokens=24)
        assert reference.token_ids == plain
        one_token_passes = len(passes)
        for label, guesser in guessers.items():
            if guesser is None:  # what the copy decodes alone (it drafts from the target's keys of the prompt)
                guesser = Guesser(lambda row, k: greedy_continuation(copy, row, k))
            staged = DraftModel(model_dirs["llama"], dtype=getattr(torch, dtype), quantize="q8_0", p_min=p_min, staged=guesser,
                                staged_guesses=3)
            passes = counted_passes(monkeypatch, staged.backend.model)
            out = specdec.generate(target, prompts, drafter=staged, num_draft_tokens=6, max_new_tokens=24)
            assert out.token_ids == plain, label
            assert step_counts(out.stats) == step_counts(reference.stats), label
            if label == "the copy's own" and p_min is None:  # (the cut at 0.3 leaves few drafts to draft)
                assert len(passes) < one_token_passes, label
    sampled = [DraftModel(model_dirs["llama"], dtype=getattr(torch, dtype), quantize="q8_0", staged=staged) for staged in
               ("none", "prompt-lookup")]
    draws = [specdec.generate(target, prompts, drafter=d, num_draft_tokens=4, max_new_tokens=16, temperature=0.8,
                              seed=3).token_ids for d in sampled]
    assert draws[0] == draws[1]


def step_counts(stats) -> tuple:
    """What a generation's drafts decided, step by step: equal for the same drafts."""
    return stats.target_forwards, stats.proposed_at, stats.accepted_at, stats.accepted_histogram


def greedy_continuation(copy, row: list[int], k: int) -> list[int]:
    """``copy``'s (a Target) plain greedy decoding after ``row``, k tokens."""
    return specdec.generate(copy, [row], max_new_tokens=k).token_ids[0]


def test_staged_settings_come_from_the_folder_record_and_bad_ones_are_one_line(model_dirs, tmp_path, capsys):
    """staged=None takes the folder's record (``bench --record``: specdec.defaults.staged and staged_guesses);
    "none" turns it off; unknown names, guesses below 1 and --draft-staged without a draft model are one line."""
    import json
    import shutil

    from specdec.commands.cli import main
    from specdec.drafters.prompt_lookup import PromptLookup

    folder = tmp_path / "draft"
    shutil.copytree(model_dirs["llama-draft"], folder)
    assert DraftModel(folder).staged is None
    config = json.loads((folder / "config.json").read_text())
    config["specdec"] = {"defaults": {"num_draft_tokens": 8, "tree": None, "staged": "prompt-lookup",
                                      "staged_guesses": 3}}
    (folder / "config.json").write_text(json.dumps(config))
    recorded = DraftModel(folder)
    assert isinstance(recorded.staged, PromptLookup) and recorded.staged_guesses == 3
    assert recorded.default_draft_tokens == 8 and recorded.setting == "staged prompt-lookup G=3"
    assert DraftModel(folder, staged_guesses=5).staged_guesses == 5
    assert DraftModel(folder, staged="none").staged is None
    for bad, words in (({"staged": "medusa"}, "prompt-lookup"), ({"staged": 3}, "got int"),
                       ({"staged": "prompt-lookup", "staged_guesses": 0}, ">= 1"),
                       ({"staged": "retrieval"}, "record a datastore")):
        with pytest.raises(InvalidArgumentError, match=words) as error:
            DraftModel(folder, **bad)
        assert "\n" not in str(error.value)
    # retrieval recorded with its datastore (bench --record's staged_datastore): by name, or from the record
    from specdec.drafters.retrieval import Retrieval, build_datastore
    store = build_datastore([[5, 17, 33, 2, 9, 41], [60, 61, 62]], tmp_path / "store", vocab_size=90)
    config["specdec"]["defaults"].update(staged="retrieval", staged_datastore=str(store))
    (folder / "config.json").write_text(json.dumps(config))
    for drafter in (DraftModel(folder), DraftModel(folder, staged="retrieval")):
        assert isinstance(drafter.staged, Retrieval) and drafter.staged.store.folder == store
        assert drafter.setting == "staged retrieval G=3"
    # a recorded datastore that cannot be had: the record's guesser gives way to prompt lookup (the same drafts),
    # with one line on stderr; asked for by name, it is an error
    config["specdec"]["defaults"]["staged_datastore"] = str(tmp_path / "gone")
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert isinstance(DraftModel(folder).staged, PromptLookup)
    warning = capsys.readouterr().err.strip()
    assert "retrieval, is unavailable" in warning and "\n" not in warning
    with pytest.raises(SpecdecError):
        DraftModel(folder, staged="retrieval")
    base = ["generate", "--target", str(model_dirs["llama"]), "--prompt", "a", "--max-new-tokens", "2"]
    for extra, words in ((["--drafter", "prompt-lookup", "--draft-staged", "prompt-lookup"], "speed up a draft model"),
                         (["--drafter", "draft-model", "--draft", str(folder), "--draft-staged", "retrieval"],
                          "retrieval=DIR"),
                         (["--drafter", "draft-model", "--draft", str(folder), "--draft-staged", "eagle"],
                          "takes none, prompt-lookup or retrieval")):
        capsys.readouterr()
        assert main(base + extra) == 2, extra
        error = capsys.readouterr().err.strip()
        assert words in error and "\n" not in error, error


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_staged_draft_model_on_either_backend_drafts_what_it_drafts_alone(model_dirs, backend):
    """Another model as the draft (not a copy), on specdec's kernels or in transformers: guesses of any length,
    right or wrong, leave its drafts and the output as they are."""
    import random

    target = load_target(model_dirs["llama"], backend="native")
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61, 62, 60], [8, 9]]
    plain = specdec.generate(target, prompts, max_new_tokens=20).token_ids
    alone = specdec.generate(target, prompts, drafter=DraftModel(model_dirs["llama-draft"], backend=backend),
                             num_draft_tokens=5, max_new_tokens=20)
    chance = random.Random(1)
    for staged in ("prompt-lookup", Guesser(lambda row, k: [chance.randrange(90) for _ in range(chance.randrange(k + 1))])):
        drafter = DraftModel(model_dirs["llama-draft"], backend=backend, staged=staged, staged_guesses=2)
        out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=5, max_new_tokens=20)
        assert out.token_ids == plain and step_counts(out.stats) == step_counts(alone.stats)
