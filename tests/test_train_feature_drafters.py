"""Training Medusa, EAGLE-1 and EAGLE-3 on the zoo target: loss goes down, resumption is exact, the
offline metric is what it claims, and the saved folders load as drafters."""

from dataclasses import replace

import pytest
import torch

import specdec
from specdec.drafters import Eagle, Medusa
from specdec.train import eagle as te
from specdec.train import loop
from specdec.train import medusa as tm
from specdec.train.features import acceptance_summary, anchor_mask, leading_matches
from specdec.zoo import zoo_path

QUIET = dict(log=lambda message: None)


def history(ckpt_dir):
    return torch.load(loop.list_checkpoints(ckpt_dir)[-1], weights_only=False)["history"]


def falls(records):
    losses = [r["loss"] for r in records]
    return sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_training_lowers_the_loss_and_saves_a_drafter(version, tmp_path):
    config = replace(te.PRESETS["tiny"], version=version, draft_vocab_size=512 if version == 3 else 0)
    summary = te.train_eagle(config, zoo_path("target"), tmp_path / "out", **QUIET)
    assert falls(history(tmp_path / "out" / "checkpoints"))
    offline = summary["offline"]
    assert 1.0 <= offline["tau_k1"] <= offline["tau_k2"] <= offline["tau_k3"] <= 4.0
    assert summary["kind"] == ("eagle3" if version == 3 else "eagle")
    drafter = Eagle(tmp_path / "out", version=version)
    assert drafter.config.training["offline"]["tau_k3"] == offline["tau_k3"]
    if version == 3:
        assert drafter.config.draft_vocab_size == 512 and 0.5 < summary["draft_vocab_coverage"] <= 1.0
    target = specdec.load_target(zoo_path("target"))
    prompts = target.encode(["def f(x):\n    return"])
    plain = specdec.generate(target, prompts, max_new_tokens=12)
    assert specdec.generate(target, prompts, drafter=drafter, max_new_tokens=12).token_ids == plain.token_ids


def test_medusa_training_lowers_the_loss_and_picks_a_tree(tmp_path):
    summary = tm.train_medusa(tm.PRESETS["tiny"], zoo_path("target"), tmp_path / "out", **QUIET)
    assert falls(history(tmp_path / "out" / "checkpoints"))
    drafter = Medusa(tmp_path / "out")
    assert len(drafter.choices) == summary["default_tree_nodes"] in tm.TREE_SIZES
    assert set(summary["tree_sizes"]) == {str(n) for n in tm.TREE_SIZES}


def test_medusa_heads_on_the_targets_own_head_train_and_draft(tmp_path):
    """original_lm_head: the heads end in the target's LM head, which the folder leaves out (only the
    residual blocks are saved); the loss falls, the offline metric reloads the head, decoding is exact."""
    base = tm.PRESETS["tiny"]
    config = replace(base, shape=replace(base.shape, original_lm_head=True))
    summary = tm.train_medusa(config, zoo_path("target"), tmp_path / "out", **QUIET)
    assert falls(history(tmp_path / "out" / "checkpoints"))
    from safetensors.torch import load_file

    names = set(load_file(tmp_path / "out" / "medusa_lm_head.safetensors"))
    assert names == {f"{i}.0.linear.{n}" for i in range(3) for n in ("weight", "bias")}
    offline = tm.evaluate_drafter(tmp_path / "out", zoo_path("target"), tmp_path / "cache",
                                 heldout_sequences=config.heldout_sequences, **QUIET)
    assert offline["tau_default_tree"] == pytest.approx(summary["offline"]["tau_default_tree"], abs=0.05)
    target = specdec.load_target(zoo_path("target"))
    prompts = target.encode(["def f(x):\n    return", "import os\n"])
    plain = specdec.generate(target, prompts, max_new_tokens=12)
    out = specdec.generate(target, prompts, drafter=Medusa(tmp_path / "out"), max_new_tokens=12)
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_resume_after_kill_is_exact(kind, tmp_path):
    module, train = (te, te.train_eagle) if kind == "eagle3" else (tm, tm.train_medusa)
    base = module.PRESETS["tiny"]
    config = replace(base, optim=replace(base.optim, steps=8, ckpt_every_steps=4, eval_every=100))
    ckpt = tmp_path / "ckpt"
    train(config, zoo_path("target"), tmp_path / "a", ckpt_dir=ckpt, **QUIET)
    full = torch.load(loop.list_checkpoints(ckpt)[-1], weights_only=False)
    loop.list_checkpoints(ckpt)[-1].unlink()  # as if killed after step 4
    train(config, zoo_path("target"), tmp_path / "b", ckpt_dir=ckpt, resume=True, **QUIET)
    resumed = torch.load(loop.list_checkpoints(ckpt)[-1], weights_only=False)
    assert resumed["step"] == full["step"] == 8
    for name, value in full["model"].items():
        assert torch.equal(value, resumed["model"][name]), name


def test_offline_metric_counts_leading_matches():
    matches = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    accepted = leading_matches(matches)
    assert accepted.tolist() == [2, 0, 4]
    summary = acceptance_summary(accepted, 4)
    assert summary["accept_1"] == pytest.approx(2 / 3) and summary["accept_3"] == pytest.approx(1 / 3)
    assert summary["tau_k4"] == pytest.approx(1 + (2 + 2 + 1 + 1) / 3)
    valid = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    mask = anchor_mask(valid, prompt_len=3, pairs=7, depth=2)
    assert mask[0].nonzero().squeeze(1).tolist() == [2, 3, 4, 5] and mask[1].nonzero().squeeze(1).tolist() == [2]


def test_medusa_tree_building_follows_accuracy():
    ranks = torch.tensor([[0, 0], [0, 1], [1, 0], [0, 0], [-1, -1]])
    tree = tm.build_tree(ranks, 3)
    assert tree == [(0,), (1,), (0, 0)]
    assert tm.tree_tau(ranks, tree) == pytest.approx(1 + (2 + 1 + 1 + 2 + 0) / 5)


def test_eagle3_head_can_start_from_the_target(tmp_path):
    """head_from_target: the head begins as the target's rows of the draft vocabulary (one step of a small
    learning rate later, still within a hair of them) and its norm as the target's final norm."""
    from safetensors.torch import load_file

    from specdec.train.loop import OptimConfig

    config = replace(te.PRESETS["tiny"], draft_vocab_size=512, head_from_target=True,
                     optim=OptimConfig(steps=1, lr=1e-6, warmup_steps=1, eval_every=1, ckpt_every_steps=1))
    te.train_eagle(config, zoo_path("target"), tmp_path / "out", **QUIET)
    drafter = Eagle(tmp_path / "out", version=3)
    target = specdec.load_target(zoo_path("target"), backend="hf")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    head = saved["lm_head.weight"].float()
    rows = target.output_head()[drafter.net.draft_ids()]
    assert (head - rows).abs().max() < 1e-2 and not torch.equal(head, torch.zeros_like(head))
    norm = saved["norm.weight"]
    assert (norm.float() - target.model.model.norm.weight).abs().max() < 1e-2
