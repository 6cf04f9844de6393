"""Train an EAGLE-1 or EAGLE-3 drafter against a frozen target (the objective; the loop is loop.py).

EAGLE-1: feature regression (SmoothL1 to the target's next feature) plus 0.1 x soft cross-entropy
to the target's next-token distribution, with uniform noise on the input features (METHODS.md 3).
EAGLE-3: training-time test: the drafter is rolled out ``ttt_steps`` deep, each step fed its own
previous output with the attention pattern of inference, and scored by soft cross-entropy to the
target's distribution over the draft vocabulary, step i weighted 0.8^i (METHODS.md 5).

Every evaluation reports the offline predicted tau (features.py); the summary keeps it, and a
drafter that predicts tau near 1 says so loudly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specdec.errors import SpecdecError
from specdec.models import eagle
from specdec.train import config as train_config
from specdec.train.config import config_to_dict
from specdec.train.features import (DataRecipe, TINY_DATA, FrozenTarget, acceptance_summary, anchor_mask,
                                    draft_vocabulary, head_vocabulary, leading_matches, prepare_run, shifted,
                                    start_from, warn_if_useless)
from specdec.train.loop import OptimConfig, run_loop


class EagleTrainError(SpecdecError):
    pass


@dataclass(frozen=True)
class EagleShape:
    """Dummy nested shape (the config machinery merges ``shape`` and ``optim`` objects)."""

    intermediate: int = 0  # 0: the target's intermediate size


@dataclass(frozen=True)
class EagleTrainConfig(DataRecipe):
    version: int = 3
    shape: EagleShape = field(default_factory=EagleShape)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=1200, lr=2e-3, warmup_steps=50,
                                                                   eval_every=200, ckpt_every_steps=100))
    ttt_steps: int = 5             # EAGLE-3 rollout depth in training (EAGLE-1: 1)
    eval_depth: int = 6            # drafts per anchor in the offline metric
    draft_vocab_size: int = 2048   # EAGLE-3; 0 = the whole target vocabulary
    noise: float = 0.2             # EAGLE-1: uniform noise width on input features (x 512 / seq_len)
    v_weight: float = 1.0
    p_weight: float = 0.1
    ttt_decay: float = eagle.TTT_DECAY
    # EAGLE-3: start the head (and its norm) from the target's rows of the draft vocabulary. Measured on
    # SmolLM2-135M (ShareGPT preset, step 120): first-draft acceptance 0.24 against 0.27 from a random
    # head, so the presets leave it off.
    head_from_target: bool = False
    # EAGLE-1: score the next token over a draft vocabulary of this many tokens (the most frequent of the
    # training data, or ``init_from``'s draft_vocab.json), as the drafter then drafts; saved beside it as
    # draft_vocab.json. 0: the target's whole head.
    head_vocab: int = 0
    init_from: str = ""            # an EAGLE folder of the same version and shape to continue from


PRESETS: dict[str, EagleTrainConfig] = {
    "eagle3": EagleTrainConfig(),
    "eagle": EagleTrainConfig(version=1, ttt_steps=1, optim=OptimConfig(steps=1200, lr=2e-3, warmup_steps=50,
                                                                       eval_every=200, ckpt_every_steps=100)),
    # A real chat target (SmolLM2-135M-Instruct): ShareGPT conversations with the target's distributions
    # as labels, features cached; sized for about 100 minutes on 2 cores (docs/real-target.md).
    "eagle3-sharegpt": EagleTrainConfig(batch_size=8, train_sequences=1536, heldout_sequences=48, prefix_len=256,
                                        generated_len=256, source="sharegpt", draft_vocab_size=8192,
                                        optim=OptimConfig(steps=480, lr=2e-3, warmup_steps=30, eval_every=120,
                                                          ckpt_every_steps=20, bfloat16=True)),
    # The same on the target's own answers to ShareGPT's first user turns (half greedy, half sampled).
    "eagle3-sharegpt-self": EagleTrainConfig(batch_size=8, train_sequences=768, heldout_sequences=48, prefix_len=256,
                                             generated_len=192, source="sharegpt-self", draft_vocab_size=8192,
                                             optim=OptimConfig(steps=150, lr=2e-3, warmup_steps=15, eval_every=75,
                                                               ckpt_every_steps=20, bfloat16=True)),
    # EAGLE-1 on the same data and feature cache (it reads the final layer, which the cache always holds).
    "eagle-sharegpt": EagleTrainConfig(version=1, ttt_steps=1, batch_size=8, train_sequences=1536, heldout_sequences=48,
                                       prefix_len=256, generated_len=256, source="sharegpt",
                                       optim=OptimConfig(steps=400, lr=2e-3, warmup_steps=30, eval_every=100,
                                                         ckpt_every_steps=20, bfloat16=True)),
    # EAGLE-1 on the target's own answers to 2,048 ShareGPT first user turns (half greedy, half sampled), its
    # next-token loss over the 8,192 tokens it then drafts from.
    "eagle-sharegpt-self": EagleTrainConfig(version=1, ttt_steps=1, batch_size=8, train_sequences=2048,
                                            heldout_sequences=48, prefix_len=256, generated_len=192,
                                            source="sharegpt-self", head_vocab=8192,
                                            optim=OptimConfig(steps=600, lr=2e-3, warmup_steps=30, eval_every=100,
                                                              ckpt_every_steps=20, bfloat16=True)),
    "tiny": EagleTrainConfig(optim=OptimConfig(steps=12, lr=3e-3, warmup_steps=2, eval_every=6, ckpt_every_steps=4),
                             ttt_steps=3, eval_depth=3, draft_vocab_size=0, **TINY_DATA),
}


def load_config(path: str | None, preset: str) -> EagleTrainConfig:
    return train_config.load_config(EagleTrainConfig, PRESETS, path, preset, "EAGLE training")


def config_from_dict(values: dict[str, Any]) -> EagleTrainConfig:
    return train_config.config_from_dict(EagleTrainConfig, values, "EAGLE training")


class Objective:
    """Loss and offline metric of one EAGLE version, given the frozen target."""

    def __init__(self, config: EagleTrainConfig, frozen: FrozenTarget, layers: tuple[int, ...],
                 rows: torch.Tensor | None = None):
        self.config, self.frozen, self.layers = config, frozen, layers
        # EAGLE-1 over a draft vocabulary: its target ids, and those rows of the target's head
        self.rows = rows
        self.head = frozen.head_rows(rows)

    def draft_ids(self, net: eagle.EagleNet) -> torch.Tensor:
        return self.rows if self.rows is not None else net.draft_ids()

    def embeds(self, tokens: torch.Tensor, steps: int, pairs: int) -> list[torch.Tensor]:
        return [F.embedding(shifted(tokens, 1 + i, pairs), self.frozen.embed) for i in range(steps)]

    def loss(self, net: eagle.EagleNet, batch) -> torch.Tensor:
        tokens, valid = batch
        c = self.config
        if net.config.version == 3:  # the target's logits over the draft vocabulary only, and its choice
            features, logits, choice = self.frozen.run(tokens, valid, self.layers, rows=net.draft_ids(), choice=True)
            in_vocab_all = net.t2d[choice.clamp(min=0)].float()                     # [B, T]
        else:
            features, logits = self.frozen.run(tokens, valid, self.layers, rows=self.rows)  # [B, T, F], [B, T, V]
        pairs = tokens.shape[1] - 1
        inputs = features[:, :pairs]
        steps = c.ttt_steps if net.config.version == 3 else 1
        if net.config.version == 1 and c.noise > 0:
            scale = c.noise * 512 / tokens.shape[1]
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * scale
        outputs = net.rollout(self.embeds(tokens, steps, pairs), inputs, steps)
        total = 0.0
        for step, out in enumerate(outputs):
            mask = shifted(valid, 1 + step, pairs, False).float()  # [B, N] the target logits exist
            target = shifted(logits, 1 + step, pairs)              # [B, N, V or V_draft]
            if net.config.version == 3:
                in_vocab = shifted(in_vocab_all, 1 + step, pairs)
                probs = torch.softmax(target, dim=-1)
                ce = -(probs * torch.log_softmax(net.logits(out, None), dim=-1)).sum(-1)
                weight = mask * in_vocab
                total = total + c.ttt_decay ** step * (ce * weight).sum() / weight.sum().clamp(min=1)
            else:
                next_feature = shifted(features, 1, pairs)
                vloss = F.smooth_l1_loss(out, next_feature, reduction="none").mean(-1)
                probs = torch.softmax(target, dim=-1)
                ploss = -(probs * torch.log_softmax(net.logits(out, self.head), dim=-1)).sum(-1)
                total = total + ((c.v_weight * vloss + c.p_weight * ploss) * mask).sum() / mask.sum().clamp(min=1)
        return total

    @torch.no_grad()
    def evaluate(self, net: eagle.EagleNet, held) -> dict[str, float]:
        """Offline acceptance on held-out greedy continuations, drafting as at inference."""
        net.eval()
        depth = self.config.eval_depth
        accepted, walks = [], []
        for start in range(0, held.tokens.shape[0], 8):
            rows = torch.arange(start, min(start + 8, held.tokens.shape[0]))
            tokens, valid = held.batch(rows)
            features, _, choice = self.frozen.run(tokens, valid, self.layers, rows=tokens.new_zeros(0), choice=True)
            pairs = tokens.shape[1] - 1
            outputs = net.rollout(self.embeds(tokens, depth, pairs), features[:, :pairs], depth)
            ids = self.draft_ids(net)
            drafts = torch.stack([ids[net.logits(out, self.head).argmax(-1)] for out in outputs], -1)
            truth = torch.stack([shifted(choice, 1 + i, pairs, -1) for i in range(depth)], -1)
            anchors = anchor_mask(valid, held.prompt_len[rows], pairs, depth)
            counts = leading_matches(drafts == truth)  # [b, N]
            accepted.append(counts[anchors])
            walks += [(counts[i], int(held.prompt_len[row]) - 1, int(held.lengths[row])) for i, row in enumerate(rows)]
        return acceptance_summary(torch.cat(accepted), depth, walks)


def train_eagle(config: EagleTrainConfig, target_dir: Path, out_dir: Path, *, ckpt_dir: Path | None = None,
                resume: bool = False, max_minutes: float | None = None,
                log: Callable[[str], None] | None = None, data_dir: Path | None = None,
                data_only: bool = False) -> dict[str, Any]:
    """Train (or resume) an EAGLE drafter for the target in ``target_dir``; save it to ``out_dir``."""
    out_dir, target_dir = Path(out_dir), Path(target_dir)
    # the folder to continue, read before anything is written (a wrong one is refused at once)
    source = eagle.load_net(config.init_from, expect_version=config.version) if config.init_from and not resume \
        else None
    run = prepare_run("eagle", config, target_dir, out_dir, ckpt_dir, resume, config_from_dict, log,
                      data_dir, data_only)
    config, target, train, held, log = run.config, run.target, run.train, run.held, run.log
    if config.version not in (1, 3):
        raise EagleTrainError(f"EAGLE version must be 1 or 3, got {config.version}")
    vocab = target.vocab_size
    draft_vocab = config.draft_vocab_size or vocab
    if config.version == 3 and not 0 < draft_vocab <= vocab:
        raise EagleTrainError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab}")
    shape = eagle.EagleConfig.for_target(target, config.version, draft_vocab_size=draft_vocab,
                                         intermediate_size=config.shape.intermediate or None)
    torch.manual_seed(config.seed)
    net = eagle.EagleNet(shape)
    coverage, rows, extra = 1.0, None, {}
    if config.version == 3:
        used, coverage = draft_vocabulary(train, draft_vocab, vocab)
        net.set_draft_vocab(used)
    if source is not None:
        start_from(net, source, config.init_from, target, "an EAGLE drafter", EagleTrainError)
    if config.version == 1 and config.head_vocab:
        rows, coverage, extra = head_vocabulary(config.init_from, config.head_vocab, train, vocab, config.source,
                                                log, "EAGLE-1")
    frozen = run.frozen(shape.hidden_layers())
    if config.version == 3 and config.head_from_target and not resume:
        # The target's own map from its last hidden state to tokens, restricted to the draft vocabulary:
        # the drafter then learns only to predict that state, not the token space as well.
        with torch.no_grad():
            net.lm_head.weight.copy_(frozen.head[net.draft_ids()])
            net.norm.weight.copy_(frozen.model.model.norm.weight)
    objective = Objective(config, frozen, shape.hidden_layers(), rows)

    run_config = {"kind": "eagle", "eagle": config_to_dict(config), "target": target.fingerprint()}
    result = run_loop(model=net, config=config.optim, batch_fn=run.batch_fn(salt=21), loss_fn=objective.loss,
                      tokens_in=lambda batch: int(batch[1].sum()), eval_fn=lambda m: objective.evaluate(m, held),
                      ckpt_dir=run.ckpt_dir, run_config=run_config, resume=resume, max_minutes=max_minutes,
                      desc=shape.name, log=log)
    from specdec.train.target import round_to_export_dtype_

    round_to_export_dtype_(net)
    final = objective.evaluate(net, held)
    useless = warn_if_useless(final, "tau_k4", log, shape.name)
    summary = {
        "kind": shape.name, "parameters": sum(p.numel() for p in net.parameters()), **result.summary_fields(),
        **run.data_fields(),
        "draft_vocab_coverage": round(coverage, 4),
        "offline": {key: round(value, 4) for key, value in final.items()}, "low_acceptance_warning": useless,
        "config": config_to_dict(config),
    }
    net.config = eagle.with_training(shape, {k: summary[k] for k in ("steps", "train_minutes", "train_tokens",
                                                                      "offline", "draft_vocab_coverage")})
    eagle.save(net, out_dir, extra={"training_summary.json": json.dumps(summary, indent=2) + "\n", **extra})
    return summary


def evaluate_drafter(path: Path, target_dir: Path, cache_dir: Path, heldout_sequences: int = 48,
                     depth: int = 8, log: Callable[[str], None] = print) -> dict[str, float]:
    """The offline metric of a saved EAGLE folder on the held-out prompts (greedy continuations cached
    in ``cache_dir``)."""
    from specdec.backends.target import load_target
    from specdec.train.features import heldout_data

    net = eagle.load_net(path)
    target = load_target(target_dir)
    held = heldout_data(Path(target_dir), target.fingerprint(), cache_dir, heldout_sequences, 16, 0, log)
    config = EagleTrainConfig(version=net.config.version, eval_depth=depth)
    objective = Objective(config, FrozenTarget(target_dir), net.config.hidden_layers())
    return objective.evaluate(net, held)
