"""Train a DFlash drafter against a frozen target (the objective; the loop is loop.py).

* Data: the target's own continuations of train-split prompts (features.py), features computed on
  the fly by the frozen target.
* Anchors: up to ``anchors`` positions per sequence, drawn uniformly without replacement among
  generated positions whose next token exists (as at inference, where the anchor is the last token
  the target committed); a pure function of the step, so ``--resume`` is bit-identical.
* One pass trains every block of a sequence: the block-sparse mask lets block n see the context
  strictly before its anchor (the anchor's own features do not exist yet at inference) and its own
  block, nothing else (``dflash.block_attention``).
* Loss: slot k of a block (k = 1..B-1) learns the target's distribution of token anchor + k (soft
  cross-entropy to the frozen target's logits at anchor + k - 1), weighted exp(-(k - 1) / gamma):
  one early mistake invalidates the rest of the block, so early slots count more.
* The offline metric: every generated position of the held-out greedy continuations drafts a
  block exactly as inference does (the same one-pass mask is the inference pattern), for each block
  size; ``walk`` turns the per-position acceptance into the tau a generation would measure.
* An optional second phase (``long_context``) continues on long sequences: the target's
  continuations of long train-split windows, since drafters trained on short contexts lose
  acceptance on long ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specdec.drafters.base import read_draft_vocabulary
from specdec.errors import SpecdecError
from specdec.models import dflash
from specdec.train import config as train_config
from specdec.train import data
from specdec.train.config import config_to_dict
from specdec.train.features import (TINY_DATA, DataRecipe, FrozenTarget, acceptance_summary, carried_vocabulary,
                                    leading_matches, prepare_run, warn_if_useless)
from specdec.train.loop import OptimConfig, run_loop


class DFlashTrainError(SpecdecError):
    pass


@dataclass(frozen=True)
class DFlashShape:
    layers: int = 3
    block_size: int = 16
    target_features: int = 3      # target layers fused (spread shallow to deep)
    intermediate: int = 0         # 0: the target's intermediate size
    target_layers: tuple[int, ...] = ()  # 0-based target layers read; () = target_features spread out


@dataclass(frozen=True)
class DFlashTrainConfig(DataRecipe):
    shape: DFlashShape = field(default_factory=DFlashShape)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=1500, lr=2e-3, warmup_steps=60,
                                                                   eval_every=250, ckpt_every_steps=100))
    anchors: int = 32             # blocks per training sequence
    gamma: float = 7.0            # slot weight exp(-(k - 1) / gamma); 0 = uniform
    eval_blocks: tuple[int, ...] = (4, 8, 16)
    init_from: str = ""           # a DFlash folder to continue (the long-context phase); its shape wins


PRESETS: dict[str, DFlashTrainConfig] = {
    "dflash": DFlashTrainConfig(),
    # The second phase: the target's continuations of long train-split windows (about the zoo's
    # long-context prompts), fewer sequences per step for the same tokens, a lower learning rate.
    "dflash-long": DFlashTrainConfig(batch_size=2, train_sequences=256, prefix_len=960, generated_len=64,
                                     generation_batch=16, optim=OptimConfig(steps=300, lr=5e-4, warmup_steps=20,
                                                                            eval_every=100, ckpt_every_steps=50)),
    # A real chat target (SmolLM2-135M-Instruct): the ShareGPT text with the target's distributions as
    # labels, reading the layers EAGLE-3's preset reads, so both train from one feature cache
    # (--data-dir); two layers, blocks of 8, sized for about an hour on 2 cores.
    "dflash-sharegpt": DFlashTrainConfig(shape=DFlashShape(layers=2, block_size=8, target_layers=(1, 14, 26)),
                                         batch_size=8, train_sequences=1536, heldout_sequences=48, prefix_len=256,
                                         generated_len=256, source="sharegpt", anchors=32, gamma=4.0,
                                         optim=OptimConfig(steps=400, lr=2e-3, warmup_steps=30, eval_every=100,
                                                           ckpt_every_steps=20, bfloat16=True)),
    "tiny": DFlashTrainConfig(shape=DFlashShape(layers=1, block_size=4, target_features=2),
                              optim=OptimConfig(steps=12, lr=3e-3, warmup_steps=2, eval_every=6, ckpt_every_steps=4),
                              anchors=4, eval_blocks=(2, 4), **TINY_DATA),
}


def load_config(path: str | None, preset: str) -> DFlashTrainConfig:
    return train_config.load_config(DFlashTrainConfig, PRESETS, path, preset, "DFlash training")


def config_from_dict(values: dict[str, Any]) -> DFlashTrainConfig:
    config = train_config.config_from_dict(DFlashTrainConfig, values, "DFlash training")
    return replace(config, eval_blocks=tuple(config.eval_blocks),
                   shape=replace(config.shape, target_layers=tuple(config.shape.target_layers)))


def mask_token_for(target) -> int:
    """A row of the target's embedding that never occurs inside a text: its pad token when that is
    not also EOS, else the last row."""
    pad = target.pad_token_id
    if 0 <= pad < target.vocab_size and pad not in (target.eos_token_ids or []):
        return int(pad)
    return int(target.vocab_size) - 1


def sample_anchors(valid: torch.Tensor, prompt_len: torch.Tensor, count: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [b, N] sorted, anchor_valid [b, N]): up to ``count`` positions a per row, uniformly
    without replacement, with a generated (prompt_len <= a) and its next token present (a + 1 < length)."""
    lengths = valid.sum(1, keepdim=True)
    index = torch.arange(valid.shape[1])[None, :]
    candidate = (index >= prompt_len.reshape(-1, 1)) & (index + 1 < lengths)
    scores = torch.rand(valid.shape, generator=generator).masked_fill(~candidate, -1.0)
    count = min(count, valid.shape[1])
    top, picked = scores.topk(count, dim=1)
    ok = top >= 0
    anchors = torch.where(ok, picked, valid.shape[1])  # invalid ones sort last
    anchors, order = anchors.sort(dim=1)
    ok = ok.gather(1, order)
    return anchors.masked_fill(~ok, 0), ok


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weight of each block slot: 0 for the anchor, exp(-(k - 1) / gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma) if gamma > 0 else torch.ones(block_size)
    weights[0] = 0.0
    return weights


