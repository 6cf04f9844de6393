"""Distil a 1-layer draft from a frozen target (same tokenizer, same vocabulary).

The student minimises KL(target || student) of next-token distributions, on
two kinds of text, alternating step by step:
  * corpus windows from the train split, and
  * continuations the target itself generated from corpus prefixes (half
    greedy, half sampled), cached on disk. These are the texts a draft sees
    during speculative decoding, where the target's own outputs are the prefix.
The final phase uses long windows so the draft also handles 1,000+ token prompts.
The student starts from the target's embeddings, first layer and final norm,
which makes the short distillation budget go much further.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specdec.errors import SpecdecError
from specdec.train import config as train_config
from specdec.train import data
from specdec.train.config import LongPhase, config_to_dict
from specdec.train.loop import OptimConfig, run_folders, run_loop
from specdec.train.target import (
    ModelShape,
    build_model,
    corpus_streams,
    count_parameters,
    export_model,
    round_to_export_dtype_,
)
from specdec.zoo import tokenizer as zoo_tokenizer


class DistillError(SpecdecError):
    """The target cannot be distilled into the requested student."""


@dataclass(frozen=True)
class DistillConfig(LongPhase):
    """Everything that determines a distillation run (stored in checkpoints)."""

    shape: ModelShape = field(default_factory=lambda: ModelShape(layers=1, hidden=192, heads=3, kv_heads=3, intermediate=512))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=400, lr=3e-3, warmup_steps=20, eval_every=100, ckpt_every_steps=100))
    temperature: float = 1.0
    seq_len: int = 512
    batch_size: int = 8
    long_seq_len: int = 2048
    long_fraction: float = 0.1
    generated_sequences: int = 384
    prefix_len: int = 64
    generated_len: int = 192
    generation_batch: int = 32
    init_from_target: bool = True
    eval_windows: int = 32
    seed: int = 0


PRESETS: dict[str, DistillConfig] = {
    "zoo": DistillConfig(),
    "tiny": DistillConfig(
        shape=ModelShape(layers=1, hidden=64, heads=2, kv_heads=2, intermediate=128, max_position_embeddings=256),
        optim=OptimConfig(steps=30, lr=3e-3, warmup_steps=5, eval_every=10, ckpt_every_steps=10),
        seq_len=64,
        batch_size=4,
        long_seq_len=128,
        long_fraction=0.2,
        generated_sequences=8,
        prefix_len=16,
        generated_len=16,
        generation_batch=4,
        eval_windows=8,
    ),
}


def config_from_dict(values: dict[str, Any]) -> DistillConfig:
    """DistillConfig from a (possibly partial) JSON object; unknown keys are errors."""
    return train_config.config_from_dict(DistillConfig, values, "distillation")


def load_config(path: str | None, preset: str = "zoo") -> DistillConfig:
    """A preset, optionally overridden by a JSON file of the same structure."""
    return train_config.load_config(DistillConfig, PRESETS, path, preset, "distillation")


def load_frozen_target(target_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The exported target (float32 unless asked), eval mode, gradients off."""
    if not (Path(target_dir) / "config.json").is_file():
        raise DistillError(f"no exported model in {target_dir} (config.json missing)")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def kl_loss(student_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of KL(target || student) at ``temperature``, scaled by T^2.

    Both logits have shape [B, T, V].
    """
    t_logp = F.log_softmax(target_logits.float() / temperature, dim=-1)  # [B, T, V]
    s_logp = F.log_softmax(student_logits.float() / temperature, dim=-1)  # [B, T, V]
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(dim=-1)  # [B, T]
    return kl.mean() * temperature**2


@torch.no_grad()
def generate_continuations(model: torch.nn.Module, prefixes: torch.Tensor, new_tokens: int, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    """Extend prefixes [N, P] by ``new_tokens`` target tokens (KV-cached); returns [N, P + new]."""
    out = model(input_ids=prefixes, use_cache=True)
    cache, logits = out.cache, out.logits[:, -1].float()  # [N, V]
    tokens = [prefixes]
    for _ in range(new_tokens):
        if greedy:
            nxt = logits.argmax(dim=-1)  # [N]
        else:
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)  # [N]
        tokens.append(nxt[:, None])
        out = model(input_ids=nxt[:, None], cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1].float()
    return torch.cat(tokens, dim=1)


def _target_fingerprint(target_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        path = Path(target_dir) / name
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def generated_cache(config: DistillConfig, target: torch.nn.Module, target_dir: Path, train_stream: torch.Tensor,
                    cache_dir: Path, log: Callable[[str], None]) -> torch.Tensor:
    """Target continuations of corpus prefixes [N, P + G], generated once and cached on disk.

    The cache file name includes the target's fingerprint and the generation
    settings, so a different target or recipe never reuses a stale cache.
    """
    key = f"{_target_fingerprint(target_dir)}-{config.generated_sequences}-{config.prefix_len}-{config.generated_len}-{config.seed}"
    path = Path(cache_dir) / f"generated-{key}.pt"
    if path.is_file():
        return torch.load(path, map_location="cpu")
    if config.generated_sequences == 0:
        return torch.empty(0, config.prefix_len + config.generated_len, dtype=torch.long)
    generator = data.step_generator(config.seed, 0, salt=1)
    prefixes = data.sample_windows(train_stream, config.generated_sequences, config.prefix_len, generator)  # [N, P]
    chunks = []
    for start in range(0, prefixes.size(0), config.generation_batch):
        greedy = (start // config.generation_batch) % 2 == 0
        chunk = generate_continuations(target, prefixes[start : start + config.generation_batch], config.generated_len, greedy, generator)
        chunks.append(chunk)
        log(f"[distill] generated {min(start + config.generation_batch, prefixes.size(0))}/{prefixes.size(0)} continuations")
    sequences = torch.cat(chunks)  # [N, P + G]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gen-", dir=path.parent)
    with os.fdopen(fd, "wb") as handle:
        torch.save(sequences, handle)
    os.replace(tmp, path)
    return sequences


def init_student_from_target(student: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy embeddings, the first decoder layer, final norm and LM head into the student."""
    if student.config.hidden_size != target.config.hidden_size:
        raise DistillError("init_from_target needs the student's hidden size to equal the target's")
    s_state, t_state = student.state_dict(), target.state_dict()
    copied = {}
    for name, value in t_state.items():
        if name in s_state and s_state[name].shape == value.shape and (not name.startswith("model.layers.") or name.startswith("model.layers.0.")):
            copied[name] = value.to(s_state[name].dtype)
    if student.config.intermediate_size != target.config.intermediate_size:
        copied = {k: v for k, v in copied.items() if ".mlp." not in k}
    student.load_state_dict(copied, strict=False)


@torch.no_grad()
def compare_on_windows(student: torch.nn.Module, target: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    """Student and target next-token losses and greedy agreement on windows [N, T]."""
    student.eval()
    s_total = t_total = agree = count = 0.0
    for start in range(0, windows.size(0), batch_size):
        chunk = windows[start : start + batch_size]  # [b, T]
        labels = chunk[:, 1:].reshape(-1)  # [b*(T-1)]
        s_logits = student(input_ids=chunk).logits[:, :-1].float()  # [b, T-1, V]
        t_logits = target(input_ids=chunk).logits[:, :-1].float()  # [b, T-1, V]
        vocab = s_logits.size(-1)
        s_total += float(F.cross_entropy(s_logits.reshape(-1, vocab), labels, reduction="sum"))
        t_total += float(F.cross_entropy(t_logits.reshape(-1, vocab), labels, reduction="sum"))
        agree += float((s_logits.argmax(-1) == t_logits.argmax(-1)).sum())
        count += labels.numel()
    return {"val_loss": s_total / count, "target_val_loss": t_total / count, "agreement": agree / count}


def greedy_agreement(student: torch.nn.Module, target: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Fraction of positions in windows [N, T] where argmax student == argmax target."""
    return compare_on_windows(student, target, windows, batch_size)["agreement"]


def distill_batch_fn(config: DistillConfig, stream: torch.Tensor, generated: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """Odd steps use generated continuations (if any), others corpus windows; long windows at the end."""
    long_start = config.long_start()
    gen_batch = max(1, config.batch_size * config.seq_len // max(1, generated.size(1)))

    def batch_for(step: int) -> torch.Tensor:
        generator = data.step_generator(config.seed, step, salt=2)
        if step >= long_start:
            return data.sample_windows(stream, config.long_batch_size(), config.long_seq_len, generator)  # [b, L]
        if step % 2 == 1 and generated.size(0) > 0:
            rows = torch.randint(0, generated.size(0), (gen_batch,), generator=generator)  # [b]
            return generated[rows]  # [b, P + G]
        return data.sample_windows(stream, config.batch_size, config.seq_len, generator)  # [B, T]

    return batch_for


def train_distill(
    config: DistillConfig,
    target_dir: Path,
    out_dir: Path,
    *,
    ckpt_dir: Path | None = None,
    resume: bool = False,
    max_minutes: float | None = None,
    streams: tuple[torch.Tensor, torch.Tensor] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Distil (or resume distilling) a draft from ``target_dir``, export it to ``out_dir``."""
    from tqdm import tqdm

    log = log or (lambda message: tqdm.write(message))
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    ckpt_dir, config = run_folders(out_dir, ckpt_dir, resume, "distill", config, config_from_dict)
    target = load_frozen_target(target_dir)
    tok = zoo_tokenizer.load_tokenizer(target_dir)
    special = zoo_tokenizer.special_token_ids(tok)
    if tok.get_vocab_size() != target.config.vocab_size:
        raise DistillError(f"tokenizer in {target_dir} has {tok.get_vocab_size()} tokens but the target has {target.config.vocab_size}")
    train_stream, val_stream = streams if streams is not None else corpus_streams(target_dir)
    generated = generated_cache(config, target, target_dir, train_stream, ckpt_dir, log)  # [N, P + G]
    student = build_model(config.shape, target.config.vocab_size, special, config.seed)
    if config.init_from_target and not resume:
        init_student_from_target(student, target)
    val = data.eval_windows(val_stream, config.seq_len)  # [N, T]
    val_small = data.eval_windows(val_stream, config.seq_len, limit=config.eval_windows)  # [n, T]

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target_logits = target(input_ids=batch).logits  # [B, T, V]
        return kl_loss(model(input_ids=batch).logits, target_logits, config.temperature)

    run_config = {"kind": "distill", "distill": config_to_dict(config), "target": _target_fingerprint(target_dir)}
    result = run_loop(
        model=student,
        config=config.optim,
        batch_fn=distill_batch_fn(config, train_stream, generated),
        loss_fn=loss_fn,
        tokens_in=lambda batch: batch.numel(),
        eval_fn=lambda m: compare_on_windows(m, target, val_small),
        ckpt_dir=ckpt_dir,
        run_config=run_config,
        resume=resume,
        max_minutes=max_minutes,
        desc="distill",
        log=log,
    )
    round_to_export_dtype_(student)
    final = compare_on_windows(student, target, val)
    summary = {
        "kind": "draft",
        "parameters": count_parameters(student),
        "target_parameters": count_parameters(target),
        **result.summary_fields(),
        "val_loss": round(final["val_loss"], 4),
        "target_val_loss": round(final["target_val_loss"], 4),
        "greedy_agreement": round(final["agreement"], 4),
        "val_tokens": int(val[:, 1:].numel()),
        "config": config_to_dict(config),
    }
    export_model(student, target_dir, out_dir, summary)
    return summary


__all__ = ["DistillConfig", "greedy_agreement", "kl_loss", "train_distill"]
