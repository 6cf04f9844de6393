"""Pre-train the zoo's target model: a small Llama trained from scratch.

Training samples random windows of the packed train split (documents joined
with ``<|endoftext|>``). Most steps use ``seq_len`` tokens; the last
``long_fraction`` of steps use ``long_seq_len`` windows with the same number of
tokens per step, so every position up to ``max_position_embeddings`` has been
seen and 1,000+ token prompts stay in distribution (RoPE does not extrapolate).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.train import config as train_config
from specdec.train import data
from specdec.train.config import LongPhase, TrainConfigError, config_to_dict
from specdec.train.loop import LoopResult, OptimConfig, load_latest_checkpoint, list_checkpoints, run_loop
from specdec.zoo import corpus
from specdec.zoo import tokenizer as zoo_tokenizer


@dataclass(frozen=True)
class ModelShape:
    """Llama architecture knobs that matter at this scale."""

    layers: int = 8
    hidden: int = 192
    heads: int = 3
    kv_heads: int = 3
    intermediate: int = 512
    tie_embeddings: bool = True
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TargetConfig(LongPhase):
    """Everything that determines a target training run (stored in checkpoints)."""

    shape: ModelShape = field(default_factory=ModelShape)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=1200, lr=2.5e-3, warmup_steps=60, eval_every=100, ckpt_every_steps=100))
    seq_len: int = 512
    batch_size: int = 8
    long_seq_len: int = 2048
    long_fraction: float = 0.1
    eval_windows: int = 48
    seed: int = 0


PRESETS: dict[str, TargetConfig] = {
    "zoo": TargetConfig(),
    "tiny": TargetConfig(
        shape=ModelShape(layers=2, hidden=64, heads=2, kv_heads=2, intermediate=128, max_position_embeddings=256),
        optim=OptimConfig(steps=30, lr=3e-3, warmup_steps=5, eval_every=10, ckpt_every_steps=10),
        seq_len=64,
        batch_size=4,
        long_seq_len=128,
        long_fraction=0.2,
        eval_windows=8,
    ),
}


def config_from_dict(values: dict[str, Any]) -> TargetConfig:
    """TargetConfig from a (possibly partial) JSON object; unknown keys are errors."""
    return train_config.config_from_dict(TargetConfig, values, "training")


def load_config(path: str | None, preset: str = "zoo") -> TargetConfig:
    """A preset, optionally overridden by a JSON file of the same structure."""
    return train_config.load_config(TargetConfig, PRESETS, path, preset, "training")


def build_model(shape: ModelShape, vocab_size: int, special: dict[str, int], seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama with the zoo's special token ids in its config."""
    llama_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=special["eos"],
        eos_token_id=special["eos"],
        pad_token_id=special["pad"],
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config)


