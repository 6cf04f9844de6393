"""DFlash: a block-diffusion drafter that fills a whole block in one pass, over the target's fused features.

The network (layout of z-lab's ``DFlashDraftModel``, which SGLang's ``DFLASH`` and vLLM's
``dflash`` load): ``ctx = hidden_norm(fc(cat(target layers)))`` fuses several target layers, spread
from shallow to deep, once per committed token. A few Qwen3-style decoder layers (QK-norm) read a
block ``[anchor, mask, ..., mask]`` of the target's own embeddings; in every layer the keys and
values are ``[k_proj(ctx) ; k_proj(x)]`` and ``[v_proj(ctx) ; v_proj(x)]`` with that layer's own
projections, queries come from the block only, and the block attends to itself in both
directions. The final norm and the target's LM head turn block slots 1..B-1 into drafts of the
tokens after the anchor (the anchor slot predicts nothing).

Conventions (stored in config.json): ``dflash_config.target_layer_ids`` are 0-based layers whose
outputs are read, ``hidden_states[i + 1]`` in transformers' indexing; the ``mask_token_id`` is a
row of the target's embedding (the zoo uses the pad token, which never occurs inside a text).
Positions are absolute: a block anchored at position a sits at a .. a + B - 1, the context at the
positions of its tokens.

``DFlashNet`` is the PyTorch module (training, the offline metric, the reference); ``blocks``
runs every block of a sequence in one pass under the block-sparse mask of training (a block sees
the context strictly before its anchor and its own block). ``DFlashRuntime`` packs the same
weights for the kernels and drafts on a ``ContextCache``, which holds the committed context only.
"""

from __future__ import annotations

import os
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import DrafterMismatchError, ModelLoadError
from specdec.backends.cache import lower_triangle
from specdec.backends.native import NativeCache
from specdec.models import kernels, llama
from specdec.models.eagle import TargetRecord, describes_dspark, method_of, read_config_json
from specdec.models.files import load_weights_into, save_net
from specdec.models.layers import MLP, Attention, RMSNorm

ARCH = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
HF_ASSISTANT = "muse_glimmer_assistant"  # transformers' own DFlash assistant (5.24)


