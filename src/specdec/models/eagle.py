"""EAGLE-1 and EAGLE-3 drafter networks: one decoder layer over the target's features.

EAGLE-1 (layout of SGLang's ``LlamaForCausalLMEagle``): ``fc(cat(e(x_{t+1}), f_t))`` -> a decoder
layer without input norm -> the predicted next feature, read by the target's own LM head. The
feature f_t is the target's last hidden state after its final norm.

EAGLE-3 (layout of SGLang/vLLM ``LlamaForCausalLMEagle3``): ``fc(cat(low, mid, high))`` fuses three
target layers at the first step (later steps feed the drafter's own output back); the layer's
attention reads ``cat(input_layernorm(e), hidden_norm(h))`` (2 h wide) with h as the residual; a
final norm and the drafter's own head over a draft vocabulary (``d2t``: draft id -> target id
offset, ``t2d``: which target ids are in it).

Feature indexing, one convention everywhere in specdec: transformers' ``hidden_states``, where 0 is
the embedding output, i the output of decoder layer i (1-based) and L the final-normed output.
EAGLE-3's config stores ``eagle_aux_hidden_state_layer_ids`` in the convention SGLang and SpecForge
use, the output of 0-based layer i, which is ``hidden_states[i + 1]``.

``EagleNet`` is the PyTorch module (training, and the reference); ``EagleRuntime`` packs the same
weights for the shape-invariant kernels and runs on a ``FeatureCache``, the drafter's own KV cache.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import DrafterMismatchError, ModelLoadError
from specdec.backends.native import NativeCache
from specdec.models import kernels, llama
from specdec.models.files import load_weights_into, save_net
from specdec.models.layers import MLP, Attention, RMSNorm, causal_mask

EAGLE1_ARCH = "LlamaForCausalLMEagle"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
TTT_DECAY = 0.8


@dataclass(frozen=True)
class TargetRecord:
    """The target a drafter was trained for: shapes that must fit, and a fingerprint of its weights."""

    architecture: str = ""
    model_type: str = ""
    hidden_size: int = 0
    num_hidden_layers: int = 0
    vocab_size: int = 0
    fingerprint: str = ""

    @classmethod
    def of(cls, target) -> "TargetRecord":
        config = target.config
        arch = (getattr(config, "architectures", None) or [""])[0]
        return cls(arch, getattr(config, "model_type", ""), int(config.hidden_size), int(target.num_layers),
                   int(target.vocab_size), target.fingerprint())

    def check(self, target, what: str, hidden: int, vocab: int, layers: tuple[int, ...] = ()) -> str | None:
        """Raise DrafterMismatchError when a drafter of this hidden size and vocabulary, reading
        ``hidden_states`` ``layers``, does not fit ``target``; return a warning text when only the
        weights differ from those it was trained for."""
        if hidden != int(target.config.hidden_size):
            raise DrafterMismatchError(f"{what} has hidden size {hidden}, the target {target.config.hidden_size}")
        if vocab != target.vocab_size:
            raise DrafterMismatchError(f"{what} has vocabulary size {vocab}, the target {target.vocab_size}")
        if layers and max(layers) > target.num_layers:
            raise DrafterMismatchError(f"{what} reads hidden_states {list(layers)}, the target has "
                                       f"{target.num_layers} layers")
        if self.num_hidden_layers and self.num_hidden_layers != target.num_layers:
            raise DrafterMismatchError(f"{what} was trained for a target with {self.num_hidden_layers} layers, "
                                       f"this target has {target.num_layers}")
        if self.fingerprint and self.fingerprint != target.fingerprint():
            return (f"{what} was trained for another target of the same shapes (weights fingerprint "
                    f"{self.fingerprint}, this target {target.fingerprint()}): acceptance may be far lower")
        return None


@dataclass(frozen=True)
class EagleConfig:
    version: int                       # 1 or 3
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                    # the target's
    draft_vocab_size: int              # EAGLE-3's head; EAGLE-1 uses the target's head (= vocab_size)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3: 0-based layers whose outputs are fused (hidden_states[i + 1])
    target: TargetRecord = field(default_factory=TargetRecord)
    training: dict = field(default_factory=dict)  # what the trainer recorded (predicted tau, data, time)

    @property
    def name(self) -> str:
        return "eagle3" if self.version == 3 else "eagle"

    def hidden_layers(self) -> tuple[int, ...]:
        """The target features this drafter reads, in transformers' ``hidden_states`` indexing."""
        if self.version == 3:
            return tuple(i + 1 for i in self.aux_layer_ids)
        return (self.target.num_hidden_layers,)  # the final-normed last hidden state

    @property
    def feature_size(self) -> int:
        return self.hidden_size * (len(self.aux_layer_ids) if self.version == 3 else 1)

    @classmethod
    def for_target(cls, target, version: int, draft_vocab_size: int | None = None,
                   aux_layer_ids: tuple[int, ...] | None = None, intermediate_size: int | None = None) -> "EagleConfig":
        """A drafter shaped like one layer of ``target`` (a specdec Target)."""
        config = target.config
        layers = int(target.num_layers)
        heads = int(config.num_attention_heads)
        if aux_layer_ids is None:
            aux_layer_ids = (1, layers // 2 - 1, layers - 4) if layers >= 6 else tuple(range(min(3, layers)))
        params = llama.rope_parameters(config)
        return cls(version=version, hidden_size=int(config.hidden_size), num_attention_heads=heads,
                   num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                   intermediate_size=int(intermediate_size or config.intermediate_size),
                   vocab_size=int(target.vocab_size),
                   draft_vocab_size=int(draft_vocab_size or target.vocab_size) if version == 3 else int(target.vocab_size),
                   rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)), rope_theta=float(params["rope_theta"]),
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
                   aux_layer_ids=tuple(aux_layer_ids) if version == 3 else (), target=TargetRecord.of(target))

    # Hugging Face style config.json, in the layout each serving engine reads.
    def to_json(self) -> dict:
        common = {
            "model_type": "llama", "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "specdec": {"method": self.name, "feature_convention": "hidden_states",
                        "hidden_states_read": list(self.hidden_layers()), "target": asdict(self.target),
                        "training": self.training},
        }
        if self.version == 3:
            return {"architectures": [EAGLE3_ARCH], **common, "draft_vocab_size": self.draft_vocab_size,
                    "target_hidden_size": self.hidden_size,
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                     "use_aux_hidden_state": True}}
        return {"architectures": [EAGLE1_ARCH], **common}

    @classmethod
    def from_json(cls, data: dict, where: str = "config.json") -> "EagleConfig":
        arch = (data.get("architectures") or [""])[0]
        if arch not in (EAGLE1_ARCH, EAGLE3_ARCH):
            raise DrafterMismatchError(f"{where} describes {method_of(data)}, not an EAGLE drafter")
        version = 3 if arch == EAGLE3_ARCH else 1
        extra = data.get("specdec") or {}
        try:
            heads = int(data["num_attention_heads"])
            aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
            return cls(version=version, hidden_size=int(data["hidden_size"]), num_attention_heads=heads,
                       num_key_value_heads=int(data.get("num_key_value_heads") or heads),
                       head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
                       intermediate_size=int(data["intermediate_size"]), vocab_size=int(data["vocab_size"]),
                       draft_vocab_size=int(data.get("draft_vocab_size") or data["vocab_size"]),
                       rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(data.get("rope_theta", 10000.0)),
                       max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                       aux_layer_ids=tuple(int(i) for i in aux),
                       target=TargetRecord(**(extra.get("target") or {})), training=extra.get("training") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"malformed {where}: {exc}") from None