class Objective:
    """Loss and offline metric of DFlash, given the frozen target. With ``rows`` (the draft vocabulary a
    continued folder drafts from: its target ids) the drafts are scored over those rows of the target's
    head only, as the drafter then drafts, and the loss takes the target's distribution over them: a sixth
    of the head's products for an 8,192-token vocabulary of 49,152."""

    def __init__(self, config: DFlashTrainConfig, frozen: FrozenTarget, net_config: dflash.DFlashConfig,
                 rows: torch.Tensor | None = None):
        self.config, self.frozen, self.net_config, self.rows = config, frozen, net_config, rows
        self.layers = net_config.hidden_layers()
        self.head = frozen.head_rows(rows)

    def ids(self, index: torch.Tensor) -> torch.Tensor:
        """Target ids of indices into the scored rows."""
        return index if self.rows is None else self.rows[index]

    def outputs(self, net: dflash.DFlashNet, tokens, valid, anchors, block_size: int, at: torch.Tensor | None = None):
        """(draft logits [b, N, B-1, V] over the scored rows, the target's logits over the same rows at
        positions ``at`` [b, M] as [b, M, V], or None without ``at``) of every block at ``anchors``."""
        features, logits = self.frozen.run(tokens, valid, self.layers, at=at if at is not None else anchors[:, :0],
                                           rows=self.rows)
        ids = dflash.block_inputs(tokens, anchors, block_size, self.net_config.mask_token_id)
        out = net.blocks(features, F.embedding(ids, self.frozen.embed), anchors)
        return out[:, :, 1:] @ self.head.t(), (logits if at is not None else None)

    def loss(self, net: dflash.DFlashNet, batch) -> torch.Tensor:
        tokens, valid, anchors, ok = batch
        size = self.net_config.block_size
        slots = torch.arange(1, size)
        source = anchors[:, :, None] + slots - 1                                 # logits predicting anchor + k
        exists = (source + 1 < valid.sum(1)[:, None, None]) & ok[:, :, None]    # [b, N, B-1]
        b, n, _ = source.shape
        at = source.clamp(max=tokens.shape[1] - 1).reshape(b, -1)
        draft, target = self.outputs(net, tokens, valid, anchors, size, at)     # [b, N, B-1, V], [b, N (B-1), V]
        target = target.view(b, n, size - 1, -1)
        ce = -(torch.softmax(target, -1) * torch.log_softmax(draft, -1)).sum(-1)  # [b, N, B-1]
        weight = slot_weights(size, self.config.gamma)[1:] * exists.float()
        return (ce * weight).sum() / weight.sum().clamp(min=1e-9)

    @torch.no_grad()
    def evaluate(self, net: dflash.DFlashNet, held, blocks: tuple[int, ...] | None = None) -> dict[str, float]:
        """Offline acceptance on held-out greedy continuations: a block drafted at every generated
        position, for each block size; keys ``b{B}_tau`` (predicted tau of that block),
        ``accept_{j}`` (the trained block's P(first j accepted)) and ``tau_k{k}``."""
        net.eval()
        blocks = tuple(b for b in (blocks or self.config.eval_blocks) if 2 <= b <= self.net_config.block_size)
        largest = max(blocks)
        out: dict[str, float] = {}
        for size in blocks:
            accepted, walks = [], []
            for start in range(0, held.tokens.shape[0], 4):
                rows = torch.arange(start, min(start + 4, held.tokens.shape[0]))
                tokens, valid = held.batch(rows)
                prompt_len = held.prompt_len[rows]
                length = tokens.shape[1]
                generated = int((held.lengths[rows] - prompt_len).max())
                anchors = (prompt_len[:, None] + torch.arange(generated)).clamp(max=length - 1)  # generated positions
                ok = anchors + 1 < valid.sum(1, keepdim=True)
                draft, _ = self.outputs(net, tokens, valid, anchors, size)
                guess = self.ids(draft.argmax(-1))                                 # [b, N, B-1]
                label = anchors[:, :, None] + torch.arange(1, size)
                truth = tokens.gather(1, label.clamp(max=length - 1).reshape(len(rows), -1)).view_as(guess)
                real = label < valid.sum(1)[:, None, None]
                counts = leading_matches((guess == truth) & real) * ok             # [b, N] per anchor
                accepted.append(counts[ok])
                for i, row in enumerate(rows):
                    # walk's index t is the last feature's position: anchor t + 1
                    per_t = counts.new_zeros(length)
                    per_t[anchors[i] - 1] = counts[i]
                    walks.append((per_t, int(prompt_len[i]) - 1, int(held.lengths[row])))
            summary = acceptance_summary(torch.cat(accepted), size - 1, walks)
            out[f"b{size}_tau"] = summary[f"tau_k{size - 1}"]
            if size == largest:
                out.update(summary)
        return out


