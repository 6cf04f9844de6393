"""``specdec zoo build``: corpus -> tokenizer -> target -> distilled draft -> Medusa, EAGLE-1, EAGLE-3
and DFlash drafters for the target -> its LayerSkip and MTP variants -> task sets.

Every stage is deterministic given the interpreter's stdlib and the seeds in the
presets. Checkpoints live in a work dir (not in the zoo), so an interrupted
build can continue with ``--resume``; without it the work dir's checkpoints are
discarded and the build starts from scratch.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec.train import distill, target
from specdec.train.methods import drafter_training
from specdec.train.loop import list_checkpoints
from specdec.zoo import corpus, data_dir, tasks
from specdec.zoo import tokenizer as zoo_tokenizer


SELF_DRAFTING = {  # zoo folder -> the self-speculation training that makes it (from the target)
    "layerskip": {"method": "layerskip", "optim": {"steps": 800}},
    "mtp": {"method": "mtp", "design": "sequential", "depth": 3, "optim": {"steps": 800}},
    "mtp-parallel": {"method": "mtp", "design": "parallel", "depth": 3, "optim": {"steps": 600}},
}


def build_zoo(
    out: Path | None = None,
    *,
    work_dir: Path = Path("runs/zoo-build"),
    target_minutes: float | None = None,
    distill_minutes: float | None = None,
    drafter_minutes: float | None = None,
    preset: str = "zoo",
    resume: bool = False,
) -> dict[str, Any]:
    """Build the whole zoo into ``out`` (default: the package's zoo/data); returns a summary."""
    out = Path(out) if out is not None else data_dir()
    work_dir = Path(work_dir)
    target_ckpt, draft_ckpt = work_dir / "target-checkpoints", work_dir / "draft-checkpoints"
    drafter_ckpts = {name: work_dir / f"{name}-checkpoints" for name in ("medusa", "eagle", "eagle3", "dflash")}
    if not resume:
        for folder in (target_ckpt, draft_ckpt, *drafter_ckpts.values()):
            shutil.rmtree(folder, ignore_errors=True)
    started = time.monotonic()
    timings: dict[str, float] = {}

    tokenizer_dir = out / "tokenizer"
    if not (resume and (tokenizer_dir / "tokenizer.json").is_file()):
        zoo_tokenizer.save_tokenizer(zoo_tokenizer.train_tokenizer(corpus.read_split("train")), tokenizer_dir)
    timings["tokenizer_minutes"] = (time.monotonic() - started) / 60

    stage = time.monotonic()
    target_summary = target.train_target(
        target.load_config(None, preset), out / "target", tokenizer_dir, ckpt_dir=target_ckpt,
        resume=resume and bool(list_checkpoints(target_ckpt)), max_minutes=target_minutes,
    )
    timings["target_minutes"] = (time.monotonic() - stage) / 60

    stage = time.monotonic()
    draft_summary = distill.train_distill(
        distill.load_config(None, preset), out / "target", out / "draft", ckpt_dir=draft_ckpt,
        resume=resume and bool(list_checkpoints(draft_ckpt)), max_minutes=distill_minutes,
    )
    timings["distill_minutes"] = (time.monotonic() - stage) / 60

    offline = {}
    for name, ckpt in drafter_ckpts.items():  # the drafters that read the target's features
        stage = time.monotonic()
        config, train = drafter_training(name, None, name if preset == "zoo" else preset)
        summary = train(config, out / "target", out / name, ckpt_dir=ckpt, resume=resume and bool(list_checkpoints(ckpt)),
                        max_minutes=drafter_minutes)
        offline[name] = summary["offline"]
        timings[f"{name}_minutes"] = (time.monotonic() - stage) / 60

    from specdec.train import selfspec

    variants = {}
    for name, changes in SELF_DRAFTING.items():  # the target trained further to draft for itself
        stage = time.monotonic()
        ckpt = work_dir / f"{name}-checkpoints"
        if not resume:
            shutil.rmtree(ckpt, ignore_errors=True)
        base = asdict(selfspec.PRESETS["tiny" if preset == "tiny" else changes["method"]])
        values = {**base, **{key: value for key, value in changes.items() if key != "optim"}}
        if preset != "tiny":  # a tiny build keeps the tiny schedule
            values["optim"] = {**base["optim"], **changes.get("optim", {})}
        config = selfspec.config_from_dict(values)
        summary = selfspec.train_selfspec(config, out / "target", out / name, ckpt_dir=ckpt,
                                          resume=resume and bool(list_checkpoints(ckpt)), max_minutes=drafter_minutes)
        variants[name] = summary["validation"]
        timings[f"{name}_minutes"] = (time.monotonic() - stage) / 60

    counts = tasks.write_task_sets(out / "tasks", tokenizer_dir)
    timings["total_minutes"] = (time.monotonic() - started) / 60
    return {
        "target_val_loss": target_summary["val_loss"],
        "draft_val_loss": draft_summary["val_loss"],
        "greedy_agreement": draft_summary["greedy_agreement"],
        "target_parameters": target_summary["parameters"],
        "draft_parameters": draft_summary["parameters"],
        "tasks": counts,
        "drafters_offline": offline,
        "variants_validation": variants,
        **{k: round(v, 2) for k, v in timings.items()},
    }
