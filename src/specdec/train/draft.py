"""Distil a small draft model for a real target from its cached features (``specdec train distill`` on any
target whose tokenizer is not the zoo's).

The network is distillation's (distill.py): a small Llama sharing the target's tokenizer, trained
towards the target's next-token distributions. What differs is the data:
ShareGPT's train split (features.py ``DataRecipe``), the loss a soft cross-entropy to the target's
distribution (the KL plus a constant), with the target's distributions read from the
feature cache the other drafters of this target share (the final normed state: logits are one
product with the head), so the frozen 135M target never runs inside the loop.

A student narrower than the target starts from the target's embeddings projected on their leading
right singular vectors (E P, P orthonormal [H, h]): its tied head then scores tokens as the target's
would score a state's projection, and only its layers start from nothing.

The offline metric is exact for a draft model: on held-out greedy continuations, a draft model's
i-th draft from an anchor, when the drafts before it were accepted, is its prediction with the true
tokens as context; so one teacher-forced pass gives the accepted run at every anchor (features.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specdec.train import config as train_config
from specdec.train.config import config_to_dict
from specdec.train.features import (TINY_DATA, DataRecipe, acceptance_summary, anchor_mask, leading_matches, prepare_run,
                                    shifted, soft_cross_entropy)
from specdec.train.loop import OptimConfig
from specdec.train.target import ModelShape, build_model, count_parameters, export_model


@dataclass(frozen=True)
class DraftTrainConfig(DataRecipe):
    shape: ModelShape = field(default_factory=lambda: ModelShape(layers=2, hidden=256, heads=4, kv_heads=2,
                                                                 intermediate=768, max_position_embeddings=8192,
                                                                 rope_theta=100000.0))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(steps=400, lr=3e-3, warmup_steps=30,
                                                                   eval_every=100, ckpt_every_steps=20, bfloat16=True))
    temperature: float = 1.0
    eval_depth: int = 6
    init_from_target: bool = True   # the target's embeddings, projected to the student's width


PRESETS: dict[str, DraftTrainConfig] = {
    # SmolLM2-135M-Instruct: the ShareGPT text and feature cache EAGLE-1 and Medusa train on; a 2-layer,
    # 256-wide student (14M parameters, most of them the tied embeddings), sized for about 45 minutes.
    "draft-sharegpt": DraftTrainConfig(batch_size=8, train_sequences=1536, heldout_sequences=48, prefix_len=256,
                                       generated_len=256, source="sharegpt"),
    "tiny": DraftTrainConfig(shape=ModelShape(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                              max_position_embeddings=256),
                             optim=OptimConfig(steps=8, lr=3e-3, warmup_steps=2, eval_every=4, ckpt_every_steps=4),
                             eval_depth=3, **TINY_DATA),
}


def load_config(path: str | None, preset: str) -> DraftTrainConfig:
    return train_config.load_config(DraftTrainConfig, PRESETS, path, preset, "draft model training")


def config_from_dict(values: dict[str, Any]) -> DraftTrainConfig:
    return train_config.config_from_dict(DraftTrainConfig, values, "draft model training")


FINAL_NORM_INIT = 0.2


@torch.no_grad()
def init_from_projection(student: torch.nn.Module, embed: torch.Tensor) -> None:
    """Student embeddings (tied to its head) = the target's [V, H] times its top-h right singular vectors."""
    width = student.config.hidden_size
    _, _, vh = torch.linalg.svd(embed.float(), full_matrices=False)   # vh [H, H]
    student.get_input_embeddings().weight.copy_(embed.float() @ vh[:width].t())
    # Those rows are long (SmolLM2's: norm 3.2 on average), so with a unit final norm the fresh student would
    # score every token near its input 30 nats above the rest (a first loss of 36 against the uniform 10.8);
    # a small learnable final scale starts it near uniform instead.
    student.model.norm.weight.fill_(FINAL_NORM_INIT)


class Objective:
    def __init__(self, config: DraftTrainConfig, frozen, final_layer: int):
        self.config, self.frozen, self.layers = config, frozen, (final_layer,)

    def loss(self, student, batch) -> torch.Tensor:
        tokens, valid = batch
        _, target_logits = self.frozen.run(tokens, valid, self.layers)            # [B, T, V]
        logits = student(input_ids=tokens, attention_mask=valid.long()).logits    # [B, T, V]
        return soft_cross_entropy(logits, target_logits, valid, self.config.temperature)

    @torch.no_grad()
    def evaluate(self, student, held) -> dict[str, float]:
        student.eval()
        depth = self.config.eval_depth
        accepted, walks = [], []
        for start in range(0, held.tokens.shape[0], 8):
            rows = torch.arange(start, min(start + 8, held.tokens.shape[0]))
            tokens, valid = held.batch(rows)
            _, logits = self.frozen.run(tokens, valid, self.layers)
            guesses = student(input_ids=tokens, attention_mask=valid.long()).logits.argmax(-1)  # [b, T]
            pairs = tokens.shape[1] - 1
            drafts = torch.stack([shifted(guesses, 1 + i, pairs, -2) for i in range(depth)], -1)
            truth = torch.stack([shifted(logits.argmax(-1), 1 + i, pairs, -1) for i in range(depth)], -1)
            anchors = anchor_mask(valid, held.prompt_len[rows], pairs, depth)
            counts = leading_matches(drafts == truth)                             # [b, N]
            accepted.append(counts[anchors])
            walks += [(counts[i], int(held.prompt_len[row]) - 1, int(held.lengths[row])) for i, row in enumerate(rows)]
        student.train()
        return acceptance_summary(torch.cat(accepted), depth, walks)


def train_draft(config: DraftTrainConfig, target_dir: Path, out_dir: Path, *, ckpt_dir: Path | None = None,
                resume: bool = False, max_minutes: float | None = None, log: Callable[[str], None] | None = None,
                data_dir: Path | None = None, data_only: bool = False) -> dict[str, Any]:
    """Distil (or resume distilling) a draft model for ``target_dir``; export it to ``out_dir``."""
    from specdec.models.eagle import TargetRecord

    out_dir, target_dir = Path(out_dir), Path(target_dir)
    run = prepare_run("draft", config, target_dir, out_dir, ckpt_dir, resume, config_from_dict, log, data_dir,
                      data_only)
    config, target = run.config, run.target
    eos = target.config.eos_token_id
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else eos
    student = build_model(config.shape, target.vocab_size, {"eos": eos, "pad": pad}, config.seed)
    student.config.bos_token_id = target.config.bos_token_id
    frozen = run.frozen((target.num_layers,))
    if config.init_from_target and not resume:
        init_from_projection(student, frozen.embed)
    result, final, useless = run.fit(student, Objective(config, frozen, target.num_layers), "draft", 41, resume,
                                       max_minutes, "tau_k4", "the draft model")
    summary = {
        "kind": "draft", "parameters": count_parameters(student), "target_parameters": count_parameters(frozen.model),
        **result.summary_fields(), **run.data_fields(),
        "offline": {key: round(value, 4) for key, value in final.items()}, "low_acceptance_warning": useless,
        "target": asdict(TargetRecord.of(target)), "config": config_to_dict(config),
    }
    export_model(student, target_dir, out_dir, summary)
    return summary


__all__ = ["DraftTrainConfig", "PRESETS", "load_config", "train_draft"]
