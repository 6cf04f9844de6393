"""Train Medusa-1 heads on a frozen target (the objective; the loop is loop.py).

Head i learns the target's own distribution i + 2 tokens ahead (soft cross-entropy to the target's
next-token distribution at t + 1 + i, weighted 0.8^i), on the target's own continuations. Heads that end in
the target's LM head can be scored over a draft vocabulary (``head_vocab`` rows of it, saved as the folder's
draft_vocab.json), as they then draft: the target's distribution taken over the same rows.

After training, the default candidate tree is built from measured acceptance on held-out data, as
Medusa builds its trees: each (head, rank) gets its held-out top-k accuracy, a path's value is the
product along it, and the best paths are taken greedily (a child never beats its parent, so they
form a tree). Among a few sizes, the one with the highest predicted tau per unit of verification
cost (the target's measured forward time for that many tokens) becomes the folder's ``medusa_choices``.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specdec.drafters.base import DRAFT_VOCAB_FILE, read_draft_vocabulary
from specdec.models import medusa
from specdec.train import config as train_config
from specdec.train.config import config_to_dict
from specdec.train.config import TrainConfigError
from specdec.train.features import (TINY_DATA, DataRecipe, FrozenTarget, anchor_mask, head_vocabulary, prepare_run,
                                    shifted, start_from, walk, warn_if_useless)
from specdec.train.loop import OptimConfig, run_loop

TOPK = 10
TREE_SIZES = (4, 6, 8, 12, 16, 24)


@dataclass(frozen=True)
class MedusaShape:
    heads: int = 4
    layers: int = 1
    original_lm_head: bool = False  # end every head in the target's own LM head (not saved with the heads)


@dataclass(frozen=True)
class MedusaTrainConfig(DataRecipe):
    shape: MedusaShape = field(default_factory=MedusaShape)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=600, lr=1e-3, warmup_steps=30,
                                                                   eval_every=150, ckpt_every_steps=100))
    decay: float = 0.8
    # heads ending in the target's LM head: score them over this many of its rows (the most frequent tokens of the
    # training data, or ``init_from``'s draft_vocab.json), as they then draft; 0: the whole head
    head_vocab: int = 0
    init_from: str = ""  # a Medusa folder of the same shape to continue from


PRESETS = {
    "medusa": MedusaTrainConfig(),
    # A real chat target (SmolLM2-135M-Instruct): EAGLE's ShareGPT data and feature cache (the final layer),
    # every head ending in the target's own LM head, so the folder holds 4 x 0.33M parameters instead of
    # 4 x 28M; sized for about 35 minutes on 2 cores.
    "medusa-sharegpt": MedusaTrainConfig(shape=MedusaShape(heads=4, layers=1, original_lm_head=True), batch_size=8,
                                         train_sequences=1536, heldout_sequences=48, prefix_len=256,
                                         generated_len=256, source="sharegpt",
                                         optim=OptimConfig(steps=400, lr=1e-3, warmup_steps=30, eval_every=100,
                                                           ckpt_every_steps=20, bfloat16=True)),
    # The same heads on the target's own answers (ShareGPT's first user turns, greedy, and 1,024 requests to
    # complete a function: the feature cache EAGLE-3, DFlash and DSpark train on), scored over the 8,192 rows they
    # draft from; sized for about 40 minutes on 2 cores.
    "medusa-answers": MedusaTrainConfig(shape=MedusaShape(heads=4, layers=1, original_lm_head=True), batch_size=8,
                                        train_sequences=3072, code_requests=1024, heldout_sequences=48,
                                        prefix_len=256, generated_len=192, source="sharegpt-answers", head_vocab=8192,
                                        optim=OptimConfig(steps=900, lr=1e-3, warmup_steps=30, eval_every=300,
                                                          ckpt_every_steps=20, bfloat16=True)),
    "tiny": MedusaTrainConfig(shape=MedusaShape(heads=3), optim=OptimConfig(steps=12, lr=3e-3, warmup_steps=2,
                                                                           eval_every=6, ckpt_every_steps=4),
                              **TINY_DATA),
}


def load_config(path: str | None, preset: str) -> MedusaTrainConfig:
    return train_config.load_config(MedusaTrainConfig, PRESETS, path, preset, "Medusa training")


def config_from_dict(values: dict[str, Any]) -> MedusaTrainConfig:
    return train_config.config_from_dict(MedusaTrainConfig, values, "Medusa training")


@dataclass
class HeadRanks:
    """Where the target's greedy token ranks in each head's top-10 (-1: absent) on held-out data."""

    at_anchors: torch.Tensor  # [A, heads] at every anchor with all heads' tokens in the sequence
    rows: list               # per sequence: (ranks [T, heads], first anchor, length), for decoding walks


def head_ranks(net: medusa.MedusaHeads, frozen: FrozenTarget, held, layer: int,
               ids: torch.Tensor | None = None) -> HeadRanks:
    """ids: the target ids of the heads' rows (a draft vocabulary), None: the whole vocabulary."""
    heads = net.config.medusa_num_heads
    ranks, rows_out = [], []
    with torch.no_grad():
        for start in range(0, held.tokens.shape[0], 8):
            rows = torch.arange(start, min(start + 8, held.tokens.shape[0]))
            tokens, valid = held.batch(rows)
            features, _, choice = frozen.run(tokens, valid, (layer,), rows=tokens.new_zeros(0), choice=True)
            length = tokens.shape[1]
            top = net(features).topk(TOPK, dim=-1).indices  # [B, T, heads, 10]
            if ids is not None:
                top = ids[top]
            truth = torch.stack([shifted(choice, 1 + i, length, -1) for i in range(heads)], -1)
            hit = top == truth[..., None]
            rank = torch.where(hit.any(-1), hit.float().argmax(-1), -1)  # [B, T, heads]
            # anchor t: the feature at t (the token before the pending one); t + 1 is generated
            anchors = anchor_mask(valid, held.prompt_len[rows], length, heads)
            ranks.append(rank[anchors])
            rows_out += [(rank[i], int(held.prompt_len[row]) - 1, int(held.lengths[row])) for i, row in enumerate(rows)]
    return HeadRanks(torch.cat(ranks), rows_out)