def describes_dspark(data: dict) -> bool:
    """Whether a DFlash-architecture config.json is DSpark's (DFlash's layout plus a Markov head)."""
    extra = data.get("dflash_config") or {}
    return extra.get("projector_type") == "dspark" or "markov_rank" in extra


def method_of(data: dict) -> str:
    """The drafter method a config.json describes, in words (for wrong-method refusals)."""
    arch = (data.get("architectures") or [""])[0]
    if arch == EAGLE3_ARCH:
        return "an EAGLE-3 drafter"
    if arch == EAGLE1_ARCH:
        return "an EAGLE-1 drafter"
    if "medusa_num_heads" in data:
        return "a Medusa drafter"
    if arch == "DFlashDraftModel":
        return "a DSpark drafter" if describes_dspark(data) else "a DFlash drafter"
    if arch:
        return f"a {arch} model"
    return "no drafter specdec knows"


def read_config_json(path: Path) -> dict:
    """config.json of a drafter folder; one-line errors for a missing folder or malformed file."""
    path = Path(path)
    file = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"drafter folder does not exist: {path}")
    if not file.is_file():
        raise ModelLoadError(f"not a drafter folder (no config.json): {path}")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"malformed {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"malformed {file}: not a JSON object")
    return data


# ---------------------------------------------------------------------------------------------
# The PyTorch network.

