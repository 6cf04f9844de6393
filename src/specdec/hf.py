"""The one module that touches Hugging Face transformers internals.

transformers 5.x changed its cache and generate APIs (``cache=`` instead of ``past_key_values=``,
``DynamicCache.crop`` taking a negative count, layer objects holding ``keys``/``values``). Everything
that depends on those details lives here, so a future API change is mended in one place.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.utils import logging as hf_logging

from .errors import CacheRollbackError, ModelLoadError

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


@contextlib.contextmanager
def quiet():
    """Silence transformers' per-file progress bars and warnings (loading is instant for our sizes)."""
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> torch.nn.Module:
    """Load a local causal-LM directory offline, in eval mode, with a clear error when it is unusable."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"not a model directory (no config.json): {path}")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"unreadable config.json in {path}: {exc}") from None
    if not any((path / name).is_file() for name in _WEIGHT_FILES):
        raise ModelLoadError(f"no weights (model.safetensors) in {path}")
    try:
        with quiet():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                         attn_implementation="sdpa")
    except Exception as exc:  # transformers raises many kinds; the user needs one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load causal LM from {path}: {first}") from None
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike):
    """The directory's tokenizer, or None when it has no tokenizer files."""
    path = Path(path)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load tokenizer from {path}: {first}") from None


def max_positions(config) -> int | None:
    """The context window a config declares (Llama-style or GPT-2-style names)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sliding_window(config) -> int | None:
    """The attention window when any layer uses one; columns and positions differ under holes."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window and (layer_types is None or "sliding_attention" in layer_types):
        return int(window)
    return None


def eos_token_ids(model) -> tuple[int, ...]:
    """Stop tokens from the generation config, falling back to the model config."""
    ids = None
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        ids = generation_config.eos_token_id
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


class BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views into a buffer with spare columns.

    transformers' DynamicLayer concatenates, copying the whole cache at every step; here a step
    copies only its new columns, and the buffer doubles when full. Anything that replaces
    ``keys``/``values`` by other tensors (row selection, compaction) just starts a new buffer.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = self.value_buffer = None

    def _in_buffer(self, total: int) -> bool:
        buffer = self.key_buffer
        return (buffer is not None and buffer.shape[2] >= total and buffer.shape[0] == self.keys.shape[0]
                and (self.keys.numel() == 0 or self.keys.data_ptr() == buffer.data_ptr())
                and (self.values.numel() == 0 or self.values.data_ptr() == self.value_buffer.data_ptr()))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.keys.shape[-2] if self.keys.numel() else 0
        total = old + key_states.shape[-2]
        if not self._in_buffer(total):
            capacity = max(2 * total, 64)
            self.key_buffer = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[3])
            self.value_buffer = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[3])
            if old:
                self.key_buffer[:, :, :old] = self.keys
                self.value_buffer[:, :, :old] = self.values
        self.key_buffer[:, :, old:total] = key_states
        self.value_buffer[:, :, old:total] = value_states
        self.keys = self.key_buffer[:, :, :total]
        self.values = self.value_buffer[:, :, :total]
        return self.keys, self.values


def new_cache() -> Cache:
    """A cache whose every layer is a plain full-attention BufferedLayer (no sliding, no offloading)."""
    return Cache(layer_class_to_replicate=BufferedLayer)


def check_rollback(cache: DynamicCache) -> None:
    """Refuse caches whose layers drop or transform tokens: rolling them back would be wrong."""
    for index, layer in enumerate(cache.layers):
        if type(layer) not in (DynamicLayer, BufferedLayer):
            raise CacheRollbackError(
                f"cache layer {index} is a {type(layer).__name__}, which cannot be rolled back per row; "
                "speculative decoding needs full-attention KV caches")


def cache_tensors(cache: DynamicCache):
    """Yield (layer, keys, values) for every initialised layer; keys/values are [B, H, T, D]."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
            yield layer, layer.keys, layer.values


def slice_columns(cache: DynamicCache, start: int, stop: int) -> None:
    """Keep cache columns [start, stop) of every layer."""
    for layer, keys, values in cache_tensors(cache):
        layer.keys = keys[:, :, start:stop]
        layer.values = values[:, :, start:stop]


def gather_columns(cache: DynamicCache, index: torch.Tensor) -> None:
    """Reorder columns per row: index [B, T'] holds, for each row, the source column of each new column."""
    def take(states: torch.Tensor) -> torch.Tensor:
        batch, heads, _, dim = states.shape
        return states.gather(2, index[:, None, :, None].expand(batch, heads, index.shape[1], dim))

    for layer, keys, values in cache_tensors(cache):
        layer.keys, layer.values = take(keys), take(values)


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    for layer, keys, values in cache_tensors(cache):
        layer.keys = keys.index_select(0, index)
        layer.values = values.index_select(0, index)


@torch.inference_mode()
def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            cache: DynamicCache, logits_to_keep: int, hidden_layers: tuple[int, ...] = ()):
    """One cached forward pass; returns (logits [B, logits_to_keep, V], hidden [B, n, len(layers), H] or None).

    ``hidden_layers`` index HF's ``hidden_states`` tuple: 0 is the embedding output, i the output of
    decoder layer i (1-based), the last entry is post final norm in Llama-style models.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True, logits_to_keep=logits_to_keep,
                output_hidden_states=bool(hidden_layers))
    hidden = None
    if hidden_layers:
        hidden = torch.stack([out.hidden_states[i] for i in hidden_layers], dim=2)
    return out.logits, hidden
