"""DSpark: DFlash's one-pass block drafter with a sequential (Markov) head and a confidence head.

The backbone is DFlash's (models/dflash.py: the fused-context projection, the decoder layers, the
block-sparse training pass, the context cache and its kernels), with three differences:

* every slot of the block predicts, the anchor's too: B inputs ``[anchor, mask, ..., mask]`` at
  positions a .. a + B - 1 give B drafts, slot k drafting token a + k + 1;
* a Markov head adds ``W2 W1[x_{k-1}]`` (W1: an embedding of rank r, W2: r -> vocabulary) to slot
  k's logits, x_{k-1} being the draft before it (the anchor for slot 0). Drafts are taken left to
  right, so each draft's distribution is an exact softmax given the drafts before it, which is
  what speculative sampling needs. The ``gated`` variant scales that term by a sigmoid gate of
  [hidden; W1 x_{k-1}];
* a confidence head ``c_k = sigmoid(proj([hidden_k; W1 x_{k-1}]))`` estimates the probability that
  draft k is accepted given every draft before it was. It reads the drafts before k only, never
  draft k, so a verifier may choose how many drafts to check from it without losing exactness.
  Per-position temperatures (calibration, ``confidence_temperatures``) divide its logit.

Layout (the DFlash layout, as SpecForge writes DSpark and vLLM's ``dspark`` method loads it):
config.json is DFlash's with ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_alpha`` and ``projector_type: "dspark"`` inside ``dflash_config``; the weights add
``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r] (a Linear r -> V),
``markov_head.gate.weight`` (gated only) and ``confidence_head.proj.weight`` / ``.bias`` [1, H + r].
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import DrafterMismatchError, ModelLoadError
from specdec.models import dflash, kernels, llama
from specdec.models.eagle import describes_dspark, method_of, read_config_json
from specdec.models.files import load_weights_into, save_net

PROJECTOR = "dspark"
HEAD_TYPES = ("vanilla", "gated")


@dataclass(frozen=True)
class DSparkConfig(dflash.DFlashConfig):
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_alpha: float = 1.0           # the confidence loss's weight in training
    confidence_temperatures: tuple[float, ...] = ()  # per slot, dividing the confidence logit (calibration)

    name = "dspark"

    @classmethod
    def for_target(cls, target, num_layers: int, block_size: int, mask_token_id: int, markov_rank: int = 256,
                   markov_head_type: str = "vanilla", **options) -> "DSparkConfig":
        base = dflash.DFlashConfig.for_target(target, num_layers, block_size, mask_token_id, **options)
        return cls(**{**base.__dict__, "markov_rank": int(markov_rank), "markov_head_type": markov_head_type})

    def to_json(self) -> dict:
        data = super().to_json()
        data["dflash_config"].update(markov_rank=self.markov_rank, markov_head_type=self.markov_head_type,
                                     enable_confidence_head=self.enable_confidence_head,
                                     confidence_head_alpha=self.confidence_head_alpha, projector_type=PROJECTOR)
        data["specdec"].update(method="dspark", confidence_temperatures=list(self.confidence_temperatures),
                               slot_convention="slot k of a block anchored at a drafts token a + k + 1 (the anchor "
                                               "slot predicts)")
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = "config.json") -> "DSparkConfig":
        if (data.get("architectures") or [""])[0] != dflash.ARCH or not describes_dspark(data):
            raise DrafterMismatchError(f"{where} describes {method_of(data)}, not a DSpark drafter")
        base = dflash.DFlashConfig.from_json(data, where, allow_dspark=True)
        extra, ours = data["dflash_config"], data.get("specdec") or {}
        try:
            config = cls(**{**base.__dict__, "markov_rank": int(extra["markov_rank"]),
                            "markov_head_type": str(extra.get("markov_head_type", "vanilla")),
                            "enable_confidence_head": bool(extra.get("enable_confidence_head", True)),
                            "confidence_head_alpha": float(extra.get("confidence_head_alpha", 1.0)),
                            "confidence_temperatures": tuple(float(t) for t in
                                                             ours.get("confidence_temperatures") or ())})
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"malformed {where}: {exc}") from None
        if config.markov_head_type not in HEAD_TYPES:
            raise ModelLoadError(f"{where}: markov_head_type {config.markov_head_type!r} is not one specdec runs "
                                 f"({', '.join(HEAD_TYPES)})")
        if config.markov_rank < 1:
            raise ModelLoadError(f"{where}: markov_rank must be >= 1, got {config.markov_rank}")
        return config

    def temperature(self, slot: int) -> float:
        temps = self.confidence_temperatures
        return float(temps[min(slot, len(temps) - 1)]) if temps else 1.0


class MarkovHead(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        self.markov_w2 = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as DFlash: the term is learnt from zero
        if config.markov_head_type == "gated":
            self.gate = nn.Linear(config.hidden_size + config.markov_rank, 1)


class ConfidenceHead(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size + config.markov_rank, 1)


class DSparkNet(dflash.DFlashNet):
    """DFlash's network plus the Markov and confidence heads (the embedding and LM head stay the target's)."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config)
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(config)

    def markov(self, hidden: torch.Tensor, previous: torch.Tensor, rows: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the Markov term [.., V] added to the head's logits, the previous tokens' rank-r codes [.., r])
        for normed block outputs hidden [.., H] and the tokens before each slot ``previous`` [..]; with
        ``rows`` (a draft vocabulary's target ids) the term of those rows only, [.., len(rows)]."""
        code = self.markov_head.markov_w1(previous)
        weight = self.markov_head.markov_w2.weight
        term = F.linear(code, weight if rows is None else weight[rows])
        if self.config.markov_head_type == "gated":
            term = term * torch.sigmoid(self.markov_head.gate(torch.cat([hidden, code.to(hidden.dtype)], -1)))
        return term, code

    def confidence_logit(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit [..] (before calibration)."""
        return self.confidence_head.proj(torch.cat([hidden, code.to(hidden.dtype)], -1))[..., 0]


def previous_tokens(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, N, B] the token before each slot in training: the anchor's, then the true tokens a + 1 .. a + B - 1."""
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)
    b, n, _ = positions.shape
    return tokens.gather(1, positions.clamp(max=tokens.shape[1] - 1).reshape(b, -1)).view(b, n, block_size)


# ---------------------------------------------------------------------------------------------
# Saving and loading.

def save(net: DSparkNet, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
         extra: dict[str, str] | None = None) -> Path:
    return save_net(net, out_dir, dflash.WEIGHTS, dtype, extra)


def load_config(path: str | os.PathLike) -> DSparkConfig:
    return DSparkConfig.from_json(read_config_json(Path(path)), str(Path(path) / "config.json"))


def load_net(path: str | os.PathLike) -> DSparkNet:
    """The network of a DSpark folder in float32; wrong method, missing or truncated files: one line."""
    return load_weights_into(DSparkNet(load_config(path)), Path(path))



# ---------------------------------------------------------------------------------------------
# Inference on the kernels.

class DSparkRuntime(dflash.DFlashRuntime):
    """DFlash's packed network, plus the Markov and confidence heads."""

    def __init__(self, net: DSparkNet, embed: torch.Tensor, target, dtype: torch.dtype, qtype: str | None = None,
                 rows: torch.Tensor | None = None):
        super().__init__(net, embed, target, dtype, qtype, rows)
        config = net.config
        head = net.markov_head
        self.markov_w1 = head.markov_w1.weight.detach().float().clone()            # [V, r]
        w2 = head.markov_w2.weight.detach().float()
        self.markov_w2 = llama.matrix(w2 if rows is None else w2[rows], dtype)     # r -> V (or the rows) on the kernels
        self.gate = head.gate if config.markov_head_type == "gated" else None
        self.final_norm = net.norm.weight.detach().to(dtype)
        self.confidence = net.confidence_head if config.enable_confidence_head else None

    def normed(self, out: torch.Tensor) -> torch.Tensor:
        """The final norm of block outputs [.., H] (what the head and the confidence head read)."""
        shape = out.shape
        return kernels.rms_norm(out.reshape(-1, shape[-1]).contiguous(), self.final_norm, self.eps).view(shape)

    @torch.inference_mode()
    def slot(self, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor, index: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [B, V] of one slot with the Markov term of the previous tokens [B] (target ids), its
        calibrated confidence [B] or None) from the head's logits [B, V] and the normed output [B, H]; V is
        the draft vocabulary's size when the runtime has one."""
        logits, code = self.markov(logits, hidden, previous)
        if self.confidence is None:
            return logits, None
        return logits, self.confidences(hidden[:, None], code[:, None], index)[:, 0]

    def markov(self, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(one slot's logits [B, V] with the Markov term of the previous tokens [B], their rank-r codes [B, r])
        from the head's logits [B, V] and the normed output [B, H]. Callers hold inference mode."""
        code = F.embedding(previous, self.markov_w1)                                 # [B, r]
        term = kernels.linear(code.to(self.dtype), self.markov_w2).float()
        if self.gate is not None:
            term = term * torch.sigmoid(self.gate(torch.cat([hidden.float(), code], -1)))
        return logits.float() + term, code

    def greedy_chain(self, head: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(greedy drafts [B, S] in target ids, codes [B, S, r]) of the head's logits [B, S, V] in one kernel
        call: what ``markov`` and the argmax give slot after slot, the same bits. None where the kernels do not
        run it or the head is gated (the caller then loops)."""
        if self.gate is not None:
            return None
        return kernels.markov_greedy(head, self.markov_w1, self.markov_w2, self.rows, anchors)

    def confidences(self, hidden: torch.Tensor, codes: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Calibrated confidences [B, S] of S consecutive slots from slot ``first``: normed outputs
        [B, S, H] and the codes of the tokens before each slot [B, S, r], in one product."""
        logit = self.confidence.proj(torch.cat([hidden.float(), codes], -1))[..., 0]   # [B, S]
        temperatures = torch.tensor([self.config.temperature(first + j) for j in range(logit.shape[1])])
        return torch.sigmoid(logit / temperatures)