class EagleLayer(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        h = config.hidden_size
        wide = 2 * h if config.version == 3 else h
        self.self_attn = Attention(wide, h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                   config.rope_theta)
        self.mlp = MLP(h, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        if config.version == 3:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)


class EagleNet(nn.Module):
    """The trainable drafter. ``rollout`` runs it as inference does, several steps deep."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if config.version == 3:
            self.fc = nn.Linear(config.feature_size, h, bias=False)
            self.midlayer = EagleLayer(config)
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * h, h, bias=True)
            self.layers = nn.ModuleList([EagleLayer(config)])

    @property
    def layer(self) -> EagleLayer:
        return self.midlayer if self.config.version == 3 else self.layers[0]

    def set_draft_vocab(self, used: torch.Tensor) -> None:
        """used: the sorted target ids of the draft vocabulary [draft_vocab]."""
        self.d2t.copy_(used - torch.arange(used.numel()))
        self.t2d.zero_()
        self.t2d[used] = True

    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft-vocabulary entry [draft_vocab]."""
        if self.config.version != 3:
            return torch.arange(self.config.vocab_size)
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def logits(self, out: torch.Tensor, target_head: torch.Tensor | None) -> torch.Tensor:
        """Draft-vocabulary logits of outputs [.., H] (EAGLE-1 reads the target's head [V, H])."""
        if self.config.version == 3:
            return self.lm_head(self.norm(out))
        return out @ target_head.t()

    def rollout(self, embeds: list[torch.Tensor], features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Outputs of ``steps`` drafting steps at every position, each fed the previous step's output.

        embeds[i]: [B, N, H] the embedding of the token step i reads at each index (x_{t+1+i});
        features: [B, N, F] the target's features at t. Step i at index t attends to step 0 at
        indices <= t and to steps 1..i at index t itself: exactly the keys a chain drafted from t
        sees at inference. Returns [B, N, H] per step (the drafter's pre-norm output). Rows padded
        at the end need no key mask: a valid query never sees a later column.
        """
        layer, config = self.layer, self.config
        batch, length, _ = features.shape
        device = features.device
        index = torch.arange(length, device=device)
        keys, values, outputs = [], [], []
        previous = None
        for step in range(steps):
            if config.version == 3:
                hidden = self.fc(features) if step == 0 else previous
                x_attn = torch.cat([layer.input_layernorm(embeds[step]), layer.hidden_norm(hidden)], dim=-1)
            else:
                hidden = self.fc(torch.cat([embeds[step], features if step == 0 else previous], dim=-1))
                x_attn = hidden
            positions = (index + step).expand(batch, length)
            q, k, v = layer.self_attn.project(x_attn, positions)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal_mask(length, device)] + [torch.eye(length, dtype=torch.bool, device=device)] * step,
                             dim=1)  # [N, (step + 1) N]
            h2 = hidden + layer.self_attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask)
            previous = h2 + layer.mlp(layer.post_attention_layernorm(h2))
            outputs.append(previous)
        return outputs


# ---------------------------------------------------------------------------------------------
# Saving and loading (safetensors only).

def save(net: EagleNet, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
         extra: dict[str, str] | None = None) -> Path:
    """Write config.json, model.safetensors (and ``extra`` text files) to ``out_dir``, atomically."""
    return save_net(net, out_dir, WEIGHTS, dtype, extra)


def load_config(path: str | os.PathLike) -> EagleConfig:
    return EagleConfig.from_json(read_config_json(Path(path)), str(Path(path) / "config.json"))


def load_net(path: str | os.PathLike, expect_version: int | None = None) -> EagleNet:
    """The network of an EAGLE folder in float32; wrong method, missing or truncated files: one line."""
    path = Path(path)
    config = load_config(path)
    if expect_version is not None and config.version != expect_version:
        raise DrafterMismatchError(f"{path} holds an EAGLE-{config.version} drafter, not EAGLE-{expect_version}; "
                                   f"use --drafter {config.name}")
    return load_weights_into(EagleNet(config), path)


# ---------------------------------------------------------------------------------------------
# Inference on the kernels.

class EagleRuntime:
    """The network's weights packed for the kernels, plus the target's embedding (and head, EAGLE-1)."""

    def __init__(self, net: EagleNet, embed: torch.Tensor, target, dtype: torch.dtype, qtype: str | None = None,
                 vocabulary: torch.Tensor | None = None):
        """``target``: whose head EAGLE-1 reads; ``qtype``: block-quantize the network's matrices (beside a
        quantized target, ``llama.drafter_qtype``); ``vocabulary``: EAGLE-1 drafts from these rows of the
        target's head only (sorted target ids; drafters.base.read_draft_vocabulary)."""
        config = self.config = net.config
        state = {name: value.detach().float() for name, value in net.state_dict().items()}
        self.dtype = dtype
        prefix = "midlayer." if config.version == 3 else "layers.0."

        def get(name: str, required: bool = True):
            if name not in state and not required:
                return None
            return state[name]

        layer = llama.pack_layer(get, prefix, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                 dtype, input_norm=False, qtype=qtype)
        if config.version == 3:
            head = llama.matrix(state["lm_head.weight"], dtype, state["norm.weight"], qtype)
            self.in_norm = state[prefix + "input_layernorm.weight"].to(dtype)
            self.hidden_norm = state[prefix + "hidden_norm.weight"].to(dtype)
            self.draft_ids = net.draft_ids().clone()
            self.head_eps = config.rms_norm_eps
        else:  # the target's head, or its rows of the draft vocabulary: a product that many rows long
            head = llama.head_matrix(target, dtype, None, qtype, rows=vocabulary)
            self.draft_ids = None if vocabulary is None else vocabulary.clone()
            self.head_eps = None
        self.fc = llama.matrix(state["fc.weight"], dtype, qtype=qtype)
        self.fc_bias = llama.small(state.get("fc.bias"), dtype)
        self.core = llama.drafter_core(config, embed, [layer], head, dtype)

    def new_cache(self, batch_size: int, capacity: int | None) -> "FeatureCache":
        return FeatureCache(self, batch_size, capacity)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., V_draft] of outputs [.., H]."""
        return kernels.linear(out.contiguous(), self.core.head, norm_eps=self.head_eps)

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor, fused: bool = True):
        """(residual stream h, attention input) [B * n, .] for tokens [B, n] and features [B, n, F or H].

        fused: the features are the target's (EAGLE-3 projects them with fc); False: the drafter's own
        outputs, which EAGLE-3 reads as they are (EAGLE-1 projects both kinds).
        """
        emb = F.embedding(tokens.reshape(-1), self.core.embed)  # [M, H]
        feats = features.reshape(emb.shape[0], -1).to(self.dtype).contiguous()
        if self.config.version == 3:
            hidden = kernels.linear(feats, self.fc) if fused else feats
            x_attn = torch.cat([kernels.rms_norm(emb, self.in_norm, self.config.rms_norm_eps),
                                kernels.rms_norm(hidden, self.hidden_norm, self.config.rms_norm_eps)], dim=1)
            return hidden, x_attn
        hidden = kernels.linear(torch.cat([emb, feats], dim=1), self.fc, bias=self.fc_bias)
        return hidden, hidden


class FeatureCache(NativeCache):
    """The drafter's own KV cache: a NativeCache whose block inputs are (token, feature) pairs.

    ``run(tokens, features, valid, ...)`` appends a block (RaggedCache bookkeeping: ragged rows, tree
    masks, one rollback primitive) and returns the drafter's outputs [B, n, H].
    """

    def __init__(self, runtime: EagleRuntime, batch_size: int, capacity: int | None = None):
        self.runtime = runtime
        super().__init__(types.SimpleNamespace(model=runtime.core), batch_size, capacity)
        self._features, self._fused = None, True
        self._attn_in = None

    def run(self, tokens: torch.Tensor, features: torch.Tensor, valid: torch.Tensor | None = None,
            block_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
            fused: bool = True) -> torch.Tensor:
        """fused: ``features`` are the target's (False: the drafter's own outputs, see EagleRuntime.inputs)."""
        self._features, self._fused = features, fused
        try:
            block = self.begin(tokens, valid, stop=1, block_mask=block_mask, positions=positions)
        finally:
            self._features = None
        return block.states  # [B, n, H]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """One drafting step of a chain: tokens [B], the drafter's own outputs [B, H] -> outputs [B, H].

        What ``run`` does for one live column per row, without its generality (no block mask, no
        explicit positions): the bookkeeping a chain pays at every draft is a few tensor operations.
        Every row sees all its live columns, the same arithmetic as ``run`` (kernels.c).
        """
        batch = tokens.shape[0]
        if self.columns + 1 > self.capacity:
            self._grow(self.columns, self.columns + 1)
        past, positions = self.append(self.valid.new_ones(batch, 1), dense=True)
        positions = positions.reshape(-1).contiguous()  # [B], alive while the kernels run
        hidden, attn_in = self.runtime.inputs(tokens[:, None], features[:, None], fused=False)
        work = self._scratch(batch, 1)
        params = llama.block_params(self.model, self.kv, past, positions, work)
        return llama.decoder_layer_from(self.model, 0, attn_in, None, hidden, params, self.kv,
                                        self.valid[:, None, :].contiguous())

    def _inputs(self, tokens):
        hidden, self._attn_in = self.runtime.inputs(tokens, self._features, self._fused)
        return hidden

    def _layer(self, index, block):
        visible = block.masks[self.model.layers[index].window]
        out = llama.decoder_layer_from(self.model, index, self._attn_in, None, block.hidden, block.params,
                                       self.kv, visible)
        self._attn_in = None
        return out


def with_training(config: EagleConfig, training: dict) -> EagleConfig:
    return replace(config, training=training)
