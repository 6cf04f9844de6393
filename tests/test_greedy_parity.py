"""Lossless means token-for-token: every drafter's greedy output equals transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec.drafters import DraftModel, NoDraft, PromptLookup
from specdec.commands.tiny import ARCHITECTURES

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "import torch",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n",
    "x = x + 1\nx = x + 1\nx = x + 1\n",
    "for row in rows:\n    print(row)\n",
]
MAX_NEW = 40


def hf_greedy(model, prompt, max_new_tokens, eos=None):
    """transformers' greedy generate; eos None means no stop token at all."""
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def stop_token_for(model, prompts):
    """A token plain decoding emits mid-way for one prompt but never for another: EOS ends some rows only."""
    plain = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    for token in plain[0][3:] + [t for row in plain[1:] for t in row[3:]]:
        if any(token not in row for row in plain):
            return token
    raise AssertionError("every continuation uses the same tokens; pick other prompts")


def reference_with_stop(target, model, prompts):
    """transformers' greedy outputs with a stop token that ends some rows only; sets it as the target's EOS."""
    eos = stop_token_for(model, prompts)
    target.eos_token_ids = (eos,)
    return eos, [hf_greedy(model, p, MAX_NEW, eos) for p in prompts]


def drafters_for(arch, backend, model_dirs):
    drafters = [NoDraft(), PromptLookup(max_ngram=3), DraftModel(model_dirs[f"{arch}-draft"], backend=backend),
                DraftModel(model_dirs[arch], backend=backend)]  # the target as its own draft: all accepted
    if arch == "llama":
        drafters.append(DraftModel(model_dirs["gpt2-draft"], backend=backend))  # another architecture, same tokenizer
    return drafters


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_drafter_matches_transformers_greedy(arch, targets, hf_models, model_dirs, backend):
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    eos, reference = reference_with_stop(target, model, prompts)
    assert any(r and r[-1] == eos for r in reference), "some row should stop at EOS"
    assert any(len(r) == MAX_NEW for r in reference), "some row should run to the limit"
    for drafter in drafters_for(arch, backend, model_dirs):
        for k in (1, 4, 8):
            out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=k, max_new_tokens=MAX_NEW)
            assert out.token_ids == reference, f"{drafter.name} k={k} batch of {len(prompts)}"
            for i in (0, 2):
                alone = specdec.generate(target, [prompts[i]], drafter=drafter, num_draft_tokens=k,
                                         max_new_tokens=MAX_NEW)
                assert alone.token_ids == [reference[i]], f"{drafter.name} k={k} prompt {i} alone"


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3"])
def test_generation_up_to_the_context_limit(arch, targets, hf_models, model_dirs, backend):
    target = targets[arch]
    window = target.max_positions
    base = target.encode(PROMPTS)
    long_prompt = (base[0] * window)[: window - 24]
    short_prompt = base[3]
    target.eos_token_ids = ()
    reference = [hf_greedy(hf_models[arch], p, 24) for p in (long_prompt, short_prompt)]
    for drafter in (PromptLookup(), DraftModel(model_dirs[arch], backend=backend),
                    DraftModel(model_dirs[f"{arch}-draft"], backend=backend)):
        out = specdec.generate(target, [long_prompt, short_prompt], drafter=drafter, num_draft_tokens=8,
                               max_new_tokens=24)
        assert out.token_ids == reference, drafter.name
        assert len(long_prompt) + len(out.token_ids[0]) <= window


def test_adaptive_k_is_lossless_and_reported(targets, hf_models, model_dirs, backend):
    target = targets["llama"]
    target.eos_token_ids = ()
    prompts = target.encode(PROMPTS)
    reference = [hf_greedy(hf_models["llama"], p, 30) for p in prompts]
    out = specdec.generate(target, prompts, drafter=DraftModel(model_dirs["llama"], backend=backend), num_draft_tokens=2,
                           max_new_tokens=30, draft_schedule="heuristic")
    assert out.token_ids == reference
    assert out.stats.draft_schedule == "heuristic"
    assert max(out.stats.k_history) > 2, "fully accepted steps must grow k"


def test_statistics_are_consistent(targets, model_dirs, backend):
    target = targets["llama"]
    target.eos_token_ids = ()
    prompts = target.encode(PROMPTS)
    same = specdec.generate(target, prompts, drafter=DraftModel(model_dirs["llama"], backend=backend), num_draft_tokens=4,
                            max_new_tokens=21).stats
    assert same.alpha == 1.0 and same.acceptance_rate == 1.0
    # 21 tokens = 1 from prefill + 4 steps of 5 tokens per row
    assert same.mean_accepted_length == pytest.approx(5.0)
    assert same.target_forwards == 1 + 4
    assert same.new_tokens == 21 * len(prompts)
    other = specdec.generate(target, prompts, drafter=DraftModel(model_dirs["llama-draft"]), num_draft_tokens=4,
                             max_new_tokens=30).stats
    assert other.drafts_accepted <= other.drafts_evaluated <= other.drafts_proposed
    assert sum(other.accepted_histogram) == other.verify_steps
    assert other.tokens_from_steps == other.drafts_accepted + other.verify_steps
    assert other.acceptance_by_position[0] * other.proposed_at[0] == pytest.approx(other.accepted_at[0])
    d = other.as_dict()
    for key in ("mean_accepted_length", "alpha", "predicted_mean_accepted_length", "acceptance_by_position",
                "accepted_histogram", "draft_time", "verify_time", "tokens_per_second", "target_forwards"):
        assert key in d
