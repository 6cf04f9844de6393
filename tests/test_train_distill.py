"""Distillation: KL goes down, agreement metric, cached generation, shared resume."""

from dataclasses import replace

import pytest
import torch

from specdec.train import data, loop
from specdec.train import distill as ds
from specdec.train import target as tg
from specdec.zoo import corpus
from specdec.zoo import tokenizer as zt


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny trained target exported with its tokenizer, plus small streams."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill")
    texts = corpus.read_split("validation")
    tok = zt.train_tokenizer(texts[:8], vocab_size=400)
    zt.save_tokenizer(tok, root / "tokenizer")
    streams = (data.encode_stream(texts[:8], tok, 0), data.encode_stream(texts[8:10], tok, 0))
    config = tg.PRESETS["tiny"]
    config = replace(config, optim=replace(config.optim, steps=60))
    tg.train_target(config, root / "target", root / "tokenizer", streams=streams, log=lambda m: None)
    return root / "target", streams


def _tiny_config(**changes):
    from dataclasses import replace

    base = ds.PRESETS["tiny"]
    return replace(base, **{"init_from_target": False, "optim": replace(base.optim, steps=40, lr=1e-2), **changes})


def test_distillation_lowers_kl_and_exports(tiny_target, tmp_path):
    target_dir, streams = tiny_target
    summary = ds.train_distill(_tiny_config(), target_dir, tmp_path / "draft", streams=streams, log=lambda m: None)
    history = torch.load(loop.list_checkpoints(tmp_path / "draft" / "checkpoints")[-1], weights_only=False)["history"]
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.7 * first
    assert 0.0 <= summary["greedy_agreement"] <= 1.0 and summary["parameters"] < summary["target_parameters"]
    assert (tmp_path / "draft" / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    assert any(p.name.startswith("generated-") for p in (tmp_path / "draft" / "checkpoints").iterdir())


def test_distillation_resume_after_kill_is_exact(tiny_target, tmp_path):
    target_dir, streams = tiny_target
    config = _tiny_config(optim=replace(ds.PRESETS["tiny"].optim, steps=20, ckpt_every_steps=10))
    ckpt = tmp_path / "ckpt"
    ds.train_distill(config, target_dir, tmp_path / "a", ckpt_dir=ckpt, streams=streams, log=lambda m: None)
    full = torch.load(loop.list_checkpoints(ckpt)[-1], weights_only=False)
    loop.list_checkpoints(ckpt)[-1].unlink()
    ds.train_distill(config, target_dir, tmp_path / "b", ckpt_dir=ckpt, resume=True, streams=streams, log=lambda m: None)
    resumed = torch.load(loop.list_checkpoints(ckpt)[-1], weights_only=False)
    for name, value in full["model"].items():
        assert torch.equal(value, resumed["model"][name]), name


def test_agreement_metric(tiny_target):
    target_dir, streams = tiny_target
    target = ds.load_frozen_target(target_dir)
    windows = data.eval_windows(streams[1], 32, limit=4)  # [4, 32]
    assert ds.greedy_agreement(target, target, windows) == 1.0
    other = tg.build_model(tg.ModelShape(layers=1, hidden=32, heads=2, kv_heads=2, intermediate=64), target.config.vocab_size,
                           {"eos": 0, "pad": 1}, seed=3).eval()
    value = ds.greedy_agreement(other, target, windows)
    assert 0.0 <= value < 1.0


def test_kl_loss_is_zero_for_identical_logits_and_positive_otherwise():
    logits = torch.randn(2, 5, 11)  # [B, T, V]
    assert ds.kl_loss(logits, logits).item() == pytest.approx(0.0, abs=1e-6)
    assert ds.kl_loss(torch.zeros_like(logits), logits, temperature=2.0).item() > 0


def test_cached_generation_matches_full_forward_greedy(tiny_target):
    target_dir, streams = tiny_target
    target = ds.load_frozen_target(target_dir)
    prefixes = streams[0][:24].view(2, 12)  # [2, 12]
    out = ds.generate_continuations(target, prefixes, 6, greedy=True, generator=torch.Generator().manual_seed(0))
    seq = prefixes
    with torch.no_grad():
        for _ in range(6):
            nxt = target(input_ids=seq).logits[:, -1].argmax(-1)  # [2]
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert torch.equal(out, seq)


def test_missing_target_is_a_clear_error(tmp_path):
    with pytest.raises(ds.DistillError, match="no exported model"):
        ds.train_distill(ds.PRESETS["tiny"], tmp_path / "nope", tmp_path / "draft")


def test_student_starts_from_target_embeddings_and_first_layer(tiny_target):
    target_dir, _ = tiny_target
    target = ds.load_frozen_target(target_dir)
    shape = ds.PRESETS["tiny"].shape
    student = tg.build_model(shape, target.config.vocab_size, {"eos": 0, "pad": 1}, seed=5)
    ds.init_student_from_target(student, target)
    s, t = student.state_dict(), target.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert torch.equal(s[name], t[name])
