"""Specdec's own forward pass for the Llama family: llama, qwen2, qwen3 and mistral checkpoints.

Why own it: speculative decoding promises the target's own output, and a row's logits must not
depend on the block it was computed in (alone in plain decoding, behind k drafts in a
verification, under a tree mask, beside other rows of a ragged batch). Library kernels pick their
reduction order from each call's shape, so they cannot keep that promise; the kernels in
``kernels.c`` do (see ``kernels.py``), in float32, bfloat16 and float16. Owning the pass also
keeps it short: a decoder layer is one call into the kernels,

    norm + qkv product (+ q/k norms) -> RoPE on q and k -> keys and values into the cache
    -> attention over the cache -> output product + residual -> norm + gate/up product
    -> silu * up -> down product + residual

so its cost is arithmetic, not the ~10 us of bookkeeping per tensor operation that a CPU pays.

Layout choices, invisible from outside:
- q/k/v are one matrix and gate/up another, stored [in, out] and packed into panels of 16 output
  columns (``kernels.Matrix``); each RMSNorm's weight is folded into the matrix after it.
- RoPE rotates dimension i of a head with dimension i + D/2. The rows of q and k are permuted per
  head at load time so that each such pair sits side by side. q and k get the same permutation,
  so attention scores are unchanged; only the cached keys are stored in that order.
- Grouped-query attention: the query heads are reordered at load time (q rows, o columns) from
  (key head, j) to (j, key head), so query head h reads key head h % kv_heads, and keys and
  values are never repeated.

The weights are read from ``model.safetensors`` (or its sharded index), never from pickle files;
the config through transformers' AutoConfig, which normalises RoPE parameters across versions.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.backends.cache import FULL, Window
from specdec.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from specdec.models import kernels
from specdec.models.kernels import Matrix, QMatrix

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED = ("model_type llama, qwen2, qwen3 or mistral with a silu MLP, default/linear/llama3 RoPE "
             "and safetensors weights, in float32, bfloat16 or float16")


class LayerParams(ctypes.Structure):
    """``struct sd_layer`` of kernels.c: one layer's weights and sizes."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "gate_up", "gate_up_bias", "down", "down_bias")] + [
        (name, ctypes.c_long) for name in ("hidden", "heads", "kv", "head_dim", "inner")] + [
        (name, ctypes.c_float) for name in ("eps", "head_eps", "scale")] + [("dtype", ctypes.c_int)] + [
        (name, ctypes.c_int) for name in ("qkv_type", "o_type", "gate_up_type", "down_type")] + [
        (name, ctypes.c_void_p) for name in ("qkv_gain", "gate_up_gain")]


