"""DraftModel takes a directory, a transformers model or a Target (self-draft), and refuses anything else."""

from __future__ import annotations

import pytest

import specdec
from specdec.drafters import DraftModel
from specdec.errors import InvalidArgumentError
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