def batch_maker(run, salt: int):
    """Batches (tokens, valid, anchors, anchor_valid) as a pure function of the step."""
    config = run.config

    def batch_for(step: int):
        generator = data.step_generator(config.seed, step, salt=salt)
        rows = torch.randint(0, run.train.tokens.shape[0], (config.batch_size,), generator=generator)
        tokens, valid = run.train.batch(rows)
        anchors, ok = sample_anchors(valid, run.train.prompt_len[rows], config.anchors, generator)
        return tokens, valid, anchors, ok
    return batch_for


def train_dflash(config: DFlashTrainConfig, target_dir: Path, out_dir: Path, *, ckpt_dir: Path | None = None,
                 resume: bool = False, max_minutes: float | None = None,
                 log: Callable[[str], None] | None = None, data_dir: Path | None = None,
                 data_only: bool = False) -> dict[str, Any]:
    """Train (or resume) a DFlash drafter for the target in ``target_dir``; save it to ``out_dir``."""
    return train_blocks(DFLASH, config, target_dir, out_dir, ckpt_dir=ckpt_dir, resume=resume,
                        max_minutes=max_minutes, log=log, data_dir=data_dir, data_only=data_only)


@dataclass(frozen=True)
class BlockMethod:
    """What a block drafter's training run needs of its method (DFlash, DSpark): one run, two networks."""

    kind: str
    model: Any                 # the models module: load_net, save
    config_class: Any          # its network's config (for_target)
    network: Any               # its network class
    objective: Any             # Objective class
    from_dict: Callable
    config_options: Callable   # train config -> extra keyword arguments of config_class.for_target
    finish: Callable | None = None  # (net, objective, held, log) -> (summary fields, config changes) after training
    normalized: bool = False   # its loss takes the target's probabilities over the draft vocabulary's rows


DFLASH = BlockMethod("dflash", dflash, dflash.DFlashConfig, dflash.DFlashNet, Objective, config_from_dict, lambda config: {})


