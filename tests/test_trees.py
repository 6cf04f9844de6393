"""Token trees are lossless: every tree drafter's greedy output equals transformers' greedy generate."""

from __future__ import annotations

import pytest

import specdec
from specdec import TreeConfig
from specdec.drafters import DraftModel, PromptLookup
from specdec.errors import InvalidArgumentError, UnsupportedModelError
from specdec.commands.tiny import ARCHITECTURES
from test_greedy_parity import MAX_NEW, PROMPTS, hf_greedy, reference_with_stop

TREES = [TreeConfig(depth=3, topk=2, num_nodes=6), TreeConfig(depth=5, topk=4, num_nodes=16)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_drafters_match_transformers_greedy(arch, targets, hf_models, model_dirs, backend):
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    _, reference = reference_with_stop(target, model, prompts)
    drafters = [PromptLookup(max_ngram=3), DraftModel(model_dirs[f"{arch}-draft"], backend=backend),
                DraftModel(model_dirs[arch], backend=backend)]  # the target itself: whole paths accepted
    for drafter in drafters:
        for tree in TREES:
            out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW, tree=tree)
            assert out.token_ids == reference, f"{drafter.name} {tree} batch of {len(prompts)}"
            alone = specdec.generate(target, prompts[:1], drafter=drafter, max_new_tokens=MAX_NEW, tree=tree)
            assert alone.token_ids == reference[:1], f"{drafter.name} {tree} alone"
    target.eos_token_ids = ()
    path = TreeConfig(depth=5, topk=1, num_nodes=5)  # a one-path tree: its own draft is accepted whole
    stats = specdec.generate(target, prompts, drafter=drafters[2], max_new_tokens=31, tree=path).stats
    assert stats.mean_accepted_length == pytest.approx(6.0)
    stats = specdec.generate(target, prompts, drafter=drafters[2], max_new_tokens=MAX_NEW, tree=TREES[1]).stats
    assert stats.mean_accepted_length > 2, "the target as its own draft must get paths accepted"
    assert stats.k_sum > stats.verify_steps * TREES[1].depth, "trees verify more nodes than one path"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_trees_up_to_the_context_limit(arch, targets, hf_models, model_dirs, backend):
    target = targets[arch]
    window = target.max_positions
    base = target.encode(PROMPTS)
    long_prompt = (base[0] * window)[: window - 20]
    target.eos_token_ids = ()
    reference = [hf_greedy(hf_models[arch], p, 20) for p in (long_prompt, base[3])]
    for drafter in (PromptLookup(), DraftModel(model_dirs[arch], backend=backend)):
        out = specdec.generate(target, [long_prompt, base[3]], drafter=drafter, max_new_tokens=20,
                               tree=TreeConfig(depth=6, topk=3, num_nodes=12))
        assert out.token_ids == reference, drafter.name


def test_tree_statistics(targets, model_dirs, backend):
    target = targets["llama"]
    target.eos_token_ids = ()
    prompts = target.encode(PROMPTS)
    tree = TreeConfig(depth=4, topk=2, num_nodes=8)
    stats = specdec.generate(target, prompts, drafter=DraftModel(model_dirs["llama-draft"], backend=backend),
                             max_new_tokens=30, tree=tree).stats
    assert stats.mean_k == pytest.approx(stats.k_sum / stats.verify_steps) and stats.mean_k <= 8
    assert 1 <= len(stats.acceptance_by_position) <= 4  # acceptance per depth, up to the deepest node
    assert sum(stats.accepted_histogram) == stats.verify_steps
    assert 0 < stats.tokens_per_verified_token < 1
    assert stats.as_dict()["tokens_per_verified_token"] == stats.tokens_per_verified_token


@pytest.mark.parametrize("options, needle", [
    (dict(depth=5, topk=2, num_nodes=4), "num_nodes >= 5"),
    (dict(depth=3, topk=0, num_nodes=8), "must be >= 1"),
    (dict(depth=0, topk=2, num_nodes=8), "must be >= 1"),
])
def test_bad_tree_settings_are_one_clear_error(options, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        TreeConfig(**options)


def test_backends_that_cannot_mask_trees_refuse_them(tokenizer):
    from test_model_support import tiny

    model = tiny("bart", tokenizer, d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
                 encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=128, init_std=0.3)
    target = specdec.Target(model, tokenizer)
    with pytest.raises(UnsupportedModelError, match="cannot verify token trees"):
        specdec.generate(target, ["import os"], drafter=PromptLookup(), max_new_tokens=4, tree=TreeConfig(2, 2, 4))
