"""Train MTP modules on a frozen trunk (``specdec train mtp`` on any target whose tokenizer is not the zoo's).

The zoo's MTP variant continues the whole target with its modules (selfspec.py). A real target stays
as it is: only DeepSeek-V3-style sequential modules (models/mtp.py ``MtpNet``) learn, from the feature
cache the target's other drafters share (module 1 reads the final-normed state the cache always keeps;
the target's distributions are that state times the head). Module k at index i reads token i + k and
the previous depth's output at i and is scored by soft cross-entropy to the target's distribution of
token i + k + 1, module k weighted 0.8^(k-1). Modules start as copies of the target's last layer.

The folder holds the modules alone (``model.layers.{L + k - 1}.*``, as DeepSeek-V3 names them), with
the target's config.json entries that describe them and the target record; the ``mtp`` drafter reads it
beside the unchanged target (``MTP(modules=DIR)``; bench: ``--drafters mtp``). Kept apart because the
135M trunk would not fit the size budget of committed drafters, and need not: it is the target.

A run continued from a folder with a draft vocabulary (``specdec train draft-vocab``) scores the drafts over
those rows of the target's head, as the drafter then drafts, the target's distribution taken over the same rows.

The offline metric is exact for the first draft (module 1 from each anchor, on held-out greedy
continuations): accept_1 and tau_k1. Deeper drafts reuse modules on their own outputs, which a
teacher-forced pass cannot reproduce; ``specdec bench`` measures them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specdec.drafters.base import read_draft_vocabulary
from specdec.errors import SpecdecError
from specdec.models import mtp
from specdec.train import config as train_config
from specdec.train.config import config_to_dict
from specdec.train.features import (TINY_DATA, DataRecipe, acceptance_summary, anchor_mask, carried_vocabulary,
                                    prepare_run, shifted, soft_cross_entropy)
from specdec.train.loop import OptimConfig


class MtpTrainError(SpecdecError):
    pass


@dataclass(frozen=True)
class MtpShape:
    depth: int = 1


@dataclass(frozen=True)
class MtpTrainConfig(DataRecipe):
    shape: MtpShape = field(default_factory=MtpShape)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=300, lr=1e-3, warmup_steps=20,
                                                                   eval_every=75, ckpt_every_steps=20, bfloat16=True))
    decay: float = 0.8
    init_from_target: bool = True   # every module starts as a copy of the target's last layer and final norm
    init_from: str = ""             # a folder of modules trained beside this target to continue (its depth wins)


PRESETS: dict[str, MtpTrainConfig] = {
    # SmolLM2-135M-Instruct: one module (4.2M parameters) on the ShareGPT text and feature cache of EAGLE-1,
    # Medusa and the draft model; sized for about 30 minutes on 2 cores. Started at random: after 12 steps
    # its first draft was accepted 0.12 against 0.06 for a copy of the last layer (whose first loss is 21.7,
    # against 14.9), and EAGLE-1, the same shape at random, reached 0.37 with this learning rate.
    "mtp-sharegpt": MtpTrainConfig(batch_size=8, train_sequences=1536, heldout_sequences=48, prefix_len=256,
                                   generated_len=256, source="sharegpt", init_from_target=False,
                                   optim=OptimConfig(steps=300, lr=2e-3, warmup_steps=20, eval_every=75,
                                                     ckpt_every_steps=20, bfloat16=True)),
    "tiny": MtpTrainConfig(shape=MtpShape(depth=2), optim=OptimConfig(steps=8, lr=3e-3, warmup_steps=2, eval_every=4,
                                                                     ckpt_every_steps=4), **TINY_DATA),
}


def load_config(path: str | None, preset: str) -> MtpTrainConfig:
    return train_config.load_config(MtpTrainConfig, PRESETS, path, preset, "MTP training")


def config_from_dict(values: dict[str, Any]) -> MtpTrainConfig:
    return train_config.config_from_dict(MtpTrainConfig, values, "MTP training")


class Objective:
    def __init__(self, config: MtpTrainConfig, frozen, final_layer: int, rows: torch.Tensor | None = None):
        """rows: the target ids the drafts are scored over (a draft vocabulary), None: the whole head."""
        self.config, self.frozen, self.layers, self.rows = config, frozen, (final_layer,), rows
        self.head = frozen.head_rows(rows)

    def outputs(self, net: mtp.MtpNet, tokens: torch.Tensor, final: torch.Tensor) -> list[torch.Tensor]:
        """Module k's normed output at every index i [B, T, H] (predicting token i + k + 1)."""
        batch, length = tokens.shape
        positions = torch.arange(length)[None].expand(batch, -1)
        previous, outs = final, []
        for k, module in enumerate(net.modules_, 1):
            following = shifted(tokens, k, length)                       # token i + k
            previous = module(F.embedding(following, self.frozen.embed), previous, positions + k)
            outs.append(previous)
        return outs

    def loss(self, net: mtp.MtpNet, batch) -> torch.Tensor:
        tokens, valid = batch
        final, logits = self.frozen.run(tokens, valid, self.layers, rows=self.rows)  # [B, T, H], [B, T, V or rows]
        length, total = tokens.shape[1], 0.0
        for k, out in enumerate(self.outputs(net, tokens, final), 1):
            target = shifted(logits, k, length)                          # the target's distribution of i + k + 1
            mask = shifted(valid, k, length, False)
            total = total + self.config.decay ** (k - 1) * soft_cross_entropy(out @ self.head.t(), target, mask)
        return total

    @torch.no_grad()
    def evaluate(self, net: mtp.MtpNet, held) -> dict[str, float]:
        net.eval()
        accepted = []
        for start in range(0, held.tokens.shape[0], 8):
            rows = torch.arange(start, min(start + 8, held.tokens.shape[0]))
            tokens, valid = held.batch(rows)
            final, _, choice = self.frozen.run(tokens, valid, self.layers, rows=tokens.new_zeros(0), choice=True)
            first = (self.outputs(net, tokens, final)[0] @ self.head.t()).argmax(-1)
            if self.rows is not None:
                first = self.rows[first]
            pairs = tokens.shape[1] - 1
            drafts = first[:, :pairs]                                    # from anchor t: token t + 2
            truth = shifted(choice, 1, pairs, -1)
            anchors = anchor_mask(valid, held.prompt_len[rows], pairs, 1)
            accepted.append((drafts == truth).long()[anchors])
        net.train()
        return acceptance_summary(torch.cat(accepted), 1)