def build_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """0-based target layers spread from shallow to deep, as the DFlash reference picks them:
    round(1 + i (L - 4) / (n - 1)), or L // 2 for one; small targets: spread over all layers."""
    layers = num_target_layers
    if count == 1:
        return (layers // 2,)
    if layers >= count + 3:
        return tuple(round(1 + i * (layers - 4) / (count - 1)) for i in range(count))
    return tuple(sorted({round(i * (layers - 1) / (count - 1)) for i in range(count)}))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                     # the target's
    block_size: int
    target_layer_ids: tuple[int, ...]   # 0-based target layers read (hidden_states[i + 1])
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target: TargetRecord = field(default_factory=TargetRecord)
    training: dict = field(default_factory=dict)

    name = "dflash"

    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        return self.hidden_size * len(self.target_layer_ids)

    @classmethod
    def for_target(cls, target, num_layers: int, block_size: int, mask_token_id: int,
                   target_layer_ids: tuple[int, ...] | None = None, num_target_features: int = 3,
                   intermediate_size: int | None = None) -> "DFlashConfig":
        """A drafter shaped like ``num_layers`` layers of ``target`` (a specdec Target)."""
        config = target.config
        heads = int(config.num_attention_heads)
        ids = tuple(target_layer_ids or build_target_layer_ids(int(target.num_layers), num_target_features))
        return cls(hidden_size=int(config.hidden_size), num_hidden_layers=num_layers, num_attention_heads=heads,
                   num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                   intermediate_size=int(intermediate_size or config.intermediate_size),
                   vocab_size=int(target.vocab_size), block_size=block_size, target_layer_ids=ids,
                   mask_token_id=int(mask_token_id), rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
                   rope_theta=float(llama.rope_parameters(config)["rope_theta"]),
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
                   target=TargetRecord.of(target))

    def to_json(self) -> dict:
        return {
            "architectures": [ARCH], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "tie_word_embeddings": False, "attention_bias": False,
            "torch_dtype": "bfloat16", "block_size": self.block_size,
            "num_target_layers": self.target.num_hidden_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "specdec": {"method": "dflash", "feature_convention": "target_layer_ids are 0-based layer outputs, "
                        "hidden_states[i + 1]", "hidden_states_read": list(self.hidden_layers()),
                        "target": asdict(self.target), "training": self.training},
        }

    @classmethod
    def from_json(cls, data: dict, where: str = "config.json", allow_dspark: bool = False) -> "DFlashConfig":
        """allow_dspark: read a DSpark config's DFlash part (models/dspark.py); else a DSpark folder is refused,
        since DFlash would run it without its Markov head and silently lose its acceptance."""
        arch = (data.get("architectures") or [""])[0]
        if arch != ARCH or (describes_dspark(data) and not allow_dspark):
            raise DrafterMismatchError(f"{where} describes {method_of(data)}, not a DFlash drafter")
        extra = data.get("specdec") or {}
        try:
            heads = int(data["num_attention_heads"])
            dflash = data["dflash_config"]
            return cls(hidden_size=int(data["hidden_size"]), num_hidden_layers=int(data["num_hidden_layers"]),
                       num_attention_heads=heads, num_key_value_heads=int(data.get("num_key_value_heads") or heads),
                       head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
                       intermediate_size=int(data["intermediate_size"]), vocab_size=int(data["vocab_size"]),
                       block_size=int(data["block_size"]),
                       target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
                       mask_token_id=int(dflash["mask_token_id"]), rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(data.get("rope_theta", 10000.0)),
                       max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                       target=TargetRecord(**(extra.get("target") or {})), training=extra.get("training") or {})
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"malformed {where}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# The PyTorch network.

class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(h, h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                   config.rope_theta, qk_norm_eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, config.intermediate_size)


def block_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, block_k: torch.Tensor,
                    block_v: torch.Tensor, ctx_seen: torch.Tensor) -> torch.Tensor:
    """Attention of N blocks of B queries over the context and their own block, without a dense mask.

    q [b, h, N, B, D]; ctx_k, ctx_v [b, h, T, D]; block_k, block_v [b, h, N, B, D]; ctx_seen
    [b, N, T] bool, which context columns block n sees. One softmax over both parts, exactly
    attention under the mask [ctx_seen | own block] (``dense_block_mask`` is that mask, for tests).
    Returns [b, h, N, B, D].
    """
    scale = q.shape[-1] ** -0.5
    scores_ctx = torch.einsum("bhnid,bhtd->bhnit", q, ctx_k) * scale            # [b, h, N, B, T]
    scores_ctx = scores_ctx.masked_fill(~ctx_seen[:, None, :, None, :], float("-inf"))
    scores_blk = torch.einsum("bhnid,bhnjd->bhnij", q, block_k) * scale         # [b, h, N, B, B]
    probs = torch.softmax(torch.cat([scores_ctx, scores_blk], dim=-1), dim=-1)
    p_ctx, p_blk = probs.split([ctx_k.shape[2], block_k.shape[3]], dim=-1)
    return torch.einsum("bhnit,bhtd->bhnid", p_ctx, ctx_v) + torch.einsum("bhnij,bhnjd->bhnid", p_blk, block_v)


def dense_block_mask(ctx_seen: torch.Tensor, block_size: int) -> torch.Tensor:
    """The training mask over keys [context T ; N blocks of B] for queries [N blocks of B]: [b, N B, T + N B]."""
    b, n, t = ctx_seen.shape
    ctx = ctx_seen[:, :, None, :].expand(b, n, block_size, t).reshape(b, n * block_size, t)
    own = torch.block_diag(*[torch.ones(block_size, block_size, dtype=torch.bool)] * n).to(ctx_seen.device)
    return torch.cat([ctx, own[None].expand(b, -1, -1)], dim=2)


