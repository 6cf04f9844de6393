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
