"""The one training loop shared by target pre-training and draft distillation.

It owns what both need: AdamW with linear warmup and cosine decay, gradient
clipping, a tqdm bar with loss and tokens/s, periodic validation, atomic
checkpoints (every N steps or M minutes), resumption, and a wall-clock budget.
Callers supply ``batch_fn(step)`` (a pure function of the step, so the step is
the data position) and ``loss_fn(model, batch)``.
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from specdec.errors import SpecdecError

_CKPT_PATTERN = re.compile(r"^checkpoint-(\d{8})\.pt$")
_KEEP_CHECKPOINTS = 2


class CheckpointError(SpecdecError):
    """Checkpoints are missing, unreadable, or from an incompatible run."""


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer, schedule and checkpoint cadence; shared by both trainers."""

    steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    ckpt_every_steps: int = 200
    ckpt_every_minutes: float = 5.0
    bfloat16: bool = False   # forward and backward under bfloat16 autocast (weights and optimizer stay float32),
                             # on CPUs with bfloat16 dot products (AVX512-BF16, AMX); float32 elsewhere


@dataclass
class LoopResult:
    """What a (possibly partial) run reached."""

    step: int
    completed: bool
    train_seconds: float
    tokens_seen: int
    history: list[dict[str, float]] = field(default_factory=list)

    def summary_fields(self) -> dict[str, Any]:
        """Steps, completion, time and throughput, as both trainers' summaries report them."""
        return {
            "steps": self.step,
            "completed": self.completed,
            "train_minutes": round(self.train_seconds / 60, 2),
            "tokens_seen": self.tokens_seen,
            "tokens_per_second": round(self.tokens_seen / max(self.train_seconds, 1e-9), 1),
        }


def lr_factor(step: int, config: OptimConfig) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, config: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without decay on norms/biases, plus the warmup-cosine scheduler."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, config.beta2),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    return optimizer, scheduler


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint files in ``ckpt_dir``, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if _CKPT_PATTERN.match(p.name))


def save_checkpoint(ckpt_dir: Path, state: dict[str, Any]) -> Path:
    """Write a checkpoint atomically, then prune all but the newest few."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"checkpoint-{state['step']:08d}.pt"
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=ckpt_dir)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in list_checkpoints(ckpt_dir)[:-_KEEP_CHECKPOINTS]:
        old.unlink()
    return final


def load_latest_checkpoint(ckpt_dir: Path) -> dict[str, Any]:
    """The newest checkpoint's state dict; raises CheckpointError if there is none."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise CheckpointError(f"no checkpoint to resume from in {ckpt_dir}")
    try:
        return torch.load(found[-1], map_location="cpu", weights_only=False)
    except Exception as exc:  # a torn file cannot exist (atomic writes), but be clear if it does
        raise CheckpointError(f"cannot read checkpoint {found[-1]}: {exc}") from exc


