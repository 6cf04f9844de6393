"""Specdec's own forward pass for the Llama family: llama, qwen2, qwen3 and mistral checkpoints.

Why own it: at the sizes specdec runs on a CPU, a forward pass costs about 10 us per tensor
operation whatever its arithmetic, so the time goes to the number of operations, not to the
matrices. A decoder layer here is sixteen operations (transformers' module tree runs about three
times that), all of them on tensors of a block's few new tokens:

    norm -> qkv matmul (+ q/k norms) -> RoPE on q and on k -> keys and values into the cache (one
    copy) -> attention over the cache -> output matmul + residual -> norm -> gate/up matmul
    -> silu * up -> down matmul + residual

Layout choices, invisible from outside:
- q/k/v are one matrix and gate/up another; every matrix is stored transposed, [in, out], and used
  as ``x @ w`` (``addmm`` folds the residual add into the output projections).
- RoPE rotates dimension i of a head with dimension i + D/2. The rows of q and k are permuted per
  head at load time so that each such pair sits side by side, which makes the rotation one complex
  multiplication. q and k get the same permutation, so attention scores are unchanged; only the
  cached keys are stored in that order.
- Grouped-query attention stacks the g query heads that share a key head along the query axis
  ([B, kv, n * g, D]), so keys and values are never repeated. The query heads are reordered at
  load time (q rows, o columns) from (key head, j) to (j, key head), so that RoPE writes the
  queries straight into that stacked layout and attention's output is already [B * n, heads * D].

The weights are read from ``model.safetensors`` (or its sharded index), never from pickle files;
the config through transformers' AutoConfig, which normalises RoPE parameters across versions.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache import FULL, Window
from ..errors import ModelLoadError, UnsupportedModelError

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED = ("model_type llama, qwen2, qwen3 or mistral with a silu MLP, default/linear/llama3 RoPE "
             "and safetensors weights")
TRANSPOSED = True  # store matrices as [in, out] (x @ w); measured faster than F.linear's [out, in] here


@dataclass
class Layer:
    """One decoder layer's tensors, in the layout the forward pass uses."""

    qkv: torch.Tensor                  # [H, (heads + 2 kv) D]: q/k in pair order, input norm folded in
    qkv_bias: torch.Tensor | None      # [(heads + 2 kv) D] (qwen2, attention_bias)
    q_norm: torch.Tensor | None        # [D] (qwen3: RMSNorm of each head before RoPE)
    k_norm: torch.Tensor | None        # [D]
    o: torch.Tensor                    # [heads D, H]
    o_bias: torch.Tensor | None        # [H]
    gate_up: torch.Tensor              # [H, 2 I], post-attention norm folded in
    gate_up_bias: torch.Tensor | None  # [2 I] (mlp_bias)
    down: torch.Tensor                 # [I, H]
    down_bias: torch.Tensor | None     # [H]
    window: Window = FULL              # which earlier tokens the layer attends to