class BlockParams(ctypes.Structure):
    """``struct sd_block`` of kernels.c: a block's shape, positions, cache and work buffers."""

    _fields_ = [("batch", ctypes.c_long), ("n", ctypes.c_long), ("past", ctypes.c_long),
                ("positions", ctypes.c_void_p), ("visible", ctypes.c_void_p), ("keys", ctypes.c_void_p),
                ("values", ctypes.c_void_p), ("ld_b", ctypes.c_long), ("ld_h", ctypes.c_long),
                ("rope", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("attn", ctypes.c_void_p),
                ("gate_up", ctypes.c_void_p), ("act", ctypes.c_void_p)]


@dataclass
class Layer:
    """One decoder layer's tensors, in the layout the kernels use."""

    qkv: Matrix | QMatrix              # [H, (heads + 2 kv) D]: q/k in pair order, input norm folded in
                                       # (a QMatrix keeps it as its gain)
    qkv_bias: torch.Tensor | None      # [(heads + 2 kv) D] (qwen2, attention_bias)
    q_norm: torch.Tensor | None        # [D] (qwen3: RMSNorm of each head before RoPE), pair order
    k_norm: torch.Tensor | None        # [D]
    o: Matrix | QMatrix                # [heads D, H]
    o_bias: torch.Tensor | None        # [H]
    gate_up: Matrix | QMatrix          # [H, 2 I], post-attention norm folded in (or its gain)
    gate_up_bias: torch.Tensor | None  # [2 I] (mlp_bias)
    down: Matrix | QMatrix             # [I, H]
    down_bias: torch.Tensor | None     # [H]
    window: Window = FULL              # which earlier tokens the layer attends to
    params: LayerParams = field(default=None, repr=False)  # the same, for the kernels
    ref: object = field(default=None, repr=False)          # ctypes.byref(params)


@dataclass
class Llama:
    """A loaded network: its tensors, its shape and its RoPE table."""

    config: object                     # the HF config it was read from
    embed: torch.Tensor                # [V, H]
    layers: list[Layer]
    norm: torch.Tensor                 # [H] the final norm's weight (for transformers' last hidden state)
    head: Matrix | QMatrix             # [H, V], the final norm folded in (a copy of embed when tied)
    inv_freq: torch.Tensor             # [D/2] float32
    heads: int
    kv_heads: int
    head_dim: int
    eps: float                         # RMSNorm epsilon
    rope_table: torch.Tensor = field(default=None, repr=False)  # [P, D/2, 2] float32 cos, sin; grown on demand
    lm_head: torch.Tensor | None = field(default=None, repr=False)  # [V, H] raw head weight when not tied

    def head_weight(self) -> torch.Tensor:
        """The LM head's own weight [V, H], without the final norm (drafters that reuse the head)."""
        return self.embed if self.lm_head is None else self.lm_head

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
        return self.head.cols

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    def reserve(self, length: int) -> None:
        """Make the RoPE table cover positions [0, length) (doubling, so this rarely recomputes)."""
        have = 0 if self.rope_table is None else self.rope_table.shape[0]
        if length <= have:
            return
        length = max(length, 2 * have, 256)
        angles = torch.arange(length, dtype=torch.float32, device=self.device)[:, None] * self.inv_freq
        self.rope_table = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()  # [P, D/2, 2]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states [..., H] that have not been normed yet: [..., V]."""
        return kernels.linear(hidden.contiguous(), self.head, norm_eps=self.eps)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm with its weight (transformers' last hidden state): [..., H]."""
        return kernels.rms_norm(hidden.contiguous(), self.norm, self.eps)


# ---------------------------------------------------------------------------------------------
# The forward pass.

def new_kv(model: Llama, batch: int, capacity: int) -> torch.Tensor:
    """A KV cache: [layers, 2 (keys, values), B, kv, capacity, D], keys in pair order, uninitialised: every
    column a pass reads was written by a pass before it or zeroed as a hole (``NativeCache.extend`` and
    ``place``), so the capacity past the columns in use is never touched (zeroing a 16-row cache of 890
    columns took 100 ms at every admission; tests/test_engine.py fills new caches with NaN to check)."""
    return torch.empty(len(model.layers), 2, batch, model.kv_heads, capacity, model.head_dim,
                       dtype=model.dtype, device=model.device)


@dataclass
class Scratch:
    """Work buffers for blocks of one shape, reused by every layer (and by later blocks of that shape)."""

    shape: tuple[int, int]             # (B, n)
    qkv: torch.Tensor                  # [B * n, (heads + 2 kv) D]
    attn: torch.Tensor                 # [B * n, heads D]
    gate_up: torch.Tensor              # [B * n, 2 I]
    act: torch.Tensor                  # [B * n, I]


def scratch(model: Llama, batch: int, n: int) -> Scratch:
    rows, layer = batch * n, model.layers[0]
    empty = model.embed.new_empty
    return Scratch((batch, n), empty(rows, layer.qkv.cols), empty(rows, model.heads * model.head_dim),
                   empty(rows, layer.gate_up.cols), empty(rows, layer.gate_up.cols // 2))


def block_params(model: Llama, kv: torch.Tensor, past: int, positions: torch.Tensor, work: Scratch) -> BlockParams:
    """What every layer of a block shares; ``positions`` [B * n] int64 must stay alive with it."""
    batch, n = work.shape
    params = BlockParams(batch, n, past, positions.data_ptr(), None, None, None, kv.stride(2), kv.stride(3),
                         model.rope_table.data_ptr(), work.qkv.data_ptr(), work.attn.data_ptr(),
                         work.gate_up.data_ptr(), work.act.data_ptr())
    params.ref = ctypes.byref(params)
    return params


def _aim(block: BlockParams, kv: torch.Tensor, index: int, visible: torch.Tensor | None) -> None:
    """Point ``block`` at layer ``index``'s keys and values in the cache kv [L, 2, B, kv, capacity, D]."""
    keys = kv.data_ptr() + index * kv.stride(0) * kv.element_size()
    block.keys, block.values = keys, keys + kv.stride(1) * kv.element_size()
    block.visible = None if visible is None else visible.data_ptr()


def decoder_layer(model: Llama, index: int, x: torch.Tensor, block: BlockParams, kv: torch.Tensor,
                  visible: torch.Tensor | None) -> torch.Tensor:
    """Layer ``index`` on a block: x [B * n, H] -> a new [B * n, H], writing its keys and values.

    kv: the whole cache [L, 2, B, kv, capacity, D]; visible: [B, n, past + n] bool (which columns
    each new token sees), or None when every token sees every column.
    """
    out = torch.empty_like(x)
    _aim(block, kv, index, visible)
    kernels._check(_run_layer(model.layers[index].ref, block.ref, x.data_ptr(), out.data_ptr()))
    return out


def decoder_layers(model: Llama, start: int, end: int, x: torch.Tensor, block: BlockParams, kv: torch.Tensor,
                   masks: dict, taps: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Layers [start, end) on a block in one kernel call: what ``decoder_layer`` gives layer after layer, bit
    for bit. masks: window -> visible [B, n, past + n] bool, or None where every token sees every column.
    taps: hidden-state index i (the output of layer i - 1, start < i < end) -> a tensor like x that receives
    it, copied inside the call."""
    if end - start == 1:
        return decoder_layer(model, start, x, block, kv, masks[model.layers[start].window])
    out, spare = torch.empty_like(x), torch.empty_like(x)
    layers = model.layers[start:end]
    params = (ctypes.c_void_p * len(layers))(*[ctypes.addressof(layer.params) for layer in layers])
    visible = (ctypes.c_void_p * len(layers))(*[None if (mask := masks[layer.window]) is None else mask.data_ptr()
                                                for layer in layers])
    copies = None
    if taps:
        copies = (ctypes.c_void_p * len(layers))(*[None if (t := taps.get(start + 1 + i)) is None else t.data_ptr()
                                                   for i in range(len(layers))])
    size = kv.element_size()
    kernels._check(kernels.library().sd_decoder_layers(
        params, len(layers), block.ref, kv.data_ptr() + start * kv.stride(0) * size, kv.stride(0) * size,
        kv.stride(1) * size, visible, x.data_ptr(), out.data_ptr(), spare.data_ptr(), copies,
        x.numel() * x.element_size()))
    return out


def decoder_layer_from(model: Llama, index: int, x_attn: torch.Tensor, attn_eps: float | None,
                       residual: torch.Tensor, block: BlockParams, kv: torch.Tensor,
                       visible: torch.Tensor | None) -> torch.Tensor:
    """Layer ``index`` whose attention reads x_attn [B * n, K] (RMS-normed first unless attn_eps is
    None) and adds its output to residual [B * n, H]: drafter layers with fused inputs."""
    out = torch.empty_like(residual)
    _aim(block, kv, index, visible)
    x_attn = x_attn.contiguous()
    kernels._check(kernels.library().sd_decoder_layer_from(model.layers[index].ref, block.ref, x_attn.data_ptr(),
                                                           x_attn.shape[-1], -1.0 if attn_eps is None else attn_eps,
                                                           residual.data_ptr(), out.data_ptr()))
    return out


def layer_keys_values(model: Llama, index: int, x_attn: torch.Tensor, attn_eps: float | None, block: BlockParams,
                      kv: torch.Tensor) -> None:
    """Layer ``index``'s keys and values of a block's columns, written to the cache, and nothing else:
    columns whose own outputs are never read (a block drafter's context). The keys' bits are those
    ``decoder_layer_from`` writes for the same x_attn."""
    _aim(block, kv, index, None)
    x_attn = x_attn.contiguous()
    kernels._check(kernels.library().sd_layer_keys_values(model.layers[index].ref, block.ref, x_attn.data_ptr(),
                                                          x_attn.shape[-1], -1.0 if attn_eps is None else attn_eps))


def _run_layer(*args) -> int:
    """sd_decoder_layer of the loaded kernels (looked up once; tests may swap the library)."""
    return kernels.library().sd_decoder_layer(*args)


def layer_params(layer: Layer, model: Llama) -> LayerParams:
    def ptr(t):
        return None if t is None else (t.packed if isinstance(t, (Matrix, QMatrix)) else t).data_ptr()

    def kind(t):
        return t.code if isinstance(t, QMatrix) else t.layout

    def gain(t):
        return ptr(t.gain) if isinstance(t, QMatrix) else None

    return LayerParams(ptr(layer.qkv), ptr(layer.qkv_bias), ptr(layer.q_norm), ptr(layer.k_norm), ptr(layer.o),
                       ptr(layer.o_bias), ptr(layer.gate_up), ptr(layer.gate_up_bias), ptr(layer.down),
                       ptr(layer.down_bias), model.hidden_size, model.heads, model.kv_heads, model.head_dim,
                       layer.gate_up.cols // 2, model.eps, model.eps, model.head_dim ** -0.5,
                       kernels.DTYPES[model.dtype], kind(layer.qkv), kind(layer.o), kind(layer.gate_up),
                       kind(layer.down), gain(layer.qkv), gain(layer.gate_up))


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
    """Every tensor of ``model.safetensors`` or of the shards its index lists; a truncated, corrupt or
    missing file is a one-line ModelLoadError naming it (safetensors' own errors are tracebacks)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def unreadable(file: Path, exc: Exception) -> ModelLoadError:
        text = str(exc).strip()
        return ModelLoadError(f"cannot read weights file {file}: "
                              f"{text.splitlines()[0] if text else type(exc).__name__}")

    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise unreadable(index, exc) from None
    else:
        raise ModelLoadError(f"no safetensors weights in {path} (the native backend reads no pickle files)")
    weights = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise unreadable(file, exc) from None
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


QUANTIZE = ("q8_0", "q4_0", "q4_1")


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", quantize: str | None = None) -> Llama:
    """Read an HF Llama-family directory into a ``Llama``; UnsupportedModelError names what runs.

    ``quantize`` (q8_0, q4_0, q4_1): block-quantize every matrix whose input size is a multiple of 32
    (as llama.cpp's reference quantizer does) and run it with int8 activations; the embedding stays
    in ``dtype``, activations and the KV cache too."""
    path = Path(path)
    if quantize is not None and quantize not in QUANTIZE:
        raise UnsupportedModelError(f"unknown quantization {quantize!r}; choose from {', '.join(QUANTIZE)}")
    qtype = quantize.upper() if quantize else None
    if path.is_dir() and gguf_weights(path) is not None:
        return load_gguf(path, dtype, device, qtype)
    config = read_config(path)
    reason = unsupported(config) or unsupported_run(dtype, device)
    if reason:
        raise UnsupportedModelError(f"the native backend cannot run {path}: {reason}; it runs {SUPPORTED}")
    weights = read_weights(path)
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    def get(name: str, required: bool = True) -> torch.Tensor | None:
        if name not in weights:
            if required:
                raise ModelLoadError(f"{path} lacks the tensor {name}")
            return None
        return weights[name].to(device=device, dtype=torch.float32)

    layers = [pack_layer(get, f"model.layers.{index}.", heads, kv, dim, dtype, window=window, qtype=qtype)
              for index, window in enumerate(layer_windows(config))]
    embed = get("model.embed_tokens.weight")
    head = embed if getattr(config, "tie_word_embeddings", False) else get("lm_head.weight")
    final = get("model.norm.weight")
    model = Llama(config=config, embed=small(embed, dtype), layers=layers, norm=small(final, dtype),
                  head=matrix(head, dtype, final, qtype), inv_freq=inverse_frequencies(config, dim).to(device), heads=heads,
                  kv_heads=kv, head_dim=dim, eps=float(config.rms_norm_eps),
                  lm_head=None if head is embed else small(head, dtype))
    bind_layers(model)
    return model


# ---------------------------------------------------------------------------------------------
# GGUF files, their quantized tensors kept as they are.

class Stored:
    """A GGUF matrix [out, in] on its way into the kernels' layout: rows (outputs) and 32-input blocks
    can be reordered without touching a quantized value; anything else is read as float32."""

    def __init__(self, kind: str, data, shape: tuple[int, int], where: str):
        from specdec.models.gguf import dequantized

        self.kind, self.shape = kind, shape
        if kind in kernels.QTYPES:
            self.data = torch.from_numpy(np_bytes(data)).reshape(shape[0], -1)   # [out, blocks * block bytes]
        else:
            self.kind, self.data = "F32", dequantized(kind, data, shape, where)  # [out, in]

    @classmethod
    def of(cls, kind: str, shape: tuple[int, int], data: torch.Tensor) -> "Stored":
        """One already in the layout above (bytes per output row, or float32 [out, in])."""
        out = object.__new__(cls)
        out.kind, out.shape, out.data = kind, shape, data
        return out

    @property
    def quantized(self) -> bool:
        return self.kind != "F32"

    def float(self) -> torch.Tensor:
        if not self.quantized:
            return self.data
        return kernels.QMatrix.from_gguf(self.data, self.kind, self.shape[1], self.shape[0]).dequantize().t()

    def rows(self, order: torch.Tensor) -> "Stored":
        return Stored.of(self.kind, self.shape, self.data[order])

    def input_chunks(self, order: torch.Tensor) -> "Stored":
        """Inputs reordered by ``order`` [in]; quantized only when it moves whole 32-input blocks."""
        chunks = order.view(-1, 32) if order.numel() % 32 == 0 else None
        aligned = chunks is not None and bool((chunks == chunks[:, :1] + torch.arange(32)).all()) and bool(
            (chunks[:, 0] % 32 == 0).all())
        if self.quantized and aligned:
            blocks = self.data.view(self.shape[0], self.shape[1] // 32, -1)
            return Stored.of(self.kind, self.shape, blocks[:, chunks[:, 0] // 32].reshape(self.shape[0], -1))
        return Stored.of("F32", self.shape, self.float()[:, order])

    @staticmethod
    def cat(parts: list["Stored"]) -> "Stored":
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if len({p.kind for p in parts}) == 1:
            return Stored.of(parts[0].kind, shape, torch.cat([p.data for p in parts]))
        return Stored.of("F32", shape, torch.cat([p.float() for p in parts]))

    def matrix(self, dtype: torch.dtype, norm: torch.Tensor | None = None, qtype: str | None = None) -> Matrix | QMatrix:
        """Quantized: packed as it is, the norm's weight kept beside it; else ``matrix`` (folded, or
        quantized to ``qtype``)."""
        if self.quantized:
            return QMatrix.from_gguf(self.data, self.kind, self.shape[1], self.shape[0], norm)
        return matrix(self.data, dtype, norm, qtype)


def np_bytes(data):
    import numpy as np

    return np.ascontiguousarray(data).view(np.uint8).copy()


def gguf_weights(path: Path) -> Path | None:
    """The GGUF file a model folder holds as its weights (no safetensors beside it), or None."""
    from specdec.models.gguf import GGUF_WEIGHTS

    if any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return None
    return path / GGUF_WEIGHTS if (path / GGUF_WEIGHTS).is_file() else None


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              qtype: str | None = None) -> Llama:
    """A folder whose weights are a GGUF file (``gguf.link_folder``): Q8_0, Q4_0 and Q4_1 matrices stay
    quantized (``QMatrix``, int8 activations); other types are read as float32 and run in ``dtype``
    (or quantized to ``qtype``). The embedding is dequantized once for lookups; a tied head is the
    embedding's quantized matrix."""
    from specdec.models.gguf import half_split_rope_rows, raw_tensors

    path = Path(path)
    config = read_config(path)
    reason = unsupported(config) or unsupported_run(dtype, device)
    if reason:
        raise UnsupportedModelError(f"the native backend cannot run {path}: {reason}; it runs {SUPPORTED}")
    file = gguf_weights(path)
    tensors = raw_tensors(file)
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    def stored(name: str) -> Stored:
        if name not in tensors:
            raise ModelLoadError(f"{file} lacks the tensor {name}")
        kind, data, shape = tensors[name]
        return Stored(kind, data, shape, f"{file}: {name}")

    def vector(name: str) -> torch.Tensor:
        return stored(name).data.reshape(-1).float()

    # q/k rows: the file's adjacent RoPE pairs -> HF's halves -> the kernels' pair order, query heads
    # group-major; o's inputs follow the query heads (whole heads: whole blocks when D % 32 == 0).
    q_order = group_major(pair_halves(half_split_rope_rows(torch.arange(heads * dim), heads), heads, dim), kv, dim)
    k_order = pair_halves(half_split_rope_rows(torch.arange(kv * dim), kv), kv, dim)
    o_order = group_major(torch.arange(heads * dim), kv, dim)
    layers = []
    for index, window in enumerate(layer_windows(config)):
        at = f"blk.{index}."
        qkv = Stored.cat([stored(at + "attn_q.weight").rows(q_order), stored(at + "attn_k.weight").rows(k_order),
                          stored(at + "attn_v.weight")])
        gate_up = Stored.cat([stored(at + "ffn_gate.weight"), stored(at + "ffn_up.weight")])
        layers.append(Layer(
            qkv=qkv.matrix(dtype, vector(at + "attn_norm.weight"), qtype), qkv_bias=None, q_norm=None, k_norm=None,
            o=stored(at + "attn_output.weight").input_chunks(o_order).matrix(dtype, None, qtype), o_bias=None,
            gate_up=gate_up.matrix(dtype, vector(at + "ffn_norm.weight"), qtype), gate_up_bias=None,
            down=stored(at + "ffn_down.weight").matrix(dtype, None, qtype), down_bias=None, window=window))
    embedding = stored("token_embd.weight")
    head = stored("output.weight") if "output.weight" in tensors else embedding
    final = vector("output_norm.weight")
    embed = embedding.float()
    model = Llama(config=config, embed=small(embed, dtype), layers=layers, norm=small(final, dtype),
                  head=head.matrix(dtype, final, qtype), inv_freq=inverse_frequencies(config, dim), heads=heads,
                  kv_heads=kv, head_dim=dim, eps=float(config.rms_norm_eps),
                  lm_head=None if head is embedding else small(head.float(), dtype))
    bind_layers(model)
    return model


def drafter_core(config, embed: torch.Tensor, layers: list[Layer], head: Matrix, dtype: torch.dtype) -> Llama:
    """The kernels' model of a drafter network: its packed layers, the target's embedding and a head;
    ``config`` gives the attention shape, ``rope_theta``, ``rms_norm_eps`` and ``max_position_embeddings``
    (default RoPE). Its ``norm`` is all ones (the drafter applies its own norms)."""
    import types

    rope = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    core = Llama(config=types.SimpleNamespace(max_position_embeddings=config.max_position_embeddings),
                 embed=embed.to(dtype).contiguous(), layers=layers, norm=torch.ones(embed.shape[1], dtype=dtype),
                 head=head, inv_freq=inverse_frequencies(rope, config.head_dim), heads=config.num_attention_heads,
                 kv_heads=config.num_key_value_heads, head_dim=config.head_dim, eps=config.rms_norm_eps)
    bind_layers(core, huge_pages=False)  # a few layers; the head, the large part, is the target's (moved with it)
    return core


def bind_layers(model: Llama, huge_pages: bool = True) -> None:
    """Give every layer its kernel parameters (after the model's sizes are known); with ``huge_pages``, the
    layers' and the head's packed weights first move to huge pages where the model is large enough
    (kernels.move_to_huge_pages)."""
    if huge_pages:
        kernels.move_to_huge_pages([m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up,
                                                                          layer.down)] + [model.head])
    for layer in model.layers:
        layer.params = layer_params(layer, model)
        layer.ref = ctypes.byref(layer.params)


def small(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype).contiguous()


def matrix(w: torch.Tensor, dtype: torch.dtype, norm: torch.Tensor | None = None,
           qtype: str | None = None) -> Matrix | QMatrix:
    """[out, in] -> packed [in, out], the weight of the norm before it folded into its rows (in float32);
    with ``qtype`` (a drafter beside a quantized target) block-quantized instead where the input size
    allows, the norm's weight kept as the matrix's gain."""
    if qtype is not None and w.shape[1] % 32 == 0:
        return QMatrix.quantize(w, qtype, None if norm is None else norm.float())
    w = w.t() if norm is None else w.t() * norm[:, None]
    return Matrix.pack(w.to(dtype))


def head_matrix(target, dtype: torch.dtype, norm: torch.Tensor | None = None, qtype: str | None = None,
                rows: torch.Tensor | None = None):
    """The target's LM head [V, H] (``target``: a Target, or the head's weight itself) for a drafter that
    reuses it, after the drafter's own ``norm``: a quantized target's head is shared as it is (its packed
    blocks, the drafter's gain), else packed as ``matrix``. ``rows``: only these rows (target ids, a
    draft vocabulary), packed as ``matrix`` whatever the target's weights."""
    if isinstance(target, torch.Tensor):
        return matrix(target.float() if rows is None else target.float()[rows], dtype, norm, qtype)
    if rows is not None:
        return matrix(target.output_head().float()[rows], dtype, norm, qtype)
    head = target.backend.model.head if target.model is None else None
    if isinstance(head, QMatrix):
        return QMatrix(head.packed, head.rows, head.cols, head.qtype,
                       torch.ones(head.rows) if norm is None else norm.float().contiguous())
    return matrix(target.output_head().float(), dtype, norm, qtype)


def drafter_qtype(target, quantize: str | None = None) -> str | None:
    """The weight format of drafter networks beside ``target``: ``quantize`` when one is asked for (q8_0,
    q4_0, q4_1: ``--draft-quantize``), else Q8_0 when the target's own weights are quantized, else None
    (the target's dtype). The drafter's rounding never changes the output, only its cost and acceptance."""
    if quantize is not None:
        return quantize.upper()
    return "Q8_0" if getattr(target.backend, "quantized_types", ()) else None


def check_drafter_quantize(quantize: str | None, label: str) -> str | None:
    """``quantize`` as a drafter network takes it (None or one of QUANTIZE, any case), else one line."""
    if quantize is None or quantize.lower() in QUANTIZE:
        return None if quantize is None else quantize.lower()
    raise InvalidArgumentError(f"{label} weights can be quantized to {', '.join(QUANTIZE)}, got {quantize!r}")


def pack_layer(get, at: str, heads: int, kv: int, dim: int, dtype: torch.dtype, window: Window = FULL,
               input_norm: bool = True, qtype: str | None = None) -> Layer:
    """One decoder layer from HF-named float32 tensors (``get(name, required=True)``, names under ``at``),
    in the kernels' layout; shared by the native target and the drafter networks.

    input_norm=False: the layer's input is not RMS-normed before the q/k/v product (EAGLE's first
    layer, or inputs the caller normed itself).
    """
    device = get(at + "self_attn.q_proj.weight").device
    a, m = at + "self_attn.", at + "mlp."

    def joined(names: list[str], size: list[int]) -> torch.Tensor | None:
        parts = [get(name, required=False) for name in names]
        if all(part is None for part in parts):
            return None
        return torch.cat([part if part is not None else torch.zeros(n, device=device)
                          for part, n in zip(parts, size)])

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
        q_norm, k_norm = (pair_halves(w, 1, dim) for w in (q_norm, k_norm))
    gate = get(m + "gate_proj.weight")
    inner = gate.shape[0]
    return Layer(
        qkv=matrix(torch.cat([q, k, get(a + "v_proj.weight")]), dtype,
                   get(at + "input_layernorm.weight") if input_norm else None, qtype),
        qkv_bias=small(qkv_bias, dtype), q_norm=small(q_norm, dtype), k_norm=small(k_norm, dtype),
        o=matrix(group_major(get(a + "o_proj.weight").t(), kv, dim).t(), dtype, qtype=qtype),
        o_bias=small(get(a + "o_proj.bias", required=False), dtype),
        gate_up=matrix(torch.cat([gate, get(m + "up_proj.weight")]), dtype, get(at + "post_attention_layernorm.weight"),
                       qtype),
        gate_up_bias=small(joined([m + "gate_proj.bias", m + "up_proj.bias"], [inner] * 2), dtype),
        down=matrix(get(m + "down_proj.weight"), dtype, qtype=qtype), down_bias=small(get(m + "down_proj.bias", required=False), dtype),
        window=window)


def unsupported_run(dtype: torch.dtype, device) -> str | None:
    """Why the kernels cannot run this dtype on this device here, or None."""
    if torch.device(device).type != "cpu":
        return f"device {device} (its kernels run on the CPU)"
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    reason = kernels.available()
    if reason:
        return reason
    if not kernels.supported_dtype(dtype):
        return f"dtype {dtype} (this C compiler has no half-precision type)"
    return None
