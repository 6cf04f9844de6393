"""Every committed zoo model loads offline with plain transformers (and specdec)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.zoo import MODEL_NAMES, ZooError, zoo_path


def _model_dir(name):
    try:
        return zoo_path(name)
    except ZooError as exc:
        pytest.fail(str(exc))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loads_with_transformers(name):
    directory = _model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(directory)
    cfg = model.config
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert cfg.bos_token_id is not None and cfg.max_position_embeddings >= 2048
    assert cfg.vocab_size == len(tok)
    ids = tok("def add(a, b):\n    return", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()


def test_draft_is_one_layer_and_shares_the_vocabulary():
    target_cfg = json.loads((_model_dir("target") / "config.json").read_text())
    draft_cfg = json.loads((_model_dir("draft") / "config.json").read_text())
    assert draft_cfg["num_hidden_layers"] == 1 < target_cfg["num_hidden_layers"]
    assert draft_cfg["vocab_size"] == target_cfg["vocab_size"]
    assert (_model_dir("draft") / "tokenizer.json").read_bytes() == (_model_dir("target") / "tokenizer.json").read_bytes()


def test_target_is_clearly_better_than_draft():
    target = json.loads((_model_dir("target") / "training_summary.json").read_text())
    draft = json.loads((_model_dir("draft") / "training_summary.json").read_text())
    assert draft["val_loss"] - target["val_loss"] >= 0.3


def test_zoo_is_small():
    """The zoo's own models under 100 MiB; the drafters trained for the real target (committed beside
    them, in bfloat16) under 120 MB together."""
    root = _model_dir("target").parent
    real = root / "smollm2-135m"
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and real not in p.parents)
    assert size < 100 * 2**20
    assert sum(p.stat().st_size for p in real.rglob("*") if p.is_file()) < 120 * 10**6


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loads_with_specdec(name):
    import specdec

    loaded = specdec.load_target(_model_dir(name))
    assert loaded.vocab_size == json.loads((_model_dir(name) / "config.json").read_text())["vocab_size"]
