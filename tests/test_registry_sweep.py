"""Every causal-LM type transformers knows, built tiny: specdec matches greedy generate or refuses in one line.

One sweep over the whole registry (about a minute and a half on one CPU thread) feeds every test here;
``python -m specdec.commands.sweep`` prints the same table. Failures list the offending types with their reasons.
"""

from __future__ import annotations

import re

import pytest
import torch

from specdec.commands import sweep

# On transformers 5.24, 91 of 196 types passed before the model-support fixes and 141 after them
# (commit a471328); the margin allows some types to move from "pass" to "refused".
MIN_PASSING = 130


@pytest.fixture(scope="module")
def results():
    torch.set_num_threads(1)
    return {record["model_type"]: record for record in sweep.sweep(progress=None)}


def listing(records, details: int = 3) -> str:
    """One line per type, then up to ``details`` of its other failing cases."""
    lines = []
    for record in records:
        lines.append(f"  {record['model_type']} [{record['status']}]: {record['reason']}")
        others = [d for d in record["details"] if record["reason"] not in d]
        lines.extend(f"      {detail}" for detail in others[:details])
        if len(others) > details:
            lines.append(f"      ... and {len(others) - details} more")
    return "\n".join(lines)


def with_status(results, status):
    return [record for record in results.values() if record["status"] == status]


def names_type(message: str, model_type: str) -> bool:
    """The message names the type or a class named after it ('gemma3_text' matches 'Gemma3TextConfig';
    a text-only type may go by its model's name: 'inkling2_text' matches 'Inkling2ForCausalLM')."""
    def squash(text):
        return re.sub(r"[^a-z0-9]", "", text.lower())
    names = {model_type, re.sub(r"[-_]text$", "", model_type)}
    return any(squash(name) in squash(message) for name in names)


def test_every_registered_type_is_classified(results):
    assert sorted(results) == sweep.causal_lm_types()
    assert {record["status"] for record in results.values()} <= set(sweep.CLASSES)


def test_no_type_gives_output_that_differs_from_transformers(results):
    bad = with_status(results, "mismatch")
    if bad:
        pytest.fail(f"{len(bad)} types differ from transformers' greedy output:\n{listing(bad)}", pytrace=False)


def test_no_type_crashes(results):
    bad = with_status(results, "crash")
    if bad:
        pytest.fail(f"{len(bad)} types crash instead of generating or refusing:\n{listing(bad)}", pytrace=False)


def test_refusals_are_one_line_and_name_the_model_type(results):
    refused = with_status(results, "refused")
    multi_line = [r for r in refused if "\n" in r["message"].strip() or not r["message"].strip()]
    if multi_line:
        pytest.fail(f"refusals must be one non-empty line:\n{listing(multi_line)}", pytrace=False)
    unnamed = [r for r in refused if not names_type(r["message"], r["model_type"])]
    if unnamed:
        pytest.fail(f"{len(unnamed)} refusals do not name the model type:\n{listing(unnamed, details=0)}",
                    pytrace=False)


def test_most_types_pass(results):
    passing = with_status(results, "pass")
    if len(passing) < MIN_PASSING:
        pytest.fail(f"only {len(passing)} types pass (expected >= {MIN_PASSING}):\n"
                    + listing([r for r in results.values() if r["status"] != "pass"], details=0), pytrace=False)


def test_the_variability_check_is_live(results):
    # Every compared model produced varied greedy output...
    compared = [r for r in results.values() if r["status"] in ("pass", "mismatch")]
    assert all(r["distinct"] >= sweep.MIN_DISTINCT for r in compared), listing(
        [r for r in compared if r["distinct"] < sweep.MIN_DISTINCT])
    # ...because the check rejected degenerate first builds (tied embeddings repeat the input token)...
    rebuilt = [r for r in results.values() if r["attempts"] and r["attempts"][0]["distinct"] < sweep.MIN_DISTINCT]
    assert rebuilt, "no first build was degenerate: the variability check never fired"
    assert any(len(r["attempts"]) > 1 and r["status"] != "unbuildable" for r in rebuilt)
    # ...and it refuses models that stay degenerate.
    with pytest.raises(sweep.Unbuildable, match="degenerate"):
        sweep.check_variety([[5] * 24, [5, 6] * 12, [7] * 24])


def test_tiny_configs_keep_their_layer_patterns():
    from specdec.commands.tiny import build_tokenizer
    tokenizer = build_tokenizer()

    def tiny(model_type):
        return sweep.tiny_config(model_type, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)

    gemma = tiny("gemma3_text")
    assert gemma.num_hidden_layers == len(gemma.layer_types) <= sweep.MAX_LAYERS
    assert {"sliding_attention", "full_attention"} <= set(gemma.layer_types)
    assert gemma.sliding_window <= 16 and gemma.hidden_size <= 64 and gemma.vocab_size == len(tokenizer)
    hybrid = tiny("qwen3_next")
    assert {"linear_attention", "full_attention"} <= set(hybrid.layer_types)
    assert hybrid.num_experts <= sweep.EXPERTS
    deepseek = tiny("deepseek_v3")
    assert deepseek.first_k_dense_replace == 1 < deepseek.num_hidden_layers  # a dense layer and a MoE layer
    assert tiny("recurrent_gemma").num_hidden_layers == 3  # one cycle of (recurrent, recurrent, attention)
    with pytest.raises(sweep.Unbuildable):
        sweep.tiny_config("not-a-model-type", 320, 0, 1)