class DFlashNet(nn.Module):
    """The trainable drafter: its layers, the context projection and the norms (no embedding or head)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.feature_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The fused context [.., H] of the target's concatenated features [.., len(ids) H]."""
        return self.hidden_norm(self.fc(features))

    def blocks(self, features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor,
               ctx_seen: torch.Tensor | None = None) -> torch.Tensor:
        """Every block of a batch in one pass: the normed outputs [b, N, B, H].

        features [b, T, F]: the target's features of positions 0..T-1; block_embeds [b, N, B, H]:
        the embedded blocks [anchor, mask, ...]; anchors [b, N]: each block's anchor position
        (block n sits at anchors[n] + 0..B-1). ctx_seen [b, N, T]: context columns each block sees
        (default: those strictly before its anchor, as at inference).
        """
        b, n, size, h = block_embeds.shape
        length = features.shape[1]
        ctx = self.context(features)
        ctx_positions = torch.arange(length, device=features.device).expand(b, length)
        block_positions = (anchors[:, :, None] + torch.arange(size, device=anchors.device)).reshape(b, n * size)
        if ctx_seen is None:
            ctx_seen = torch.arange(length, device=features.device)[None, None, :] < anchors[:, :, None]
        x = block_embeds.reshape(b, n * size, h)
        for layer in self.layers:
            attn = layer.self_attn
            group = attn.heads // attn.kv_heads
            q, k, v = attn.project(layer.input_layernorm(x), block_positions)      # [b, *, N B, D]
            ck, cv = attn.keys(ctx, ctx_positions)                                  # [b, kv, T, D]
            if group > 1:
                k, v, ck, cv = (t.repeat_interleave(group, 1) for t in (k, v, ck, cv))
            split = (lambda t: t.reshape(b, t.shape[1], n, size, attn.head_dim))
            out = block_attention(split(q), ck, cv, split(k), split(v), ctx_seen)   # [b, h, N, B, D]
            out = out.permute(0, 2, 3, 1, 4).reshape(b, n * size, -1)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).reshape(b, n, size, h)


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Block token ids [b, N, B]: each anchor's token, then B - 1 mask tokens."""
    b, n = anchors.shape
    ids = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors.clamp(0, tokens.shape[1] - 1))
    return ids


# ---------------------------------------------------------------------------------------------
# Saving, loading and export.

def save(net: DFlashNet, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
         extra: dict[str, str] | None = None) -> Path:
    """config.json and model.safetensors in the DFlash layout (plus ``extra`` text files), atomically."""
    return save_net(net, out_dir, WEIGHTS, dtype, extra)


def load_config(path: str | os.PathLike) -> DFlashConfig:
    return DFlashConfig.from_json(read_config_json(Path(path)), str(Path(path) / "config.json"))


def load_net(path: str | os.PathLike) -> DFlashNet:
    """The network of a DFlash folder in float32; wrong method, missing or truncated files: one line."""
    path = Path(path)
    config = load_config(path)
    return load_weights_into(DFlashNet(config), path)