def train_mtp(config: MtpTrainConfig, target_dir: Path, out_dir: Path, *, ckpt_dir: Path | None = None,
              resume: bool = False, max_minutes: float | None = None, log: Callable[[str], None] | None = None,
              data_dir: Path | None = None, data_only: bool = False) -> dict[str, Any]:
    """Train (or resume) MTP modules for the frozen target in ``target_dir``; save them to ``out_dir``."""
    from specdec.models.eagle import TargetRecord
    from specdec.models.files import save_folder

    out_dir, target_dir = Path(out_dir), Path(target_dir)
    # the folder to continue, read before the data are built (a wrong one is refused at once); its depth goes
    # into the run's configuration, which a resumed run (weights from the checkpoint) rebuilds the modules from
    source = modules_to_continue(config.init_from) if config.init_from and not resume else None
    if source is not None:
        config = replace(config, shape=replace(config.shape, depth=source[1].config.depth))
    run = prepare_run("mtp", config, target_dir, out_dir, ckpt_dir, resume, config_from_dict, log, data_dir,
                      data_only)
    config, target = run.config, run.target
    torch.manual_seed(config.seed)
    shape = mtp.MtpConfig.of(target.config, "sequential", config.shape.depth)
    net = fitted(source, config.init_from, shape, target) if source is not None else mtp.MtpNet(shape)
    frozen = run.frozen((target.num_layers,))
    if config.init_from_target and not config.init_from and not resume:
        net.init_from_main(frozen.model)
    rows = read_draft_vocabulary(config.init_from, target.vocab_size) if config.init_from else None
    if rows is not None:
        run.log(f"[mtp] drafts scored over the {rows.numel():,} rows of the draft vocabulary of {config.init_from}")
    result, final, useless = run.fit(net, Objective(config, frozen, target.num_layers, rows), "mtp", 43, resume,
                                       max_minutes, "tau_k1", "MTP")
    summary = {
        "kind": "mtp", "design": "sequential", "depth": shape.depth, "frozen_trunk": True,
        "parameters": sum(p.numel() for p in net.parameters()), **result.summary_fields(), **run.data_fields(),
        "offline": {key: round(value, 4) for key, value in final.items()}, "low_acceptance_warning": useless,
        "config": config_to_dict(config),
    }
    folder_config = {**json.loads((target_dir / "config.json").read_text()), **shape.config_entries(),
                     mtp.MODULES_KEY: asdict(TargetRecord.of(target))}
    save_folder(out_dir, folder_config, "model.safetensors", net.tensors(), torch.bfloat16,
                extra={"training_summary.json": json.dumps(summary, indent=2) + "\n",
                       **carried_vocabulary(config.init_from, run.log, "mtp")})
    return summary


def modules_to_continue(folder: str):
    """(target record, modules in float32) of a folder of sequential modules trained beside a target; one line
    when it holds none."""
    from specdec.drafters.mtp import modules_record

    record, shape = modules_record(folder)
    if shape is None or shape.design != "sequential":
        raise MtpTrainError(f"{folder} holds no sequential MTP modules to continue")
    return record, mtp.read_mtp(folder)


def fitted(source, folder: str, shape: mtp.MtpConfig, target) -> mtp.MtpNet:
    """``source``'s modules (modules_to_continue), ready to train on, when they have this run's ``shape`` and
    were made for ``target``; one line when they were made for another."""
    record, net = source
    if net.config != shape:
        raise MtpTrainError(f"{folder} holds MTP modules for another target's shapes than this one")
    warning = record.check(target, f"the MTP modules in {folder}", net.config.hidden_size, target.vocab_size)
    if warning:
        raise MtpTrainError(warning)
    return net.train()


__all__ = ["MtpTrainConfig", "PRESETS", "load_config", "train_mtp"]