@dataclass
class Llama:
    """A loaded network: its tensors, its shape and its RoPE table."""

    config: object                     # the HF config it was read from
    embed: torch.Tensor                # [V, H]
    layers: list[Layer]
    norm: torch.Tensor                 # [H] the final norm's weight times sqrt(H) (see normalize)
    head: torch.Tensor                 # [H, V], the final norm folded in (a copy of embed when tied)
    inv_freq: torch.Tensor             # [D/2] float32
    heads: int
    kv_heads: int
    head_dim: int
    eps_hidden: torch.Tensor           # sqrt(H * eps), for rms_norm over H
    eps_head: torch.Tensor             # sqrt(D * eps), for the q/k norms over D
    rope_table: torch.Tensor = field(default=None, repr=False)  # [P, D/2] complex, grown on demand

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.head.shape[1]

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    def rope(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations of positions [B, n]: [B, n, 1, D/2] complex, gathered from the table (see reserve)."""
        return self.rope_table[positions].unsqueeze(2)

    def reserve(self, length: int) -> None:
        """Make the RoPE table cover positions [0, length) (doubling, so this rarely recomputes)."""
        have = 0 if self.rope_table is None else self.rope_table.shape[0]
        if length <= have:
            return
        length = max(length, 2 * have, 256)
        angles = torch.arange(length, dtype=torch.float32, device=self.device)[:, None] * self.inv_freq
        self.rope_table = torch.complex(angles.cos(), angles.sin())  # [P, D/2] complex64

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [..., H] that have not been normed yet: [..., V]."""
        return normalize(hidden, self.eps_hidden) @ self.head


# ---------------------------------------------------------------------------------------------
# The forward pass.

def normalize(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """RMSNorm without its weight, divided by sqrt(S) for size S: x / sqrt(|x|^2 + S eps).

    eps is the tensor sqrt(S eps). Three small operations where the textbook form takes five
    (F.rms_norm is no faster on a CPU); the weight, times sqrt(S), is folded into the matrix that
    follows (``load``), or multiplied by ``rms_norm``.
    """
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dimension, with ``weight`` stored times sqrt(S) (see ``normalize``)."""
    return normalize(x, eps) * weight


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] @ w [in, out] (+ bias) (+ residual), in one operation where possible."""
    if residual is not None:
        result = torch.addmm(residual, x, w, out=out)
        return result if bias is None else result.add_(bias)
    return torch.mm(x, w, out=out) if bias is None else torch.addmm(bias, x, w, out=out)


def pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., D] real in pair order as [..., D/2] complex (a view)."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def rotate(x: torch.Tensor, rope: torch.Tensor, out: torch.Tensor) -> None:
    """out = RoPE of x: x, out [B, n, heads, D] in pair order; rope [B, n, 1, D/2] complex."""
    if out.dtype in (torch.float32, torch.float64):
        torch.mul(pairs(x), rope, out=pairs(out))
    else:  # half precisions have no complex type: rotate in float32
        out.copy_(torch.view_as_real(pairs(x.float()) * rope).flatten(-2))


def new_kv(model: Llama, batch: int, capacity: int) -> torch.Tensor:
    """A KV cache: [layers, 2 (keys, values), B, kv, capacity, D], keys in pair order."""
    return torch.zeros(len(model.layers), 2, batch, model.kv_heads, capacity, model.head_dim,
                       dtype=model.dtype, device=model.device)


@dataclass
class Scratch:
    """Work buffers for blocks of one shape, reused by every layer (and by later blocks of that shape).

    Each projection writes its buffer in place and the views into it are made once, so a layer
    only computes. Grouped-query attention stacks the g query heads that share a key head along
    the query axis (row i * g + j is token i, head j of the group): keys and values never repeat.
    """

    shape: tuple[int, int]             # (B, n)
    qkv: torch.Tensor                  # [B * n, (heads + 2 kv) D]: the q/k/v projection
    q: torch.Tensor                    # [B, n, heads, D], a view of qkv; heads in (j, key head) order
    k: torch.Tensor                    # [B, n, kv, D], rotated in place
    kv: torch.Tensor                   # [2, B, kv, n, D]: keys and values as the cache holds them
    queries: torch.Tensor              # [B, n, heads, D]: where RoPE writes the queries
    stacked: torch.Tensor              # [B, kv, n * g, D]: the same memory as attention reads it
    gate_up: torch.Tensor              # [B * n, 2 I]: the gate/up projection
    gate: torch.Tensor                 # [B * n, I]
    up: torch.Tensor                   # [B * n, I]
    pairs: tuple | None                # complex views of (q, k, queries) for one-step RoPE (fp32/fp64)


def scratch(model: Llama, batch: int, n: int) -> Scratch:
    heads, kv, group, dim = model.heads, model.kv_heads, model.group, model.head_dim
    qkv = model.embed.new_empty(batch * n, model.layers[0].qkv.shape[1])
    heads_of = qkv.view(batch, n, heads + 2 * kv, dim)
    q, k = heads_of[:, :, :heads], heads_of[:, :, heads:heads + kv]
    keys_values = heads_of[:, :, heads:].unflatten(2, (2, kv)).permute(2, 0, 3, 1, 4)
    queries = model.embed.new_empty(batch, n, heads, dim)  # heads in (j, key head) order
    stacked = queries.view(batch, n * group, kv, dim).transpose(1, 2)
    gate_up = model.embed.new_empty(batch * n, model.layers[0].gate_up.shape[1])
    gate, up = gate_up.chunk(2, dim=1)
    complex_views = None
    if model.dtype in (torch.float32, torch.float64):
        complex_views = (pairs(q), pairs(k), pairs(queries))
    return Scratch((batch, n), qkv, q, k, keys_values, queries, stacked, gate_up, gate, up, complex_views)


@dataclass
class Slots:
    """A block's views of the cache, per layer: made once per block, not once per layer."""

    new: tuple[torch.Tensor, ...]     # [2, B, kv, n, D]: the block's columns [past, past + n)
    keys: tuple[torch.Tensor, ...]    # [B, kv, past + n, D]: the columns attention reads
    values: tuple[torch.Tensor, ...]  # [B, kv, past + n, D]


def slots(kv: torch.Tensor, past: int, n: int) -> Slots:
    """The slots of a block of n columns written at [past, past + n) of the cache ``kv``."""
    stop = past + n
    return Slots(kv[..., past:stop, :].unbind(0), kv[:, 0, ..., :stop, :].unbind(0),
                 kv[:, 1, ..., :stop, :].unbind(0))


def decoder_layer(model: Llama, index: int, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor,
                  slots: Slots, work: Scratch) -> torch.Tensor:
    """Layer ``index`` on a block: x [B * n, H] -> [B * n, H], writing its keys and values.

    rope: [B, n, 1, D/2] rotations; mask: additive [B, 1, n * g or 1, past + n] (``additive_mask``).
    The norms' weights are folded into qkv and gate_up.
    """
    layer, (batch, n) = model.layers[index], work.shape
    linear(normalize(x, model.eps_hidden), layer.qkv, layer.qkv_bias, out=work.qkv)
    if work.pairs is not None and layer.q_norm is None:  # RoPE in one multiplication each
        q, k, queries = work.pairs
        torch.mul(q, rope, out=queries)
        torch.mul(k, rope, out=k)
    else:
        q, k = work.q, work.k
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm, model.eps_head), rms_norm(k, layer.k_norm, model.eps_head)
        rotate(q, rope, work.queries)
        rotate(k, rope, work.k)
    slots.new[index].copy_(work.kv)  # the block's keys and values into the cache, in one copy
    out = F.scaled_dot_product_attention(work.stacked, slots.keys[index], slots.values[index], attn_mask=mask)
    out = out.transpose(1, 2).reshape(batch * n, -1)  # a view: the output has the queries' memory layout
    x = linear(out, layer.o, layer.o_bias, residual=x)
    linear(normalize(x, model.eps_hidden), layer.gate_up, layer.gate_up_bias, out=work.gate_up)
    return linear(F.silu(work.gate) * work.up, layer.down, layer.down_bias, residual=x)