def run_folders(out_dir: Path, ckpt_dir: Path | None, resume: bool, kind: str, config, from_dict: Callable):
    """(checkpoint folder, configuration) of a run: OUT/checkpoints unless given; on resume the
    configuration stored in the newest checkpoint (under ``kind``), never the one passed in."""
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else Path(out_dir) / "checkpoints"
    if resume:
        config = from_dict(load_latest_checkpoint(ckpt_dir)["run_config"][kind])
    return ckpt_dir, config


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def same_run(saved, current) -> bool:
    """Whether a checkpoint's run configuration is the current one. A key the checkpoint lacks is a
    setting added to specdec after it was written; resuming took its default, so it matches."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return set(saved) <= set(current) and all(same_run(saved[key], current[key]) for key in saved)
    return saved == current


def run_loop(
    *,
    model: torch.nn.Module,
    config: OptimConfig,
    batch_fn: Callable[[int], Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    tokens_in: Callable[[Any], int],
    eval_fn: Callable[[torch.nn.Module], dict[str, float]],
    ckpt_dir: Path,
    run_config: dict[str, Any],
    resume: bool = False,
    max_minutes: float | None = None,
    desc: str = "train",
    log: Callable[[str], None] | None = None,
) -> LoopResult:
    """Train ``model`` in place up to ``config.steps``; returns where it stopped.

    ``run_config`` is stored in every checkpoint and must match on resume, so a
    run can never silently continue with a different shape or data recipe.
    """
    log = log or (lambda message: tqdm.write(message))
    from specdec.models.kernels import fast_bfloat16

    autocast = config.bfloat16 and fast_bfloat16()
    if config.bfloat16 and not autocast:
        log(f"[{desc}] bfloat16 autocast off: this CPU has no bfloat16 dot products (float32 is faster here)")
    optimizer, scheduler = make_optimizer(model, config)
    start_step, train_seconds, tokens_seen, history = 0, 0.0, 0, []
    if resume:
        state = load_latest_checkpoint(ckpt_dir)
        if not same_run(state["run_config"], run_config):
            raise CheckpointError(f"checkpoint in {ckpt_dir} was made with a different configuration; use a new --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        start_step = state["data_step"]
        train_seconds, tokens_seen, history = state["train_seconds"], state["tokens_seen"], state["history"]
        log(f"[{desc}] resumed from step {start_step} ({list_checkpoints(ckpt_dir)[-1].name})")
    elif list_checkpoints(ckpt_dir):
        raise CheckpointError(f"checkpoints already exist in {ckpt_dir}; pass --resume or choose another --out")

    def checkpoint(step: int) -> None:
        save_checkpoint(
            ckpt_dir,
            {
                "step": step,
                "data_step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": _rng_state(),
                "run_config": run_config,
                "train_seconds": train_seconds,
                "tokens_seen": tokens_seen,
                "history": history,
            },
        )

    wall_start = time.monotonic()
    last_ckpt_time, last_ckpt_step = wall_start, start_step
    step = start_step
    model.train()
    bar = tqdm(
        total=config.steps,
        initial=start_step,
        desc=desc,
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 30.0,
        file=sys.stderr,
    )
    smooth_loss = None
    stopped_early = False
    try:
        while step < config.steps:
            if max_minutes is not None and time.monotonic() - wall_start >= max_minutes * 60:
                stopped_early = True
                log(f"[{desc}] time budget of {max_minutes} min reached at step {step}")
                break
            batch = batch_fn(step)
            t0 = time.monotonic()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            scheduler.step()
            elapsed = time.monotonic() - t0
            step += 1
            train_seconds += elapsed
            n_tokens = tokens_in(batch)
            tokens_seen += n_tokens
            value = float(loss.detach())
            smooth_loss = value if smooth_loss is None else 0.9 * smooth_loss + 0.1 * value
            bar.update(1)
            bar.set_postfix(loss=f"{smooth_loss:.3f}", tok_s=f"{n_tokens / max(elapsed, 1e-9):.0f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", refresh=False)
            record: dict[str, float] = {"step": step, "loss": value, "lr": scheduler.get_last_lr()[0]}
            if step % config.eval_every == 0 or step == config.steps:
                metrics = eval_fn(model)
                model.train()
                record.update(metrics)
                log(f"[{desc}] step {step}: train loss {smooth_loss:.4f} " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
                    + f" ({tokens_seen / max(train_seconds, 1e-9):.0f} tok/s)")
            history.append(record)
            now = time.monotonic()
            if (step - last_ckpt_step >= config.ckpt_every_steps
                    or now - last_ckpt_time >= config.ckpt_every_minutes * 60 or step == config.steps):
                checkpoint(step)
                last_ckpt_time, last_ckpt_step = now, step
    except KeyboardInterrupt:
        stopped_early = True
        log(f"[{desc}] interrupted at step {step}; saving a checkpoint")
    finally:
        bar.close()
    if step != last_ckpt_step or (stopped_early and not list_checkpoints(ckpt_dir)):
        checkpoint(step)
    return LoopResult(step=step, completed=step >= config.steps, train_seconds=train_seconds, tokens_seen=tokens_seen, history=history)


def optim_from_dict(values: dict[str, Any]) -> OptimConfig:
    """OptimConfig from a JSON object, rejecting unknown keys."""
    known = set(asdict(OptimConfig()))
    unknown = set(values) - known
    if unknown:
        raise SpecdecError(f"unknown optimizer settings: {', '.join(sorted(unknown))}")
    return OptimConfig(**values)