def tree_depths(ranks: torch.Tensor, choices) -> torch.Tensor:
    """[N] the deepest path of the tree whose every rank matches, at each position of ranks [N, heads]."""
    depth = torch.zeros(ranks.shape[0], dtype=torch.long)
    for path in choices:
        ok = torch.ones(ranks.shape[0], dtype=torch.bool)
        for head, rank in enumerate(path):
            ok &= ranks[:, head] == rank
        depth = torch.where(ok, torch.clamp(depth, min=len(path)), depth)
    return depth


def tree_tau(ranks, choices) -> float:
    """Held-out tau of a static tree: decoding walks over whole sequences (``features.walk``) for
    HeadRanks, the mean of 1 + accepted depth over anchors for a plain [A, heads] tensor."""
    if isinstance(ranks, torch.Tensor):
        return 1.0 + float(tree_depths(ranks, choices).float().mean())
    deepest = max((len(p) for p in choices), default=0)
    tokens = steps = 0
    for rank, first, length in ranks.rows:
        got, taken = walk(tree_depths(rank, choices), first, length, deepest)
        tokens, steps = tokens + got, steps + taken
    return tokens / max(steps, 1)


def build_tree(ranks: torch.Tensor, size: int) -> list[tuple[int, ...]]:
    """The ``size`` paths of highest product of per-(head, rank) held-out accuracy, in order of depth."""
    ranks = ranks.at_anchors if isinstance(ranks, HeadRanks) else ranks
    heads = ranks.shape[1]
    accuracy = torch.stack([(ranks == r).float().mean(0) for r in range(TOPK)], 1)  # [heads, 10]
    chosen, frontier = [], [(-float(accuracy[0, r]), (r,)) for r in range(TOPK)]
    heapq.heapify(frontier)
    while frontier and len(chosen) < size:
        value, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < heads:
            for r in range(TOPK):
                heapq.heappush(frontier, (value * float(accuracy[len(path), r]), path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def choose_tree(ranks: torch.Tensor, cost: Callable[[int], float], log) -> tuple[list, dict]:
    """The default tree: the size with the best predicted tau / cost; returns (choices, report)."""
    report = {}
    best = None
    for size in TREE_SIZES:
        tree = build_tree(ranks, size)
        tau = tree_tau(ranks, tree)
        speed = tau / cost(size + 1)
        report[str(size)] = {"tau": round(tau, 4), "relative_speed": round(speed * cost(1), 4)}
        if best is None or speed > best[0]:
            best = (speed, tree, size)
    log(f"[medusa] default tree: {best[2]} nodes; predicted tau by size: "
        + ", ".join(f"{k}: {v['tau']:.2f}" for k, v in report.items()))
    return best[1], report


def target_cost(target_dir: Path) -> Callable[[int], float]:
    """Seconds of one native forward pass of n tokens (what a tree of n - 1 nodes costs to verify)."""
    from specdec.backends.costs import forward_time
    from specdec.backends.target import load_target

    backend = load_target(target_dir).backend
    cache: dict[int, float] = {}

    def cost(n: int) -> float:
        if n not in cache:
            cache[n] = forward_time(backend, n, 200, repeats=9)
        return cache[n]
    return cost


def train_medusa(config: MedusaTrainConfig, target_dir: Path, out_dir: Path, *, ckpt_dir: Path | None = None,
                 resume: bool = False, max_minutes: float | None = None,
                 log: Callable[[str], None] | None = None, data_dir: Path | None = None,
                 data_only: bool = False) -> dict[str, Any]:
    from specdec.models.eagle import TargetRecord

    out_dir, target_dir = Path(out_dir), Path(target_dir)
    # the folder to continue, read before anything is written (a wrong one is refused at once)
    source = continued(config.init_from, config.shape) if config.init_from and not resume else None
    if config.head_vocab and not config.shape.original_lm_head:
        raise TrainConfigError("head_vocab scores heads that end in the target's LM head: it needs "
                               "shape.original_lm_head")
    run = prepare_run("medusa", config, target_dir, out_dir, ckpt_dir, resume, config_from_dict, log,
                      data_dir, data_only)
    config, target, held, log = run.config, run.target, run.held, run.log
    layer = target.num_layers
    shape = medusa.MedusaConfig(config.shape.heads, config.shape.layers, int(target.config.hidden_size),
                                target.vocab_size, original_lm_head=config.shape.original_lm_head,
                                target=TargetRecord.of(target))
    torch.manual_seed(config.seed)
    net = medusa.MedusaHeads(shape)
    if source is not None:
        start_from(net, source, config.init_from, target, "Medusa heads", TrainConfigError)
    rows, extra = None, {}
    carried = bool(config.init_from) and (Path(config.init_from) / DRAFT_VOCAB_FILE).is_file()
    if shape.original_lm_head and (config.head_vocab or carried):
        rows, _, extra = head_vocabulary(config.init_from, config.head_vocab, run.train, target.vocab_size,
                                         config.source, log, "medusa")
    frozen = run.frozen((layer,))
    net.init_from_head(frozen.head_rows(rows))
    heads = shape.medusa_num_heads

    def loss_fn(model, batch):
        tokens, valid = batch
        features, logits = frozen.run(tokens, valid, (layer,), rows=rows)  # [B, T, H], [B, T, V or rows]
        length = tokens.shape[1]
        out = model(features)  # [B, T, heads, V]
        total = 0.0
        for i in range(heads):
            mask = shifted(valid, 1 + i, length, False).float()
            probs = torch.softmax(shifted(logits, 1 + i, length), dim=-1)
            ce = -(probs * torch.log_softmax(out[:, :, i], dim=-1)).sum(-1)
            total = total + config.decay ** i * (ce * mask).sum() / mask.sum().clamp(min=1)
        return total

    def eval_fn(model):
        model.eval()
        ranks = head_ranks(model, frozen, held, layer, rows)
        chain = [tuple([0] * d) for d in range(1, heads + 1)]
        metrics = {f"top1_head{i}": float((ranks.at_anchors[:, i] == 0).float().mean()) for i in range(heads)}
        metrics["tau_chain"] = tree_tau(ranks, chain)
        metrics["tau_tree16"] = tree_tau(ranks, build_tree(ranks, 16))
        return metrics

    run_config = {"kind": "medusa", "medusa": config_to_dict(config), "target": target.fingerprint()}
    result = run_loop(model=net, config=config.optim, batch_fn=run.batch_fn(salt=31), loss_fn=loss_fn,
                      tokens_in=lambda batch: int(batch[1].sum()), eval_fn=eval_fn, ckpt_dir=run.ckpt_dir,
                      run_config=run_config, resume=resume, max_minutes=max_minutes, desc="medusa", log=log)
    from specdec.train.target import round_to_export_dtype_

    round_to_export_dtype_(net)
    final = eval_fn(net)
    ranks = head_ranks(net, frozen, held, layer, rows)
    choices, sizes = choose_tree(ranks, target_cost(target_dir), log)
    tau = tree_tau(ranks, choices)
    useless = warn_if_useless({"tau": tau}, "tau", log, "medusa")
    summary = {
        "kind": "medusa", "parameters": sum(p.numel() for p in net.parameters()), **result.summary_fields(),
        **run.data_fields(), "heldout_anchors": int(ranks.at_anchors.shape[0]),
        "offline": {**{k: round(v, 4) for k, v in final.items()}, "tau_default_tree": round(tau, 4)},
        "tree_sizes": sizes, "default_tree_nodes": len(choices), "low_acceptance_warning": useless,
        "config": config_to_dict(config),
    }
    net.config = medusa.with_training(shape, choices, {k: summary[k] for k in ("steps", "train_minutes", "train_tokens",
                                                                                "offline")})
    medusa.save(net, out_dir, extra={"training_summary.json": json.dumps(summary, indent=2) + "\n", **extra})
    return summary


def continued(folder: str, shape: MedusaShape) -> medusa.MedusaHeads:
    """``folder``'s heads, refused in one line unless they have this run's shape."""
    source = medusa.load_net(folder)
    theirs = source.config
    if (theirs.medusa_num_heads, theirs.medusa_num_layers, theirs.original_lm_head) != \
            (shape.heads, shape.layers, shape.original_lm_head):
        raise TrainConfigError(f"{folder} holds {theirs.medusa_num_heads} Medusa heads of {theirs.medusa_num_layers} "
                               f"layers (original_lm_head {theirs.original_lm_head}); init_from needs this run's shape: "
                               f"{shape.heads} of {shape.layers} ({shape.original_lm_head})")
    return source


def evaluate_drafter(path: Path, target_dir: Path, cache_dir: Path, heldout_sequences: int = 48,
                     log: Callable[[str], None] = print, choose: bool = False) -> dict:
    """The offline metric of a saved Medusa folder (its own tree, the chain, per-head top-1) on the held-out prompts."""
    from specdec.backends.target import load_target
    from specdec.train.features import heldout_data

    net = medusa.load_net(path)
    target = load_target(target_dir)
    held = heldout_data(Path(target_dir), target.fingerprint(), cache_dir, heldout_sequences, 16, 0, log)
    frozen = FrozenTarget(target_dir)
    rows = None
    if net.config.original_lm_head:  # the rows it drafts from, as inference does
        rows = read_draft_vocabulary(str(path), net.config.vocab_size)
        net.init_from_head(frozen.head_rows(rows))
    ranks = head_ranks(net, frozen, held, target.num_layers, rows)
    heads = net.config.medusa_num_heads
    metrics = {f"top1_head{i}": float((ranks.at_anchors[:, i] == 0).float().mean()) for i in range(heads)}
    metrics["tau_chain"] = tree_tau(ranks, [tuple([0] * d) for d in range(1, heads + 1)])
    metrics["tau_default_tree"] = tree_tau(ranks, net.config.medusa_choices)
    metrics["anchors"] = float(ranks.at_anchors.shape[0])
    if choose:  # choose the default tree again, from these held-out prompts and this machine's costs
        choices, sizes = choose_tree(ranks, target_cost(target_dir), log)
        metrics["tau_default_tree"] = tree_tau(ranks, choices)
        metrics["medusa_choices"] = [list(p) for p in choices]
        metrics["tree_sizes"] = sizes
    return metrics