def round_to_export_dtype_(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Round weights in place to the export dtype (kept in float32), so reported losses are the shipped model's."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(dtype).to(param.dtype))


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a batch of windows [B, T]."""
    return model(input_ids=batch, labels=batch).loss


@torch.no_grad()
def evaluate_lm(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Token-weighted mean next-token loss over windows [N, T]."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.size(0), batch_size):
        chunk = windows[start : start + batch_size]  # [b, T]
        logits = model(input_ids=chunk).logits[:, :-1].float()  # [b, T-1, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += chunk[:, 1:].numel()
    return total / max(count, 1)


def target_batch_fn(config: TargetConfig, stream: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """Batch for a step: short windows, then long windows in the final phase."""
    long_start = config.long_start()

    def batch_for(step: int) -> torch.Tensor:
        generator = data.step_generator(config.seed, step)
        if step >= long_start:
            return data.sample_windows(stream, config.long_batch_size(), config.long_seq_len, generator)  # [b, L]
        return data.sample_windows(stream, config.batch_size, config.seq_len, generator)  # [B, T]

    return batch_for


def export_model(model: torch.nn.Module, tokenizer_dir: Path, out_dir: Path, summary: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> None:
    """save_pretrained (safetensors, ``dtype``) + tokenizer files, replacing files atomically.

    Everything is written to a temp dir next to ``out_dir`` first; each file is
    then moved in with os.replace, so a reader never sees a torn file.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
    try:
        exported = type(model)(model.config)
        exported.load_state_dict(model.state_dict())
        exported = exported.to(dtype)
        exported.config.dtype = dtype
        exported.save_pretrained(tmp, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            source = Path(tokenizer_dir) / name
            if source.is_file():
                shutil.copyfile(source, tmp / name)
        (tmp / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        for item in tmp.iterdir():
            os.chmod(item, 0o644)  # some writers create 0600 files; the zoo is meant to be shared
            os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_tokenizer(tokenizer_dir: Path | None, fallback_dir: Path, log: Callable[[str], None]) -> Path:
    """Use ``tokenizer_dir`` if given; otherwise train one on the train split into ``fallback_dir``."""
    if tokenizer_dir is not None:
        if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            raise TrainConfigError(f"no tokenizer.json in {tokenizer_dir}")
        return Path(tokenizer_dir)
    if not (fallback_dir / "tokenizer.json").is_file():
        log(f"training a tokenizer on the corpus train split into {fallback_dir}")
        zoo_tokenizer.save_tokenizer(zoo_tokenizer.train_tokenizer(corpus.read_split("train")), fallback_dir)
    return fallback_dir


def corpus_streams(tokenizer_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation token streams, shapes [N_train] and [N_val]."""
    tok = zoo_tokenizer.load_tokenizer(tokenizer_dir)
    eos = zoo_tokenizer.special_token_ids(tok)["eos"]
    return (data.encode_stream(corpus.read_split("train"), tok, eos), data.encode_stream(corpus.read_split("validation"), tok, eos))


def train_target(
    config: TargetConfig,
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    ckpt_dir: Path | None = None,
    resume: bool = False,
    max_minutes: float | None = None,
    streams: tuple[torch.Tensor, torch.Tensor] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train (or resume) a target, export it to ``out_dir``, return its summary."""
    out_dir = Path(out_dir)
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else out_dir / "checkpoints"
    if resume:
        saved = load_latest_checkpoint(ckpt_dir)["run_config"]
        config = config_from_dict(saved["target"])
    tok = zoo_tokenizer.load_tokenizer(tokenizer_dir)
    special = zoo_tokenizer.special_token_ids(tok)
    train_stream, val_stream = streams if streams is not None else corpus_streams(tokenizer_dir)
    val = data.eval_windows(val_stream, config.seq_len)  # [N, T]
    val_small = data.eval_windows(val_stream, config.seq_len, limit=config.eval_windows)  # [n, T]
    model = build_model(config.shape, tok.get_vocab_size(), special, config.seed)
    run_config = {"kind": "target", "target": config_to_dict(config), "vocab_size": tok.get_vocab_size()}
    tokens_per_step = lambda batch: batch.numel()  # noqa: E731
    result: LoopResult = run_loop(
        model=model,
        config=config.optim,
        batch_fn=target_batch_fn(config, train_stream),
        loss_fn=lm_loss,
        tokens_in=tokens_per_step,
        eval_fn=lambda m: {"val_loss": evaluate_lm(m, val_small)},
        ckpt_dir=ckpt_dir,
        run_config=run_config,
        resume=resume,
        max_minutes=max_minutes,
        desc="target",
        log=log,
    )
    round_to_export_dtype_(model)
    val_loss = evaluate_lm(model, val)
    summary = {
        "kind": "target",
        "parameters": count_parameters(model),
        **result.summary_fields(),
        "val_loss": round(val_loss, 4),
        "val_tokens": int(val[:, 1:].numel()),
        "config": config_to_dict(config),
    }
    export_model(model, tokenizer_dir, out_dir, summary)
    return summary


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the checkpoints present (for tests and status messages)."""
    return [int(p.stem.split("-")[1]) for p in list_checkpoints(ckpt_dir)]
