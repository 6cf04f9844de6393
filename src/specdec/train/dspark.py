"""Train a DSpark drafter against a frozen target: DFlash's run (train/dflash.py: data, anchors, the
block-sparse pass, the loop, the export) with DSpark's objective and a calibration step.

* Every slot of a block predicts: slot k of the block anchored at a learns token a + k + 1 from the
  target's distribution p at a + k. The Markov head reads the true token before each slot
  (the anchor's, then a + 1 ..), as at inference it reads the draft before it.
* Loss per slot: 0.1 soft cross-entropy to p + 0.9 L1(q, p) + 1.0 BCE(confidence, 1 - L1 / 2), the
  L1 target detached (the probability that sampling q is accepted by p); slot k weighted exp(-k / gamma).
* The offline metric decodes as inference does: from every generated position of the held-out
  greedy continuations, the block's slots are taken left to right, each through the Markov head with
  the draft before it; leading matches with the target's greedy tokens give per-position acceptance
  and the walk's predicted tau.
* Calibration: per-slot temperatures of the confidence logit, chosen left to right to minimise the
  expected calibration error of the cumulative survival (the product of confidences up to each slot)
  on half of the held-out sequences, earlier slots' fixed; ECE, AUROC and Brier of that survival are
  reported on the other half, before and after.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specdec.models import dflash, dspark
from specdec.train import config as train_config
from specdec.train import dflash as block_training
from specdec.train.dflash import DFlashShape, DFlashTrainConfig
from specdec.train.features import TINY_DATA, acceptance_summary, leading_matches
from specdec.train.loop import OptimConfig


@dataclass(frozen=True)
class DSparkShape(DFlashShape):
    markov_rank: int = 256
    markov_head: str = "vanilla"   # vanilla | gated


@dataclass(frozen=True)
class DSparkTrainConfig(DFlashTrainConfig):
    shape: DSparkShape = field(default_factory=lambda: DSparkShape(block_size=7))
    gamma: float = 4.0            # slot weight exp(-k / gamma), k = 0 .. B - 1
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    eval_blocks: tuple[int, ...] = (4, 7)
    temperature_grid: tuple[float, ...] = tuple(round(0.25 * 1.1 ** i, 4) for i in range(44))  # 0.25 .. 15


PRESETS: dict[str, DSparkTrainConfig] = {
    "dspark": DSparkTrainConfig(),
    # The real chat target (SmolLM2-135M-Instruct): DFlash's dflash-sharegpt run (same data, feature
    # cache, layers, anchors, steps and learning rate), blocks of 7 drafts (DFlash's 8-token block
    # drafts 7) and a Markov head of rank 64 (its two matrices add 6.3M parameters over the 49,152
    # tokens; rank 256 would add 25M).
    "dspark-sharegpt": DSparkTrainConfig(shape=DSparkShape(layers=2, block_size=7, target_layers=(1, 14, 26),
                                                           markov_rank=64),
                                         batch_size=8, train_sequences=1536, heldout_sequences=48, prefix_len=256,
                                         generated_len=256, source="sharegpt", anchors=32,
                                         optim=OptimConfig(steps=400, lr=2e-3, warmup_steps=30, eval_every=100,
                                                           ckpt_every_steps=20, bfloat16=True)),
    "tiny": DSparkTrainConfig(shape=DSparkShape(layers=1, block_size=4, target_features=2, markov_rank=8),
                              optim=OptimConfig(steps=12, lr=3e-3, warmup_steps=2, eval_every=6, ckpt_every_steps=4),
                              anchors=4, eval_blocks=(2, 4), **TINY_DATA),
}


def load_config(path: str | None, preset: str) -> DSparkTrainConfig:
    return train_config.load_config(DSparkTrainConfig, PRESETS, path, preset, "DSpark training")


def config_from_dict(values: dict[str, Any]) -> DSparkTrainConfig:
    config = train_config.config_from_dict(DSparkTrainConfig, values, "DSpark training")
    return replace(config, eval_blocks=tuple(config.eval_blocks), temperature_grid=tuple(config.temperature_grid),
                   shape=replace(config.shape, target_layers=tuple(config.shape.target_layers)))


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weight exp(-k / gamma) of slot k = 0 .. B - 1 (every slot drafts); gamma 0: uniform."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.exp(-k / gamma) if gamma > 0 else torch.ones(block_size)


class Objective(block_training.Objective):
    """DSpark's loss and offline metric (the frozen target and the block pass are DFlash's)."""

    def blocks(self, net: dspark.DSparkNet, tokens, valid, anchors, block_size: int, at: torch.Tensor | None = None):
        """(normed outputs [b, N, B, H], the head's logits over the scored rows [b, N, B, V'], the target's
        log-probabilities over the scored rows at positions ``at`` [b, M] as [b, M, V'], or None without ``at``)."""
        if at is None:
            features, target = self.frozen.run(tokens, valid, self.layers, at=anchors[:, :0])[0], None
        else:
            features, target = self.frozen.log_probs(tokens, valid, self.layers, at, self.rows)
        ids = dflash.block_inputs(tokens, anchors, block_size, self.net_config.mask_token_id)
        out = net.blocks(features, F.embedding(ids, self.frozen.embed), anchors)
        return out, out @ self.head.t(), target

    def loss(self, net: dspark.DSparkNet, batch) -> torch.Tensor:
        tokens, valid, anchors, ok = batch
        config, size = self.config, self.net_config.block_size
        source = anchors[:, :, None] + torch.arange(size)                              # p at a + k predicts a + k + 1
        exists = (source + 1 < valid.sum(1)[:, None, None]) & ok[:, :, None]          # [b, N, B]
        b, n, _ = source.shape
        at = source.clamp(max=tokens.shape[1] - 1).reshape(b, -1)
        out, head, target = self.blocks(net, tokens, valid, anchors, size, at)          # [b, N, B, *], [b, N B, V]
        previous = dspark.previous_tokens(tokens, anchors, size)
        term, code = net.markov(out, previous, self.rows)
        draft = head + term
        p = target.float().view(b, n, size, -1).exp()                                 # the scored rows' share
        log_q = torch.log_softmax(draft.float(), -1)
        ce = -(p / p.sum(-1, keepdim=True).clamp(min=1e-30) * log_q).sum(-1)          # to p over the scored rows
        l1 = (log_q.exp() - p).abs().sum(-1) + (1 - p.sum(-1)).clamp(min=0)          # q is 0 elsewhere: 0 .. 2
        per_slot = config.ce_weight * ce + config.l1_weight * l1
        if self.net_config.enable_confidence_head:
            survives = (1 - l1 / 2).detach().clamp(0, 1)
            logit = net.confidence_logit(out, code).float()
            per_slot = per_slot + config.confidence_weight * F.binary_cross_entropy_with_logits(
                logit, survives, reduction="none")
        weight = slot_weights(size, config.gamma) * exists.float()
        return (per_slot * weight).sum() / weight.sum().clamp(min=1e-9)

    @torch.no_grad()
    def decode(self, net: dspark.DSparkNet, held, size: int):
        """Drafting as inference does from every generated held-out position: per anchor, the leading
        matches [A], the confidence logits [A, B] and whether each draft's position is real [A, B], with
        the walks of ``acceptance_summary``."""
        accepted, walks, logits_all, reached_all = [], [], [], []
        for start in range(0, held.tokens.shape[0], 4):
            rows = torch.arange(start, min(start + 4, held.tokens.shape[0]))
            tokens, valid = held.batch(rows)
            prompt_len = held.prompt_len[rows]
            length = tokens.shape[1]
            generated = int((held.lengths[rows] - prompt_len).max())
            anchors = (prompt_len[:, None] + torch.arange(generated)).clamp(max=length - 1)
            ok = anchors + 1 < valid.sum(1, keepdim=True)
            out, head, _ = self.blocks(net, tokens, valid, anchors, size)
            previous = tokens.gather(1, anchors)                                       # the anchors' tokens
            guesses, confidences = [], []
            for j in range(size):
                term, code = net.markov(out[:, :, j], previous, self.rows)
                previous = self.ids((head[:, :, j] + term).argmax(-1))
                guesses.append(previous)
                if self.net_config.enable_confidence_head:
                    confidences.append(net.confidence_logit(out[:, :, j], code))
            guess = torch.stack(guesses, -1)                                           # [b, N, B]
            label = anchors[:, :, None] + torch.arange(1, size + 1)
            truth = tokens.gather(1, label.clamp(max=length - 1).reshape(len(rows), -1)).view_as(guess)
            real = label < valid.sum(1)[:, None, None]
            counts = leading_matches((guess == truth) & real) * ok
            accepted.append(counts[ok])
            if confidences:
                logits_all.append(torch.stack(confidences, -1)[ok])
                reached_all.append(real[ok])
            for i, row in enumerate(rows):
                per_t = counts.new_zeros(length)
                per_t[anchors[i] - 1] = counts[i]
                walks.append((per_t, int(prompt_len[i]) - 1, int(held.lengths[row])))
        confidence = (torch.cat(logits_all), torch.cat(reached_all)) if logits_all else None
        return torch.cat(accepted), walks, confidence

    @torch.no_grad()
    def evaluate(self, net: dspark.DSparkNet, held, blocks: tuple[int, ...] | None = None) -> dict[str, float]:
        """Keys ``b{B}_tau`` (predicted tau of blocks of B drafts), ``accept_{j}`` and ``tau_k{k}`` of the largest."""
        net.eval()
        blocks = tuple(b for b in (blocks or self.config.eval_blocks) if 1 <= b <= self.net_config.block_size)
        out: dict[str, float] = {}
        for size in blocks:
            accepted, walks, _ = self.decode(net, held, size)
            summary = acceptance_summary(accepted, size, walks)
            out[f"b{size}_tau"] = summary[f"tau_k{size}"]
            if size == max(blocks):
                out.update(summary)
        return out

    def calibrate(self, net: dspark.DSparkNet, held, log: Callable[[str], None]):
        """(summary fields, config changes): temperatures fitted on the first half of the held-out
        sequences, the survival's metrics on the second half before and after."""
        if not self.net_config.enable_confidence_head:
            return {}, {}
        size, rows = self.net_config.block_size, held.tokens.shape[0]
        half = max(1, rows // 2)
        parts = [subset(held, range(0, half)), subset(held, range(half, rows))]
        (fit_accepted, _, fit), (test_accepted, _, test) = (self.decode(net, part, size) for part in parts)
        temps = fit_temperatures(fit[0], survival_labels(fit_accepted, size), fit[1], self.config.temperature_grid)
        labels = survival_labels(test_accepted, size)
        before = survival_metrics(cumulative_survival(test[0], [1.0] * size), labels, test[1])
        after = survival_metrics(cumulative_survival(test[0], temps), labels, test[1])
        log(f"[dspark] confidence calibration (held-out half, {int(test_accepted.numel())} anchors): "
            f"ECE {before['ece']:.3f} -> {after['ece']:.3f}, AUROC {before['auroc']}, "
            f"Brier {before['brier']:.3f} -> {after['brier']:.3f}")
        fields = {"calibration": {"fitted_on_sequences": half, "reported_on_sequences": rows - half,
                                  "temperatures": [round(t, 4) for t in temps], "before": before, "after": after}}
        return fields, {"confidence_temperatures": tuple(round(t, 4) for t in temps)}


def subset(held, rows):
    rows = torch.as_tensor(list(rows), dtype=torch.long)
    return type(held)(held.tokens[rows], held.lengths[rows], held.prompt_len[rows])


def survival_labels(accepted: torch.Tensor, size: int) -> torch.Tensor:
    """[A, B] whether the first j + 1 drafts were all accepted (the event the survival predicts)."""
    return accepted[:, None] > torch.arange(size)


def cumulative_survival(logits: torch.Tensor, temperatures) -> torch.Tensor:
    """[A, B] the product of calibrated confidences up to each slot."""
    temps = torch.as_tensor(list(temperatures), dtype=torch.float32)
    return torch.sigmoid(logits.float() / temps).cumprod(-1)


def expected_calibration_error(prob: torch.Tensor, label: torch.Tensor, bins: int = 15) -> float:
    """Mean |accuracy - confidence| over equal-width bins, weighted by their counts."""
    if prob.numel() == 0:
        return 0.0
    which = (prob * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            total += float(inside.sum()) * abs(float(label[inside].float().mean()) - float(prob[inside].mean()))
    return total / prob.numel()


def auroc(prob: torch.Tensor, label: torch.Tensor) -> float:
    """The probability that a positive scores above a negative (ties count half); None with one class."""
    positives, negatives = prob[label], prob[~label]
    if positives.numel() == 0 or negatives.numel() == 0:
        return None
    order = torch.cat([positives, negatives])
    ranks = torch.empty(order.numel(), dtype=torch.float64)
    values, index = order.sort()
    ranks[index] = torch.arange(1, order.numel() + 1, dtype=torch.float64)
    # average ranks over ties
    _, inverse, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[index] = mean_rank[inverse]
    n_pos, n_neg = positives.numel(), negatives.numel()
    return float((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def survival_metrics(survival: torch.Tensor, labels: torch.Tensor, real: torch.Tensor) -> dict:
    """Per slot and over all slots: ECE, AUROC and Brier of the cumulative survival (real positions only)."""
    per = {"ece": [], "auroc": [], "brier": []}
    for j in range(survival.shape[1]):
        keep = real[:, j]
        prob, label = survival[keep, j], labels[keep, j]
        per["ece"].append(round(expected_calibration_error(prob, label), 4))
        per["auroc"].append(rounded(auroc(prob, label)))
        per["brier"].append(round(float(((prob - label.float()) ** 2).mean()) if prob.numel() else 0.0, 4))
    prob, label = survival[real], labels[real]
    return {"ece": round(expected_calibration_error(prob, label), 4), "auroc": rounded(auroc(prob, label)),
            "brier": round(float(((prob - label.float()) ** 2).mean()), 4), "per_slot": per}


def fit_temperatures(logits: torch.Tensor, labels: torch.Tensor, real: torch.Tensor, grid) -> list[float]:
    """Left to right, the temperature of slot j minimising the ECE of the survival at j, earlier ones fixed."""
    temps: list[float] = []
    previous = torch.ones(logits.shape[0])
    for j in range(logits.shape[1]):
        keep = real[:, j]
        best = min(grid, key=lambda t: expected_calibration_error(
            (previous * torch.sigmoid(logits[:, j].float() / t))[keep], labels[keep, j]))
        temps.append(float(best))
        previous = previous * torch.sigmoid(logits[:, j].float() / best)
    return temps


DSPARK = block_training.BlockMethod(
    "dspark", dspark, dspark.DSparkConfig, dspark.DSparkNet, Objective, config_from_dict,
    lambda config: {"markov_rank": config.shape.markov_rank, "markov_head_type": config.shape.markov_head},
    lambda net, objective, held, log: objective.calibrate(net, held, log), normalized=True)


def train_dspark(config: DSparkTrainConfig, target_dir: Path, out_dir: Path, **options) -> dict[str, Any]:
    """Train (or resume) a DSpark drafter for the target in ``target_dir``; save it to ``out_dir``
    (options: train_dflash's)."""
    return block_training.train_blocks(DSPARK, config, target_dir, out_dir, **options)


def evaluate_drafter(path: Path, target_dir: Path, cache_dir: Path, heldout_sequences: int = 48,
                     log: Callable[[str], None] = print) -> dict[str, float]:
    """The offline metric of a saved DSpark folder on the held-out prompts."""
    return block_training.evaluate_drafter(path, target_dir, cache_dir, heldout_sequences, log, method=DSPARK)