def hf_assistant_config(config: DFlashConfig, target_config) -> dict:
    """config.json of the same drafter as transformers' DFlash assistant (``muse_glimmer_assistant``)."""
    ids = {name: getattr(target_config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "architectures": ["MuseGlimmerAssistantModel"], "model_type": HF_ASSISTANT,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "layer_types": ["full_attention"] * config.num_hidden_layers, "hidden_act": "silu",
        "block_size": config.block_size, "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids), **{k: v for k, v in ids.items() if v is not None},
        "torch_dtype": "float32",
    }


HF_NAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def hf_state(net: DFlashNet) -> dict[str, torch.Tensor]:
    """The drafter's weights under the names of transformers' assistant; nothing else changes."""
    return {HF_NAMES.get(name, name): value for name, value in net.state_dict().items()}


def export_hf(net: DFlashNet, target_config, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
    """Write the drafter as transformers' DFlash assistant (load it with AutoModel and pass it to
    ``generate(assistant_model=..., speculation_type="dflash")``)."""
    from specdec.models.files import save_folder

    return save_folder(out_dir, hf_assistant_config(net.config, target_config), WEIGHTS, hf_state(net), dtype)


def hf_assistant(net: DFlashNet, target_config, dtype: torch.dtype = torch.float32, device="cpu"):
    """The same drafter as a transformers model, in memory (what ``export_hf`` writes, loaded)."""
    from specdec.backends import hf

    return hf.dflash_assistant(hf_assistant_config(net.config, target_config), hf_state(net), dtype, device)


# ---------------------------------------------------------------------------------------------
# Inference on the kernels.

class DFlashRuntime:
    """The network's weights packed for the kernels, with the target's embedding and LM head."""

    def __init__(self, net: DFlashNet, embed: torch.Tensor, target, dtype: torch.dtype, qtype: str | None = None,
                 rows: torch.Tensor | None = None):
        """``target``: whose LM head it reads; ``qtype``: block-quantize the network's matrices (beside a
        quantized target, ``llama.drafter_qtype``); ``rows``: a draft vocabulary (target ids), the only
        rows of the head computed (logits [.., len(rows)])."""
        config = self.config = net.config
        self.rows = rows
        state = {name: value.detach().float() for name, value in net.state_dict().items()}
        self.dtype = dtype

        def get(name: str, required: bool = True):
            return state[name] if required or name in state else None

        layers = [llama.pack_layer(get, f"layers.{i}.", config.num_attention_heads, config.num_key_value_heads,
                                   config.head_dim, dtype, input_norm=False, qtype=qtype)
                  for i in range(config.num_hidden_layers)]
        self.input_norms = [state[f"layers.{i}.input_layernorm.weight"].to(dtype)
                            for i in range(config.num_hidden_layers)]
        self.fc = llama.matrix(state["fc.weight"], dtype, qtype=qtype)
        self.hidden_norm = state["hidden_norm.weight"].to(dtype)
        self.eps = config.rms_norm_eps
        self.core = llama.drafter_core(config, embed, layers,
                                       llama.head_matrix(target, dtype, state["norm.weight"], qtype, rows=rows), dtype)

    def new_cache(self, batch_size: int, capacity: int | None) -> "ContextCache":
        return ContextCache(self, batch_size, capacity)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(features)) [M, H] of features [M, F]."""
        fused = kernels.linear(features.to(self.dtype).contiguous(), self.fc)
        return kernels.rms_norm(fused, self.hidden_norm, self.eps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The final norm and the target's head on block outputs [.., H]: [.., V] (or [.., len(rows)])."""
        return kernels.linear(out.contiguous(), self.core.head, norm_eps=self.eps)


class ContextCache(NativeCache):
    """The drafter's KV cache: one column per committed token, holding each layer's keys and values
    of that token's fused context. ``draft`` enters the new context columns and runs the block, which
    sees the whole context and itself, then drops the block's columns, so only committed context is
    ever kept. A few new columns (a step's accepted tokens) go through whole layers in one pass with
    the block; more (a prompt, or context that waited while no draft was asked for) are entered first
    on their own as keys and values only, since no column reads their outputs."""

    APART = 16  # new context columns from which they are entered on their own

    def __init__(self, runtime: DFlashRuntime, batch_size: int, capacity: int | None = None):
        self.runtime = runtime
        super().__init__(types.SimpleNamespace(model=runtime.core), batch_size, capacity)
        self._ctx: torch.Tensor | None = None  # [B, m, H] fused context of the pass's new columns
        self._split = 0  # columns of the pass that are context

    @torch.inference_mode()
    def draft(self, features: torch.Tensor | None, valid: torch.Tensor | None, anchors: torch.Tensor,
              block_size: int) -> torch.Tensor:
        """Block outputs [B, block_size, H] (pre-norm).

        features [B, m, F] / valid [B, m]: the target's features of the committed tokens not yet in
        the cache (right-aligned; None: none), anchors [B]: each row's last committed token.
        """
        batch = anchors.shape[0]
        layers = len(self.model.layers)
        m = 0 if features is None else features.shape[1]
        if m >= self.APART:
            self.enter_context(features, valid)
            m = 0
        elif m:
            self._ctx = self.runtime.context(features.flatten(0, 1)).view(batch, m, -1)
        mask = torch.full((batch, block_size), self.runtime.config.mask_token_id, dtype=torch.long,
                          device=anchors.device)
        mask[:, 0] = anchors
        tokens = mask if m == 0 else torch.cat([mask.new_zeros(batch, m), mask], dim=1)
        live = torch.ones(batch, m + block_size, dtype=torch.bool, device=anchors.device)
        if m:
            live[:, :m] = valid
        n = m + block_size
        sees = lower_triangle(n, anchors.device)
        sees[m:] = True  # the block sees all of the new context and all of itself
        self._split = m
        try:
            block = self.begin(tokens, live, stop=layers, block_mask=sees[None].expand(batch, n, n))
        finally:
            self._ctx, self._split = None, 0
        out = block.states[:, m:]
        self.truncate(self.lengths - block_size)  # keep the context, drop the block
        return out

    def _inputs(self, tokens):
        return F.embedding(tokens.reshape(-1), self.model.embed)  # the context columns' residuals are unused

    @torch.inference_mode()
    def enter_context(self, features: torch.Tensor, valid: torch.Tensor) -> None:
        """Context columns on their own: features [B, m, F] / valid [B, m] become m new columns holding each
        layer's keys and values of their fused context, computed for the valid entries only. A backlog of
        rows that joined at different times is mostly holes (11 rows of 401 columns holding 733 tokens, seen
        serving at 64 clients): the valid entries go through the products as one packed block, whose rows'
        bits do not depend on the block, and land at their columns; the holes hold zeros (attention adds
        0 x value), what the keys of a zero context are."""
        batch, m = valid.shape
        past = self.columns
        if past + m > self.capacity:
            self._grow(past, past + m)
        _, positions = self.append(valid)
        rows, columns = valid.nonzero(as_tuple=True)
        self.kv[:, :, :, :, past:past + m] = 0
        if not rows.numel():
            return
        model, count = self.model, rows.numel()
        ctx = self.runtime.context(features[rows, columns])  # [count, H]
        packed = llama.new_kv(model, 1, count)  # [L, 2, 1, kv, count, D]
        flat = positions[rows, columns].contiguous()
        work = llama.scratch(model, 1, count)  # alive while the kernels write to it
        params = llama.block_params(model, packed, 0, flat, work)
        for index in range(len(model.layers)):
            llama.layer_keys_values(model, index, ctx, None, params, packed)
        self.kv[:, :, rows, :, past + columns] = packed[:, :, 0].permute(3, 0, 1, 2, 4)

    def _layer(self, index, block):
        m = self._split
        batch, n = block.shape
        x = block.hidden.view(batch, n, -1)
        normed = kernels.rms_norm(x[:, m:].reshape(batch * (n - m), -1).contiguous(), self.runtime.input_norms[index],
                                  self.runtime.eps).view(batch, n - m, -1)
        x_attn = normed if m == 0 else torch.cat([self._ctx, normed], dim=1)
        visible = block.masks[self.model.layers[index].window]
        return llama.decoder_layer_from(self.model, index, x_attn.reshape(batch * n, -1), None, block.hidden,
                                        block.params, self.kv, visible)
