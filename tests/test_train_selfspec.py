"""LayerSkip and MTP training continue the zoo target: losses go down, --resume is exact, the variant
folder loads as an ordinary causal LM (the extra tensors under DeepSeek-V3's names), bad options
are one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import specdec
from specdec.commands.cli import main as cli_main
from specdec.drafters import MTP, EarlyExit
from specdec.train import loop
from specdec.train import selfspec as ss
from specdec.zoo import zoo_path

from test_train_dflash import check_resume_is_exact

QUIET = dict(log=lambda message: None)


def tiny(**changes):
    return replace(ss.PRESETS["tiny"], **changes)


def test_layerskip_training_trains_the_exits(tmp_path):
    summary = ss.train_selfspec(tiny(), zoo_path("target"), tmp_path / "out", **QUIET)
    before, after = summary["original_validation"], summary["validation"]
    layers = 8
    exits = range(1, layers)
    assert sum(after[f"exit{l}_loss"] for l in exits) < sum(before[f"exit{l}_loss"] for l in exits) - 0.5
    assert after["exit1_loss"] < before["exit1_loss"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert 1 <= config["specdec_layerskip"]["exit_layer"] < layers
    target = specdec.load_target(tmp_path / "out")
    assert EarlyExit().exit_for(target) == config["specdec_layerskip"]["exit_layer"]
    reference = specdec.generate(target, "def add(a, b):", max_new_tokens=24).token_ids
    assert specdec.generate(target, "def add(a, b):", drafter=EarlyExit(), max_new_tokens=24).token_ids == reference


def test_weak_exits_and_modules_are_warned_about():
    said = []
    assert ss.warn_if_weak({"exit1_agree": 0.1, "exit2_agree": 0.2}, said.append) and "WARNING" in said[-1]
    assert ss.warn_if_weak({"mtp1_acc": 0.02}, said.append) and "MTP module" in said[-1]
    assert not ss.warn_if_weak({"exit1_agree": 0.5, "mtp1_acc": 0.3}, said.append) and len(said) == 2


def test_dropout_and_curriculum_follow_the_schedule():
    rates = ss.dropout_rates(8, 0.2)
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2) and all(a < b for a, b in zip(rates, rates[1:]))
    config = tiny(optim=replace(ss.PRESETS["tiny"].optim, steps=100))
    assert ss.enabled_exits(config, 8, 0) == []  # no early exit before the curriculum reaches it
    assert ss.enabled_exits(config, 8, 10) == [7] and ss.enabled_exits(config, 8, 13) == [6, 7]  # deep first
    assert ss.enabled_exits(config, 8, 50) == list(range(1, 8))  # all of them by half of training
    rotational = replace(config, curriculum="rotational")
    assert [ss.enabled_exits(rotational, 8, s) for s in range(8)] == [[1], [2], [3], [4], [5], [6], [7], [1]]


@pytest.mark.parametrize("design", ["sequential", "parallel"])
def test_mtp_training_trains_the_modules_and_saves_them_where_engines_look(design, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ss.train_selfspec(tiny(method="mtp", design=design, depth=2), zoo_path("target"), tmp_path / "out", **QUIET)
    evals = [record for record in summary_history(tmp_path / "out") if "mtp1_loss" in record]
    assert len(evals) == 2 and all(evals[1][f"mtp{k}_loss"] < evals[0][f"mtp{k}_loss"] for k in (1, 2))
    folder = tmp_path / "out"
    config = json.loads((folder / "config.json").read_text())
    names = load_file(folder / "model.safetensors").keys()
    if design == "sequential":
        assert config["num_nextn_predict_layers"] == 2
        for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "self_attn.q_proj.weight", "mlp.down_proj.weight"):
            assert {f"model.layers.8.{part}", f"model.layers.9.{part}"} <= set(names)
    else:
        assert {"mtp_heads.0.norm.weight", "mtp_heads.1.self_attn.q_proj.weight"} <= set(names)
    # the plain model: an ordinary causal LM whose logits are those of the main model
    plain_lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    target = specdec.load_target(folder, backend="native")
    ids = target.encode(["def add(a, b):\n    return"])[0]
    cache = target.new_cache(1, 64)
    logits, _ = target.forward(cache, torch.tensor([ids]))
    with torch.no_grad():
        theirs = plain_lm(input_ids=torch.tensor([ids])).logits[:, -1]
    assert torch.allclose(logits[:, -1], theirs, atol=1e-4)
    reference = specdec.generate(target, "def add(a, b):", max_new_tokens=24).token_ids
    assert specdec.generate(target, "def add(a, b):", drafter=MTP(), num_draft_tokens=3,
                            max_new_tokens=24).token_ids == reference


def summary_history(folder):
    state = torch.load(loop.list_checkpoints(folder / "checkpoints")[-1], weights_only=False)
    return state["history"]


@pytest.mark.parametrize("method", ["layerskip", "mtp"])
def test_resume_after_kill_is_exact(method, tmp_path):
    check_resume_is_exact(ss.train_selfspec, tiny(method=method), tmp_path)


def test_bad_options_are_one_line(tmp_path, capsys):
    target = str(zoo_path("target"))
    for argv, text in ((["train", "mtp", "--target", target, "--out", str(tmp_path / "a"), "--depth", "0"],
                        "--depth must be >= 1"),
                       (["train", "layerskip", "--target", target, "--out", str(tmp_path / "b"), "--resume"],
                        "no checkpoint to resume from"),
                       (["train", "mtp", "--target", target, "--out", str(tmp_path / "c"), "--resume", "--depth", "2"],
                        "drop --design/--depth"),
                       (["train", "layerskip", "--target", str(tmp_path), "--out", str(tmp_path / "d")],
                        "config.json")):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "a").exists()