def train_blocks(method: BlockMethod, config, target_dir: Path, out_dir: Path, *, ckpt_dir: Path | None = None,
                 resume: bool = False, max_minutes: float | None = None,
                 log: Callable[[str], None] | None = None, data_dir: Path | None = None,
                 data_only: bool = False) -> dict[str, Any]:
    """Train (or resume) a block drafter of ``method`` for the target in ``target_dir``; save it to ``out_dir``."""
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    kind, model = method.kind, method.model
    run = prepare_run(kind, config, target_dir, out_dir, ckpt_dir, resume, method.from_dict, log, data_dir, data_only)
    config, target, held, log = run.config, run.target, run.held, run.log
    shape = config.shape
    if shape.layers < 1 or shape.block_size < 2 or shape.target_features < 1:
        raise DFlashTrainError(f"a {kind} drafter needs >= 1 layer, block size >= 2 and >= 1 target feature, got "
                               f"{shape.layers}, {shape.block_size}, {shape.target_features}")
    torch.manual_seed(config.seed)
    if config.init_from:
        net = model.load_net(config.init_from)
        warning = net.config.target.check(target, f"the {kind} drafter in {config.init_from}", net.config.hidden_size,
                                          net.config.vocab_size, net.config.hidden_layers())
        if warning:
            raise DFlashTrainError(warning)
        net_config = replace(net.config, target=dflash.TargetRecord.of(target), training={})
        net.config = net_config
        net.train()
    else:
        net_config = method.config_class.for_target(target, shape.layers, shape.block_size, mask_token_for(target),
                                                    target_layer_ids=tuple(shape.target_layers) or None,
                                                    num_target_features=shape.target_features,
                                                    intermediate_size=shape.intermediate or None,
                                                    **method.config_options(config))
        net = method.network(net_config)
    frozen = run.frozen(net_config.hidden_layers())
    rows = read_draft_vocabulary(config.init_from, net_config.vocab_size) if config.init_from else None
    if rows is not None:
        log(f"[{kind}] drafts scored over the {rows.numel():,} rows of the draft vocabulary of {config.init_from}")
    if method.normalized and rows is not None and frozen.cache is not None:
        frozen.cache.normalizers(frozen.head, log)  # those rows' logits, then, not the whole vocabulary's
    objective = method.objective(config, frozen, net_config, rows)
    run_config = {"kind": kind, kind: config_to_dict(config), "target": target.fingerprint()}
    result = run_loop(model=net, config=config.optim, batch_fn=batch_maker(run, salt=31), loss_fn=objective.loss,
                      tokens_in=lambda batch: int(batch[3].sum()) * net_config.block_size,
                      eval_fn=lambda m: objective.evaluate(m, held, (net_config.block_size,)), ckpt_dir=run.ckpt_dir,
                      run_config=run_config, resume=resume, max_minutes=max_minutes, desc=kind, log=log)
    from specdec.train.target import round_to_export_dtype_

    round_to_export_dtype_(net)
    final = objective.evaluate(net, held)
    largest = max(b for b in config.eval_blocks if b <= net_config.block_size)
    useless = warn_if_useless(final, f"b{largest}_tau", log, kind)
    extra, changes = method.finish(net, objective, held, log) if method.finish else ({}, {})
    summary = {
        "kind": kind, "parameters": sum(p.numel() for p in net.parameters()), **result.summary_fields(),
        **run.data_fields(),
        "initialised_from": config.init_from or None, "mask_token_id": net_config.mask_token_id,
        "target_layer_ids": list(net_config.target_layer_ids),
        "offline": {k: round(v, 4) for k, v in final.items()}, "low_acceptance_warning": useless, **extra,
        "history": result.history, "config": config_to_dict(config),
    }
    training = {k: summary[k] for k in ("steps", "train_minutes", "train_tokens", "offline")}
    net.config = replace(net_config, training=training, **changes)
    files = {"training_summary.json": json.dumps(summary, indent=2) + "\n", **carried_vocabulary(config.init_from, log, kind)}
    model.save(net, out_dir, extra=files)
    return summary


def evaluate_drafter(path: Path, target_dir: Path, cache_dir: Path, heldout_sequences: int = 48,
                     log: Callable[[str], None] = print, held=None, method: BlockMethod = DFLASH) -> dict[str, float]:
    """The offline metric of a saved block drafter's folder (DFlash, or ``method``'s) on the held-out prompts."""
    from specdec.backends.target import load_target
    from specdec.train.features import heldout_data

    net = method.model.load_net(path)
    target = load_target(target_dir)
    if held is None:
        held = heldout_data(Path(target_dir), target.fingerprint(), cache_dir, heldout_sequences, 16, 0, log)
    sizes = (2, 4, 8, 16, 32) if method is DFLASH else (1, 4, 7, 8, 16, 32)  # a DFlash block of B drafts B - 1
    blocks = tuple(b for b in sizes if b <= net.config.block_size)
    config = method.from_dict({"eval_blocks": list(blocks)})
    rows = read_draft_vocabulary(str(path), net.config.vocab_size)  # the rows it drafts from, as inference does
    objective = method.objective(config, FrozenTarget(target_dir), net.config, rows)
    return objective.evaluate(net, held)
