"""Target trainer: loss goes down, export loads, resume after a kill is exact."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.train import data, loop
from specdec.train import target as tg
from specdec.zoo import corpus
from specdec.zoo import tokenizer as zt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 400-token tokenizer and small train/validation streams from real stdlib files."""
    torch.set_num_threads(1)
    texts = corpus.read_split("validation")
    tok_dir = tmp_path_factory.mktemp("tiny") / "tokenizer"
    tok = zt.train_tokenizer(texts[:8], vocab_size=400)
    zt.save_tokenizer(tok, tok_dir)
    streams = (data.encode_stream(texts[:8], tok, 0), data.encode_stream(texts[8:10], tok, 0))
    return tok_dir, streams


def _final_state(ckpt_dir):
    return torch.load(loop.list_checkpoints(ckpt_dir)[-1], weights_only=False)


def test_tiny_training_lowers_loss_and_exports(tiny, tmp_path):
    tok_dir, streams = tiny
    summary = tg.train_target(tg.PRESETS["tiny"], tmp_path / "out", tok_dir, streams=streams, log=lambda m: None)
    history = _final_state(tmp_path / "out" / "checkpoints")["history"]
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert last < first - 0.3
    assert summary["completed"] and summary["steps"] == tg.PRESETS["tiny"].optim.steps
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.bfloat16 and model.config.max_position_embeddings == 256
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert model.config.eos_token_id == tok.eos_token_id == 0 and model.config.pad_token_id == tok.pad_token_id == 1
    saved = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    assert saved["val_loss"] == summary["val_loss"]


def test_resume_after_kill_matches_uninterrupted_run(tiny, tmp_path):
    tok_dir, streams = tiny
    config = tg.PRESETS["tiny"]
    ckpt = tmp_path / "ckpt"
    tg.train_target(config, tmp_path / "a", tok_dir, ckpt_dir=ckpt, streams=streams, log=lambda m: None)
    uninterrupted = _final_state(ckpt)
    # A SIGKILL between two checkpoints loses everything after the older one.
    assert tg.checkpoint_steps(ckpt) == [20, 30]
    loop.list_checkpoints(ckpt)[-1].unlink()
    tg.train_target(config, tmp_path / "b", tok_dir, ckpt_dir=ckpt, resume=True, streams=streams, log=lambda m: None)
    resumed = _final_state(ckpt)
    assert resumed["step"] == uninterrupted["step"] == 30
    for name, value in uninterrupted["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    assert resumed["history"] == uninterrupted["history"]


def test_time_budget_stops_cleanly_and_resume_finishes(tiny, tmp_path):
    tok_dir, streams = tiny
    summary = tg.train_target(tg.PRESETS["tiny"], tmp_path / "out", tok_dir, streams=streams, max_minutes=0, log=lambda m: None)
    assert not summary["completed"] and summary["steps"] == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    summary = tg.train_target(tg.PRESETS["tiny"], tmp_path / "out", tok_dir, streams=streams, resume=True, log=lambda m: None)
    assert summary["completed"]


def test_existing_checkpoints_need_resume(tiny, tmp_path):
    tok_dir, streams = tiny
    tg.train_target(tg.PRESETS["tiny"], tmp_path / "out", tok_dir, streams=streams, log=lambda m: None)
    with pytest.raises(loop.CheckpointError, match="pass --resume"):
        tg.train_target(tg.PRESETS["tiny"], tmp_path / "out", tok_dir, streams=streams, log=lambda m: None)


def test_lr_schedule_warms_up_then_decays():
    cfg = loop.OptimConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    factors = [loop.lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[50] < factors[10] and factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_config_file_overrides_and_rejects_unknown_keys(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"shape": {"layers": 3}, "optim": {"steps": 7}}))
    cfg = tg.load_config(str(good), "tiny")
    assert cfg.shape.layers == 3 and cfg.optim.steps == 7 and cfg.shape.hidden == tg.PRESETS["tiny"].shape.hidden
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"shape": {"depth": 3}}))
    with pytest.raises(tg.TrainConfigError):
        tg.load_config(str(bad), "tiny")


def test_cli_reports_user_errors_in_one_line(capsys, tmp_path):
    from specdec.commands.train import main

    assert main(["train", "target", "--out", str(tmp_path / "x"), "--resume", "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_a_checkpoint_from_before_a_new_setting_still_resumes():
    """Resuming fills a setting the checkpoint lacks with its default: that is the same run; a setting the
    checkpoint has with another value is not."""
    from specdec.train.loop import same_run

    saved = {"kind": "eagle", "eagle": {"steps": 3, "shape": {"layers": 1}}}
    assert same_run(saved, {"kind": "eagle", "eagle": {"steps": 3, "shape": {"layers": 1}, "head_from_target": False}})
    assert not same_run(saved, {"kind": "eagle", "eagle": {"steps": 4, "shape": {"layers": 1}}})
    assert not same_run({**saved, "extra": 1}, saved)