def additive_mask(seen: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """A [B, n, T] visibility mask as the additive mask ``decoder_layer`` takes: [B, 1, n * g, T].

    Additive, with the dtype's lowest finite value, because a query that sees nothing (left
    padding, a hole) must still get finite outputs: with a boolean mask some attention kernels
    return NaN there, which the next layer stores as keys and values, and 0 * NaN poisons every row.
    """
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
    mask = mask.masked_fill_(~seen, torch.finfo(dtype).min)[:, None]
    return mask if group == 1 or seen.shape[1] == 1 else mask.repeat_interleave(group, dim=2)


# ---------------------------------------------------------------------------------------------
# Config and weights.

def read_config(path: str | os.PathLike):
    """The HF config of a model directory (AutoConfig when transformers knows the type)."""
    from transformers import AutoConfig, PretrainedConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"not a model directory (no config.json): {path}")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception:  # an unknown model_type: enough to name it in the refusal
        try:
            return PretrainedConfig.from_dict(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"unreadable config.json in {path}: {exc}") from None


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def unsupported(config) -> str | None:
    """Why the native forward pass cannot run ``config`` (an HF config), or None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model_type {kind!r} is not of the Llama family"
    activation = getattr(config, "hidden_act", "silu")
    if activation not in ("silu", "swish"):
        return f"hidden_act {activation!r}"
    params = rope_parameters(config)
    if any(isinstance(value, dict) for value in params.values()):
        return "RoPE parameters that differ by layer type"
    if params["rope_type"] not in ROPE_TYPES:
        return f"rope_type {params['rope_type']!r}"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        return "partial rotary embeddings"
    if getattr(config, "quantization_config", None):
        return "quantized weights"
    for layer_kind in getattr(config, "layer_types", None) or ():
        if layer_kind not in ("full_attention", "sliding_attention"):
            return f"{layer_kind} layers"
    return None


def layer_windows(config) -> list[Window]:
    """Each layer's attention window (mistral's sliding_window applies to every layer)."""
    count = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        sliding = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        return [Window(sliding=int(sliding)) if sliding else FULL] * count
    return [Window(sliding=int(config.sliding_window)) if kind == "sliding_attention" else FULL
            for kind in kinds[:count]]


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards its index lists."""
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").is_file():
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise ModelLoadError(f"no safetensors weights in {path} (the native backend reads no pickle files)")
    weights = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequency per pair of dimensions, [D/2] float32, for the declared scaling."""
    params = rope_parameters(config)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    kind = params["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths slow down by ``factor``, short ones stay, those between blend.
        factor, low, high = (float(params[key]) for key in ("factor", "low_freq_factor", "high_freq_factor"))
        context = float(params.get("original_max_position_embeddings") or config.max_position_embeddings)
        wavelength = 2 * math.pi / inv_freq
        slow = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
        blend = (context / wavelength - low) / (high - low)
        blended = (1 - blend) * slow / factor + blend * slow
        between = (wavelength >= context / high) & (wavelength <= context / low)
        inv_freq = torch.where(between, blended, slow)
    return inv_freq


def pair_halves(w: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Reorder each head's rows from (i, i + D/2) halves to side-by-side pairs (see module doc)."""
    order = torch.arange(dim).view(2, dim // 2).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
    return w.reshape(heads, dim, *w.shape[1:])[:, order].reshape(w.shape)


def group_major(w: torch.Tensor, kv_heads: int, dim: int) -> torch.Tensor:
    """Reorder query-head rows from (key head, j) to (j, key head) order (see module doc)."""
    heads = w.shape[0] // dim
    order = torch.arange(heads).view(kv_heads, heads // kv_heads).t().reshape(-1)
    return w.reshape(heads, dim, *w.shape[1:])[order].reshape(w.shape)


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu") -> Llama:
    """Read an HF Llama-family directory into a ``Llama``; UnsupportedModelError names what runs."""
    path = Path(path)
    config = read_config(path)
    reason = unsupported(config)
    if reason:
        raise UnsupportedModelError(f"the native backend cannot run {path}: {reason}; it runs {SUPPORTED}")
    weights = read_weights(path)
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    hidden = config.hidden_size
    dim = getattr(config, "head_dim", None) or hidden // heads

    def get(name: str, required: bool = True) -> torch.Tensor | None:
        if name not in weights:
            if required:
                raise ModelLoadError(f"{path} lacks the tensor {name}")
            return None
        return weights[name].to(device=device, dtype=dtype)

    def norm(name: str) -> torch.Tensor:  # an RMSNorm weight over H, times sqrt(H) (see normalize)
        return get(name) * hidden ** 0.5

    def matrix(w: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
        """[out, in] -> [in, out], with the weight of the norm before it folded into its rows."""
        w = w.t() if norm is None else w.t() * norm[:, None]
        return w.contiguous() if TRANSPOSED else w.t().contiguous().t()

    def joined(names: list[str], size: list[int]) -> torch.Tensor | None:
        parts = [get(name, required=False) for name in names]
        if all(part is None for part in parts):
            return None
        return torch.cat([part if part is not None else torch.zeros(n, dtype=dtype, device=device)
                          for part, n in zip(parts, size)])

    layers = []
    for index, window in enumerate(layer_windows(config)):
        at = f"model.layers.{index}."
        a, m = at + "self_attn.", at + "mlp."
        q = group_major(pair_halves(get(a + "q_proj.weight"), heads, dim), kv, dim)
        k = pair_halves(get(a + "k_proj.weight"), kv, dim)
        sizes = [heads * dim, kv * dim, kv * dim]
        qkv_bias = joined([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], sizes)
        if qkv_bias is not None:
            q_bias, k_bias, v_bias = qkv_bias.split(sizes)
            q_bias = group_major(pair_halves(q_bias, heads, dim), kv, dim)
            qkv_bias = torch.cat([q_bias, pair_halves(k_bias, kv, dim), v_bias])
        q_norm, k_norm = get(a + "q_norm.weight", required=False), get(a + "k_norm.weight", required=False)
        if q_norm is not None:
            q_norm, k_norm = (pair_halves(w, 1, dim) * dim ** 0.5 for w in (q_norm, k_norm))
        layers.append(Layer(
            qkv=matrix(torch.cat([q, k, get(a + "v_proj.weight")]), norm(at + "input_layernorm.weight")),
            qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm,
            o=matrix(group_major(get(a + "o_proj.weight").t(), kv, dim).t()),
            o_bias=get(a + "o_proj.bias", required=False),
            gate_up=matrix(torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
                           norm(at + "post_attention_layernorm.weight")),
            gate_up_bias=joined([m + "gate_proj.bias", m + "up_proj.bias"], [config.intermediate_size] * 2),
            down=matrix(get(m + "down_proj.weight")), down_bias=get(m + "down_proj.bias", required=False),
            window=window))
    embed = get("model.embed_tokens.weight")
    head = embed if getattr(config, "tie_word_embeddings", False) else get("lm_head.weight")
    eps = float(config.rms_norm_eps)
    final = norm("model.norm.weight")
    return Llama(config=config, embed=embed, layers=layers, norm=final, head=matrix(head, final),
                 inv_freq=inverse_frequencies(config, dim).to(device), heads=heads, kv_heads=kv, head_dim=dim,
                 eps_hidden=torch.tensor((hidden * eps) ** 0.5, dtype=dtype, device=device),
                 eps_head=torch.tensor((dim * eps) ** 0.5, dtype=dtype, device=device))
