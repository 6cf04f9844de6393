"""Medusa heads: extra decoding heads on the target's last hidden state (Medusa-1, target frozen).

Head i (0-based) predicts the token i + 2 ahead of the feature's position (the target's own head
predicts i + 1): ``num_layers`` residual blocks ``x + SiLU(W x + b)`` (W zero-initialised, so a new
head starts as the target's head), then ``Linear(h, V, bias=False)``. The feature is the target's
final-normed last hidden state (transformers' ``hidden_states[L]``). With ``original_lm_head`` (vLLM's
config key) every head ends in the target's own LM head instead: the folder holds the residual blocks
only and the head comes from the target at load, which keeps a large-vocabulary target's drafter small
(SmolLM2's head alone is 49,152 x 576).

Layout (the Medusa repository's): config.json with ``medusa_num_heads``, ``medusa_num_layers``,
``hidden_size``, ``vocab_size`` and the candidate tree ``medusa_choices``; weights in
``medusa_lm_head.safetensors`` named ``{head}.{block}.linear.{weight,bias}`` and ``{head}.{num_layers}.weight``.
A tree is a list of paths: ``[0, 1]`` is head 0's best token, then head 1's second best.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import DrafterMismatchError, ModelLoadError
from specdec.models import kernels, llama
from specdec.models.eagle import TargetRecord, method_of, read_config_json
from specdec.models.files import check_weights, save_folder

WEIGHTS = "medusa_lm_head.safetensors"


@dataclass(frozen=True)
class MedusaConfig:
    medusa_num_heads: int
    medusa_num_layers: int
    hidden_size: int
    vocab_size: int
    medusa_choices: tuple[tuple[int, ...], ...] = ()
    target: TargetRecord = field(default_factory=TargetRecord)
    training: dict = field(default_factory=dict)
    original_lm_head: bool = False

    def hidden_layers(self) -> tuple[int, ...]:
        return (self.target.num_hidden_layers,)

    def to_json(self) -> dict:
        return {"architectures": ["MedusaModel"], "medusa_num_heads": self.medusa_num_heads,
                "medusa_num_layers": self.medusa_num_layers, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, "medusa_choices": [list(p) for p in self.medusa_choices],
                "original_lm_head": self.original_lm_head,
                "specdec": {"method": "medusa", "feature_convention": "hidden_states",
                            "hidden_states_read": list(self.hidden_layers()), "target": asdict(self.target),
                            "training": self.training}}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "MedusaConfig":
        if "medusa_num_heads" not in data:
            raise DrafterMismatchError(f"{where} describes {method_of(data)}, not a Medusa drafter")
        extra = data.get("specdec") or {}
        try:
            return cls(int(data["medusa_num_heads"]), int(data.get("medusa_num_layers", 1)), int(data["hidden_size"]),
                       int(data["vocab_size"]), tuple(tuple(int(i) for i in p) for p in data.get("medusa_choices") or ()),
                       TargetRecord(**(extra.get("target") or {})), extra.get("training") or {},
                       bool(data.get("original_lm_head", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"malformed {where}: {exc}") from None


class ResBlock(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        own = [] if config.original_lm_head else [nn.Linear(h, config.vocab_size, bias=False)]
        self.heads = nn.ModuleList([nn.Sequential(*[ResBlock(h) for _ in range(config.medusa_num_layers)], *own)
                                    for _ in range(config.medusa_num_heads)])
        self.shared_head: torch.Tensor | None = None  # original_lm_head: the target's [V, H], never saved

    def init_from_head(self, head: torch.Tensor) -> None:
        """Start every vocabulary projection from the target's LM head [V, H] (original_lm_head: use it)."""
        if self.config.original_lm_head:
            self.shared_head = head.detach()
            return
        with torch.no_grad():
            for module in self.heads:
                module[-1].weight.copy_(head)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [.., H] -> logits [.., heads, V]."""
        if not self.config.original_lm_head:
            return torch.stack([head(features) for head in self.heads], dim=-2)
        if self.shared_head is None:
            raise RuntimeError("these Medusa heads read the target's LM head: call init_from_head(head) first")
        return F.linear(torch.stack([head(features) for head in self.heads], dim=-2), self.shared_head)


def save(net: MedusaHeads, out_dir, dtype: torch.dtype = torch.bfloat16, extra: dict[str, str] | None = None) -> Path:
    tensors = {name.removeprefix("heads."): value for name, value in net.state_dict().items()}
    return save_folder(out_dir, net.config.to_json(), WEIGHTS, tensors, dtype, extra)


def load_net(path: str | os.PathLike) -> MedusaHeads:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = MedusaConfig.from_json(read_config_json(path), str(path / "config.json"))
    file = path / WEIGHTS
    if not file.is_file():
        raise ModelLoadError(f"no {WEIGHTS} in {path} (specdec reads safetensors only)")
    try:
        weights = load_file(file)
    except (SafetensorError, OSError) as exc:
        text = str(exc).strip()
        raise ModelLoadError(f"cannot read weights file {file}: {text.splitlines()[0] if text else type(exc).__name__}") from None
    net = MedusaHeads(config)
    expected = {name.removeprefix("heads."): value for name, value in net.state_dict().items()}
    check_weights(weights, expected, file)
    net.load_state_dict({"heads." + name: weights[name].float() for name in expected})
    return net.eval()


class MedusaRuntime:
    """The heads packed for the kernels: features [B, H] -> logits [B, heads, V]. ``target``: whose LM
    head every head ends in (original_lm_head; one product over all heads' rows)."""

    def __init__(self, net: MedusaHeads, dtype: torch.dtype, target=None, vocabulary: torch.Tensor | None = None,
                 heads: int | None = None):
        """``vocabulary``: heads ending in the target's head compute only these rows of it (sorted target ids,
        ``draft_ids``); ``heads``: run only the first that many heads (those a tree reaches)."""
        self.dtype = dtype
        self.blocks, self.heads = [], []
        shared = net.config.original_lm_head
        self.draft_ids = None
        for module in list(net.heads)[:heads]:
            blocks = module if shared else module[:-1]
            self.blocks.append([(llama.matrix(block.linear.weight.detach().float(), dtype),
                                 block.linear.bias.detach().to(dtype).contiguous()) for block in blocks])
            if not shared:
                self.heads.append(llama.matrix(module[-1].weight.detach().float(), dtype))
        self.shared_head = llama.head_matrix(target, dtype, rows=vocabulary) if shared else None
        if shared and vocabulary is not None:
            self.draft_ids = vocabulary.clone()

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        x0 = features.to(self.dtype).contiguous()
        out = []
        for i, blocks in enumerate(self.blocks):
            x = x0
            for weight, bias in blocks:
                x = x + F.silu(kernels.linear(x, weight, bias=bias))
            out.append(x if self.shared_head is not None else kernels.linear(x.contiguous(), self.heads[i]))
        stacked = torch.stack(out, dim=-2)  # [B, heads, H or V]
        if self.shared_head is None:
            return stacked
        rows = stacked.reshape(-1, stacked.shape[-1]).contiguous()
        return kernels.linear(rows, self.shared_head).reshape(*stacked.shape[:-1], -1)


def with_training(config: MedusaConfig, choices, training: dict) -> MedusaConfig:
    return replace(config, medusa_choices=tuple(tuple(p) for p in choices), training=training)
