"""Stats say whether the target's numerics are exact; an inexact target with a drafter warns once."""

from __future__ import annotations

import warnings

import torch

import specdec
from specdec.drafters import DraftModel, NoDraft, PromptLookup
from specdec.errors import NumericsWarning
from specdec.backends.target import load_target


def numerics_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, NumericsWarning)]


def test_exact_numerics_in_stats(model_dirs):
    for dtype, exact in ((torch.float32, True), (torch.bfloat16, False)):
        target = load_target(model_dirs["llama"], dtype=dtype, backend="hf")
        assert target.backend.exact_numerics is exact
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumericsWarning)
            stats = specdec.generate(target, "x = 1", drafter=PromptLookup(), max_new_tokens=4).stats
        assert stats.exact_numerics is exact and stats.as_dict()["exact_numerics"] is exact
        assert ("(exact numerics)" if exact else "(inexact numerics)") in stats.summary()


def test_warning_once_per_inexact_target_with_a_drafter(model_dirs):
    bf16 = load_target(model_dirs["llama"], dtype=torch.bfloat16, backend="hf")
    assert not numerics_warnings(lambda: specdec.generate(bf16, "x = 1", drafter=NoDraft(), max_new_tokens=4))
    (message,) = numerics_warnings(lambda: specdec.generate(bf16, "x = 1", drafter=PromptLookup(),
                                                            max_new_tokens=4))
    assert "may differ from plain decoding in bfloat16" in message and "float32" in message
    assert "\n" not in message
    again = numerics_warnings(lambda: specdec.generate(bf16, "x = 1", drafter=DraftModel(bf16), max_new_tokens=4))
    assert not again  # once per target object


def test_no_warning_on_float32_whatever_the_draft(model_dirs):
    """Only the target's numerics decide the output: a bfloat16 draft model does not make it inexact."""
    target = load_target(model_dirs["llama"], backend="hf")
    draft = DraftModel(model_dirs["llama-draft"], dtype=torch.bfloat16, backend="hf")
    outputs = []
    assert not numerics_warnings(lambda: outputs.append(
        specdec.generate(target, "x = 1", drafter=draft, num_draft_tokens=3, max_new_tokens=6)))
    assert outputs[0].stats.exact_numerics
