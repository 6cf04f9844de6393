"""The one module that touches Hugging Face transformers internals.

transformers 5.x changed its cache and generate APIs (``cache=`` instead of ``past_key_values=``,
``DynamicCache.crop`` taking a negative count, layer objects holding ``keys``/``values``). Everything
that depends on those details lives here, so a future API change is mended in one place.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs
from transformers.utils import logging as hf_logging

from specdec.backends.cache import FULL, RaggedCache, Window
from specdec.errors import CacheRollbackError, ModelLoadError, UnsupportedModelError

# Tried in this order; the first that loads runs (stats report which).
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "model.gguf")


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
    path = check_model_dir(path)
    failure = None
    for implementation in ATTENTION_IMPLEMENTATIONS:
        try:
            with quiet():
                if not any((path / name).is_file() for name in _WEIGHT_FILES[:-1]):
                    model = gguf_causal_lm(path, dtype, implementation)
                else:
                    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                                 attn_implementation=implementation)
            return model.to(device).eval()
        except Exception as exc:  # transformers raises many kinds; the user needs one line
            failure = failure or first_line(exc)
    raise ModelLoadError(f"cannot load causal LM from {path}: {failure}")


def gguf_causal_lm(path: Path, dtype: torch.dtype, implementation: str) -> torch.nn.Module:
    """The transformers model of a folder whose weights are a GGUF file, its tensors dequantized by
    specdec's reader (exact for Q8_0, Q4_0 and Q4_1)."""
    from specdec.models.gguf import GGUF_WEIGHTS, GGUFFile

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    config._attn_implementation = implementation
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = GGUFFile(path / GGUF_WEIGHTS).tensors()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(f"{path / GGUF_WEIGHTS}: tensors missing {missing[:3]} or unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.to(dtype)


def check_model_dir(path: str | os.PathLike) -> Path:
    """A model directory with a readable config.json and weights, or a one-line ModelLoadError."""
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
    return path


def load_config(path: str | os.PathLike):
    """The transformers config of a model directory (checked as ``check_model_dir`` does)."""
    with quiet():
        return AutoConfig.from_pretrained(check_model_dir(path))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_generation_config(path: str | os.PathLike):
    """The directory's generation config (generation_config.json, else derived from config.json)."""
    try:
        with quiet():
            return GenerationConfig.from_pretrained(path, local_files_only=True)
    except Exception:
        try:
            with quiet():
                return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, local_files_only=True))
        except Exception:
            return None


def load_tokenizer(path: str | os.PathLike):
    """The directory's tokenizer, or None when it has no tokenizer files."""
    path = Path(path)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {path}: {first_line(exc)}") from None


def max_positions(config) -> int | None:
    """The context window a config declares (Llama-style or GPT-2-style names)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def eos_token_ids(config, generation_config=None) -> tuple[int, ...]:
    """Stop tokens from the generation config, falling back to the model config."""
    ids = None
    if generation_config is not None:
        ids = generation_config.eos_token_id
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def model_type(model) -> str:
    return str(getattr(model.config, "model_type", None) or type(model).__name__)


# ---------------------------------------------------------------------------------------------
# Storage: a transformers Cache whose every layer is a plain full-attention buffer.

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


def cache_tensors(cache: Cache):
    """Yield (layer, keys, values) for every initialised layer; keys/values are [B, H, T, D]."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
            yield layer, layer.keys, layer.values


def slice_columns(cache: Cache, start: int, stop: int) -> None:
    """Keep cache columns [start, stop) of every layer."""
    for layer, keys, values in cache_tensors(cache):
        layer.keys = keys[:, :, start:stop]
        layer.values = values[:, :, start:stop]


def gather_columns(cache: Cache, index: torch.Tensor) -> None:
    """Reorder columns per row: index [B, T'] holds, for each row, the source column of each new column."""
    def take(states: torch.Tensor) -> torch.Tensor:
        batch, heads, _, dim = states.shape
        return states.gather(2, index[:, None, :, None].expand(batch, heads, index.shape[1], dim))

    for layer, keys, values in cache_tensors(cache):
        layer.keys, layer.values = take(keys), take(values)


def select_rows(cache: Cache, index: torch.Tensor) -> None:
    for layer, keys, values in cache_tensors(cache):
        layer.keys = keys.index_select(0, index)
        layer.values = values.index_select(0, index)


def extend_rows(cache: Cache, other: Cache, rows: tuple[int, int], columns: int) -> None:
    """Append the rows of ``other`` to ``cache`` (rows: the batch sizes of both), keys and values padded
    with zero columns on the right to ``columns``. Either may be empty (a cache nothing ran in yet)."""
    mine, theirs = list(cache_tensors(cache)), list(cache_tensors(other))
    if not mine and not theirs:
        return
    if not mine:  # adopt the other's layers, with this cache's rows in front
        cache.layers = other.layers
        mine, theirs = theirs, []
        rows = rows[::-1]
        front = True
    else:
        front = False

    def widen(states: torch.Tensor) -> torch.Tensor:
        missing = columns - states.shape[2]
        return torch.cat([states, states.new_zeros(*states.shape[:2], missing, states.shape[3])], dim=2)

    for index, (layer, keys, values) in enumerate(mine):
        joined = []
        for slot, states in ((1, keys), (2, values)):
            more = theirs[index][slot] if theirs else states.new_zeros(rows[1], states.shape[1], 0, states.shape[3])
            parts = [widen(states), widen(more)]
            joined.append(torch.cat(parts[::-1] if front else parts))
        layer.keys, layer.values = joined


def cache_bytes(cache: Cache) -> int:
    total = 0
    for layer, keys, values in cache_tensors(cache):
        buffers = (getattr(layer, "key_buffer", None), getattr(layer, "value_buffer", None))
        total += sum(b.numel() * b.element_size() for b in buffers if b is not None) or (
            keys.numel() * keys.element_size() + values.numel() * values.element_size())
    return total


@torch.inference_mode()
def forward(model, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
            cache: Cache, logits_to_keep, hidden_layers: tuple[int, ...] = ()):
    """One cached forward pass; returns (logits [B, m, V], hidden [B, n, len(layers), H] or None).

    ``logits_to_keep``: the last m columns (int; 0 = all) or a LongTensor [B, m] of block columns.

    ``attention_mask`` is a 2D padding mask [B, T], a 4D additive mask [B, 1, n, T], or a dict of
    such masks by layer kind. ``hidden_layers`` index HF's ``hidden_states`` tuple: 0 is the
    embedding output, i the output of decoder layer i (1-based).
    """
    chosen = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else None
    if chosen is not None:
        logits_to_keep = 0
    keep = {"logits_to_keep": logits_to_keep} if _takes(model, "logits_to_keep") else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True, output_hidden_states=bool(hidden_layers), **keep)
    logits = out.logits if keep or not logits_to_keep else out.logits[:, -logits_to_keep:]
    if chosen is not None:
        logits = take_columns(logits, chosen)
    hidden = None
    if hidden_layers:
        hidden = torch.stack([out.hidden_states[i] for i in hidden_layers], dim=2)
    return logits, hidden


def take_columns(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """logits [B, n, V] at per-row columns [B, m] -> [B, m, V]."""
    return logits.gather(1, columns[:, :, None].expand(-1, -1, logits.shape[-1]))


def _takes(model, name: str) -> bool:
    """Whether the model's forward takes ``name`` (checked once per model class, not per pass)."""
    return name in _parameters(type(model))


@functools.lru_cache(maxsize=None)
def _parameters(model_class) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


# ---------------------------------------------------------------------------------------------
# Caches of the transformers backend.

class HFCache(RaggedCache):
    """All rows in one transformers cache; holes and padding masked per row.

    Full-attention models get a 2D padding mask and build their causal mask themselves. Models
    with windows get a 4D mask (or one per layer kind) computed here from live-token positions.
    """

    def __init__(self, backend: "HFBackend", batch_size: int, device):
        super().__init__(batch_size, device, max_positions(backend.model.config))
        self.backend = backend
        self.hf_cache = new_cache()

    def _run(self, tokens, positions, past, logits_to_keep, hidden_layers, block_mask):
        backend = self.backend
        if block_mask is None and not backend.masks:
            mask = self.valid
        else:
            kinds = backend.masks or {"full_attention": FULL}
            dtype = backend.model.dtype
            masks = {kind: additive(self.visible(positions, past, block_mask, window), dtype)
                     for kind, window in kinds.items()}
            mask = masks if backend.mask_by_kind else next(iter(masks.values()))
        return forward(backend.model, tokens, mask, positions, self.hf_cache, logits_to_keep, hidden_layers)

    def _truncated(self, stop: int) -> None:
        if stop < self._stored():
            slice_columns(self.hf_cache, 0, stop)

    def _stored(self) -> int:
        for _, keys, _ in cache_tensors(self.hf_cache):
            return keys.shape[2]
        return 0

    def _select_rows(self, index: torch.Tensor) -> None:
        select_rows(self.hf_cache, index)

    def _gather_columns(self, order: torch.Tensor) -> None:
        gather_columns(self.hf_cache, order)

    def _extend(self, other: "HFCache", columns: int) -> None:
        extend_rows(self.hf_cache, other.hf_cache, (self.batch_size, other.batch_size), columns)

    @property
    def memory_bytes(self) -> int:
        return cache_bytes(self.hf_cache)


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [B, n, T] visibility mask as the additive [B, 1, n, T] mask attention implementations take."""
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min)[:, None]


class RowwiseCache(RaggedCache):
    """One transformers cache per row, each holding exactly that row's live tokens, run row by row.

    For models that place tokens by cache length or column (positions they compute themselves,
    column-based windows): every row computes what it computes alone, by construction. Slower
    than one batched pass, so used only where the batched path would not be exact.
    """

    def __init__(self, backend: "HFBackend", batch_size: int, device):
        super().__init__(batch_size, device, max_positions(backend.model.config))
        self.backend = backend
        self.row_caches = [new_cache() for _ in range(batch_size)]

    def _run(self, tokens, positions, past, logits_to_keep, hidden_layers, block_mask):
        if block_mask is not None:
            raise CacheRollbackError(
                f"{model_type(self.backend.model)} runs row by row and cannot verify token trees")
        new_valid = self.valid[:, past:]
        batch, n = tokens.shape
        logits_out = hidden_out = None
        for row, columns in enumerate(new_valid.unbind(0)):
            index = columns.nonzero().squeeze(1)
            logits, hidden = self._row(row, tokens[row, index], positions[row, index], hidden_layers)
            if logits is None:
                continue
            if logits_out is None:
                logits_out = logits.new_zeros(batch, n, logits.shape[-1])
                if hidden is not None:
                    hidden_out = hidden.new_zeros(batch, n, *hidden.shape[1:])
            logits_out[row, index] = logits
            if hidden is not None:
                hidden_out[row, index] = hidden
        if isinstance(logits_to_keep, torch.Tensor):
            return take_columns(logits_out, logits_to_keep), hidden_out
        return logits_out[:, n - logits_to_keep:], hidden_out

    def _row(self, row: int, tokens: torch.Tensor, positions: torch.Tensor, hidden_layers):
        """Row ``row``'s new tokens [m] through the model: (logits [m, V], hidden [m, L, H] or None)."""
        if tokens.numel() == 0:
            return None, None
        ones = torch.ones(1, int(self.lengths[row]), dtype=torch.long, device=tokens.device)
        logits, hidden = forward(self.backend.model, tokens[None], ones, positions[None], self.row_caches[row], 0,
                                 hidden_layers)
        return logits[0], None if hidden is None else hidden[0]

    def _truncated(self, stop: int) -> None:
        for row_cache, length in zip(self.row_caches, self.lengths.tolist()):
            slice_columns(row_cache, 0, length)

    def _select_rows(self, index: torch.Tensor) -> None:
        self.row_caches = [self.row_caches[i] for i in index.tolist()]

    def _gather_columns(self, order: torch.Tensor) -> None:
        pass  # rows hold no holes

    def _extend(self, other: "RowwiseCache", columns: int) -> None:
        self.row_caches = self.row_caches + other.row_caches

    @property
    def memory_bytes(self) -> int:
        return sum(cache_bytes(c) for c in self.row_caches)


class RecomputeCache(RowwiseCache):
    """No key/value cache at all: every pass reruns each row's whole live sequence.

    For models that keep no transformers cache (they recompute every step under generate() too):
    exact by construction, and as slow as the model itself makes it.
    """

    def __init__(self, backend: "HFBackend", batch_size: int, device):
        super().__init__(backend, batch_size, device)
        self.row_caches = [torch.zeros(0, dtype=torch.long, device=device) for _ in range(batch_size)]  # tokens

    @torch.inference_mode()
    def _row(self, row: int, tokens: torch.Tensor, positions: torch.Tensor, hidden_layers):
        self.row_caches[row] = torch.cat([self.row_caches[row], tokens])
        if tokens.numel() == 0:
            return None, None
        out = self.backend.model(input_ids=self.row_caches[row][None], use_cache=False,
                                 output_hidden_states=bool(hidden_layers))
        hidden = None
        if hidden_layers:
            hidden = torch.stack([out.hidden_states[i][0, -tokens.numel():] for i in hidden_layers], dim=1)
        return out.logits[0, -tokens.numel():], hidden

    def _truncated(self, stop: int) -> None:
        self.row_caches = [row[:length] for row, length in zip(self.row_caches, self.lengths.tolist())]

    @property
    def memory_bytes(self) -> int:
        return 0


# ---------------------------------------------------------------------------------------------
# Deciding, before generation, how (and whether) a model runs exactly.

_RECURRENT_KINDS = {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "ssm", "recurrent",
                    "rwkv", "linear", "xlstm"}
_WINDOW_NAMES = ("window", "local_attention", "local_attn", "chunk_length")


@dataclass
class HFBackend:
    """How one transformers model runs on a ragged cache: batched with masks, or row by row."""

    model: torch.nn.Module = field(repr=False)
    mode: str = "batched"                         # "batched" | "rowwise" | "recompute"
    masks: dict[str, Window] = field(default_factory=dict)  # kind -> window; empty: 2D padding mask
    mask_by_kind: bool = False                    # the model takes a dict of masks by layer kind
    reason: str = ""                              # why rowwise, when it is
    name: str = "hf"
    noise: float = 0.0                            # probe error of the row-by-row run (float noise)
    trees: bool | None = field(default=None, repr=False)  # takes tree masks (decided when first asked)

    @property
    def supports_trees(self) -> bool:
        """Whether token trees can be verified: a 4D mask must reproduce each row alone."""
        if self.mode != "batched":
            return False
        if self.trees is None:
            variant = self if self.masks else HFBackend(self.model, masks={"full_attention": FULL})
            try:
                self.trees = exact_enough(self.model, variant.probe(tree=True), self.noise)
            except Exception:
                self.trees = False
        return self.trees

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).num_hidden_layers)

    @property
    def exact_numerics(self) -> bool:
        """Whether a row's logits come out the same whatever the block shape, so speculative output
        equals plain decoding: True in float32/float64, False in bfloat16/float16, where transformers'
        kernels compute a row differently by the number of rows in a pass and flip near-ties. float32
        is not strictly shape-invariant either (rounding-sized differences, within the probe's 1e-4),
        but has not flipped a token in any check."""
        return self.dtype in (torch.float32, torch.float64)

    @property
    def attention(self) -> str:
        return str(getattr(self.model.config, "_attn_implementation", None) or "eager")

    @property
    def description(self) -> str:
        return f"hf/{self.attention}" + ("" if self.mode == "batched" else f"/{self.mode}")

    def new_cache(self, batch_size: int, capacity: int | None = None) -> RaggedCache:
        """A ragged cache for ``batch_size`` rows (transformers' caches grow; ``capacity`` is unused)."""
        cls = {"batched": HFCache, "rowwise": RowwiseCache, "recompute": RecomputeCache}[self.mode]
        return cls(self, batch_size, self.device)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "HFBackend":
        """Work out how to run ``model`` exactly, or raise UnsupportedModelError with the reason."""
        name = model_type(model)
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        kinds = layer_kinds(model, name)
        windows = {kind: _window(config, kind) for kind in dict.fromkeys(kinds) if kind != "dummy"}
        foreign = foreign_windows(config)
        candidates = []
        if _takes(model, "position_ids") and not foreign:
            if any(w != FULL for w in windows.values()):
                if getattr(config, "layer_types", None) is not None:
                    candidates.append(cls(model, masks=windows, mask_by_kind=True))
                if len(set(windows.values())) == 1:
                    candidates.append(cls(model, masks=windows))
            else:
                candidates.append(cls(model))
        why = (f"declares attention windows specdec cannot mask ({', '.join(foreign)})" if foreign else
               "places tokens itself (its forward takes no explicit positions)"
               if not _takes(model, "position_ids") else "its batched masks do not reproduce a row alone")
        rowwise = cls(model, mode="rowwise", reason=why)
        try:  # exact by construction; its error is this model's float noise
            baseline = rowwise.probe()
        except Exception as exc:  # no usable transformers cache: rerun whole rows, as generate() does
            recompute = cls(model, mode="recompute", reason=f"its cache cannot be used: {first_line(exc)}")
            try:
                recompute.probe()
                same = generate_matches_forward(model)
            except Exception:
                same = False
            if not same:
                raise UnsupportedModelError(f"{name} cannot run on a rolled-back KV cache ({first_line(exc)}), "
                                            "and its generate() is not a rerun of its forward pass") from None
            return recompute
        for candidate in candidates:
            try:
                error = candidate.probe()
            except Exception:
                continue
            if exact_enough(model, error, baseline):
                candidate.noise = baseline
                return candidate
        if any(w != FULL for w in windows.values()) and exact_enough(model, cls(model).probe(), baseline):
            raise UnsupportedModelError(
                f"{name} declares a sliding window its attention does not apply (transformers' generate() "
                "applies it only by dropping cache entries), so its output depends on the cache; not run")
        rowwise.noise = baseline
        return rowwise

    def probe(self, tree: bool = False) -> float:
        """Largest relative logit error of ragged, rolled-back, compacted rows against each row alone.

        Two rows advance in blocks of three tokens; each step one row keeps its whole block and the
        other keeps one token, so the cache grows holes and left padding, then gets compacted. The
        sequence runs past the model's shortest attention window where that window is short.
        ``tree``: each block is a small tree (a decoy sibling beside the true next token) under a
        tree mask, and the decoy is dropped afterwards.
        """
        model = self.model
        vocab = int(model.get_output_embeddings().weight.shape[0])
        windows = [w.sliding or w.chunk for w in self.masks.values() if w.sliding or w.chunk]
        length = min(max([14] + [w + 6 for w in windows if w <= 48]), (max_positions(model.config) or 64) - 1)
        generator = torch.Generator().manual_seed(0)
        sequence = torch.randint(3, vocab, (length + 8,), generator=generator).to(self.device)
        with torch.inference_mode():
            reference = model(input_ids=sequence[None], use_cache=False).logits[0].float()  # [L, V]
        scale = max(1.0, float(reference.abs().max()))
        cache = self.new_cache(2)
        tokens = torch.stack([sequence[:4], torch.cat([sequence[:2].new_zeros(2), sequence[:2]])])
        valid = torch.tensor([[True] * 4, [False, False, True, True]], device=self.device)
        logits, _ = cache.forward(tokens, valid, logits_to_keep=1)
        if cache.memory_bytes == 0 and self.mode != "recompute":
            raise UnsupportedModelError(f"{model_type(model)} keeps no transformers KV cache that specdec can "
                                        "roll back (it ignores the cache it is given)")
        errors = [logits[0, -1].float() - reference[3], logits[1, -1].float() - reference[1]]
        done, step = [4, 2], 0
        while min(done) < length:
            block = torch.stack([sequence[d: d + 3] for d in done])  # [2, 3]
            everyone = torch.ones_like(block, dtype=torch.bool)
            keep = [3, 1] if step % 2 == 0 else [1, 3]
            if tree:  # [t0, decoy, t1, t2]: the decoy is t0's sibling; t1 hangs from t0
                decoy = (block[:, :1] + 1) % vocab
                block = torch.cat([block[:, :1], decoy, block[:, 1:]], dim=1)
                mask = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
                                    dtype=torch.bool, device=self.device).expand(2, 4, 4)
                depth = torch.tensor([0, 0, 1, 2], device=self.device)
                positions = cache.lengths[:, None] + depth
                logits, _ = cache.forward(block, torch.ones_like(block, dtype=torch.bool), logits_to_keep=4,
                                          block_mask=mask, positions=positions)
                logits = logits[:, [0, 2, 3]]
                columns = torch.tensor([[True, False, True, True]], device=self.device).expand(2, 4).clone()
                cache.truncate(cache.lengths - 4 + 3, columns)
            else:
                logits, _ = cache.forward(block, everyone, logits_to_keep=3)
            for row in range(2):
                errors.append(logits[row, : keep[row]].float() - reference[done[row]: done[row] + keep[row]])
            cache.truncate(cache.lengths - 3 + torch.tensor(keep, device=self.device))
            done = [d + k for d, k in zip(done, keep)]
            if step == 3:
                cache.compact(slack=0.0, minimum=0)
            step += 1
        error = max(float(e.abs().max()) for e in errors)
        return error / scale


def generate_matches_forward(model, steps: int = 24) -> bool:
    """Whether greedy generate() equals rerunning the plain forward pass (false when generate prepares
    inputs of its own, such as xlnet's permutation masks or xlm's language ids). Runs on a copy:
    some models change their own settings while generating."""
    model = copy.deepcopy(model)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (1, 12), generator=generator).to(next(model.parameters()).device)
    with torch.inference_mode(), quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = prompt
        for _ in range(steps):
            step = model(input_ids=ours, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ours = torch.cat([ours, step], dim=1)
        theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=steps, min_new_tokens=steps, eos_token_id=None, pad_token_id=0,
                                generation_config=copy.deepcopy(model.generation_config))
    return theirs.shape == ours.shape and bool((theirs == ours).all())


def exact_enough(model, error: float, noise: float) -> bool:
    """A probe error within float rounding: fp32 1e-4 (half precisions 2e-2) of the logits' scale, or
    within 4x the error of the row-by-row run, which is exact by construction."""
    return error <= max(1e-4 if model.dtype == torch.float32 else 2e-2, 4 * noise)


def layer_kinds(model, name: str) -> list[str]:
    """Each layer's attention kind, refusing models whose state cannot be rolled back per row."""
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} keeps recurrent state that speculative rollback cannot restore")
    config = model.config.get_text_config(decoder=True)
    try:
        kinds, _ = get_layer_types_and_kwargs(config)
    except Exception:
        kinds = ["full_attention"]
    for kind in kinds:
        if kind in _RECURRENT_KINDS or "linear" in kind or "mamba" in kind:
            raise UnsupportedModelError(
                f"{name} keeps recurrent state ({kind} layers) that speculative rollback cannot restore")
        if kind not in ("full_attention", "sliding_attention", "chunked_attention", "dummy"):
            raise UnsupportedModelError(
                f"{name} has {kind} layers, whose cache specdec cannot roll back per row")
    return list(kinds)


def _window(config, kind: str) -> Window:
    if kind == "sliding_attention":
        return Window(sliding=int(config.sliding_window))
    if kind == "chunked_attention":
        return Window(chunk=int(config.attention_chunk_size))
    return FULL


def foreign_windows(config) -> list[str]:
    """Local-attention settings that transformers' mask builders do not handle (e.g. gpt_neo's)."""
    found = []
    for name, value in vars(config).items():
        if name in ("sliding_window", "attention_chunk_size") or name.startswith("use_") or \
                name.endswith(("pattern", "layers")):
            continue  # transformers turns these into layer kinds, which specdec masks itself
        if any(key in name for key in _WINDOW_NAMES) and isinstance(value, int) and not isinstance(value, bool):
            found.append(name)
        if name in ("attention_layers", "attention_types") and "local" in str(value):
            found.append(name)
    return sorted(set(found))


def logits_processors(model, prompt_length: int, max_new_tokens: int, device=None):
    """The logits processors ``model.generate(do_sample=False)`` applies for a prompt of this length.

    Repetition penalty, no-repeat n-grams, forced, suppressed and bad tokens, minimum lengths:
    whatever the model's generation config asks for. Returns a callable (input_ids [1, L], scores
    [1, V]) -> scores, or None when the config asks for nothing.
    """
    config = getattr(model, "generation_config", None)
    if config is None:
        return None
    config = copy.deepcopy(config)
    config.do_sample = False
    config.max_new_tokens, config.max_length = max_new_tokens, prompt_length + max_new_tokens
    device = device or next(model.parameters()).device
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings generate() itself ignores here, e.g. encoder n-grams
        model._prepare_special_tokens(config, True, device=device)
        processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_length,
                                                 device=device)
    return processors if len(processors) else None


def weightless_model(config, generation_config):
    """The transformers model of ``config`` on the meta device (no weights): for its generation logic."""
    with quiet(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if generation_config is not None:
        model.generation_config = generation_config
    return model


def dflash_assistant(config: dict, state: dict, dtype: torch.dtype = torch.float32, device="cpu"):
    """transformers' own DFlash assistant model (``generate(assistant_model=..., speculation_type="dflash")``)
    from its config.json dict and state dict, built in memory."""
    from transformers import AutoModel

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    with quiet():
        model = AutoModel.from_config(AutoConfig.for_model(config["model_type"], **fields), dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = [name for name in missing if "rotary" not in name]
    if missing or unexpected:
        raise ModelLoadError(f"transformers' DFlash assistant does not take these weights: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.to(device).eval()


def first_layers(model: torch.nn.Module, count: int) -> torch.nn.Module:
    """A view of ``model`` that runs only its first ``count`` decoder layers, then its final norm and
    head (early-exit drafting on transformers: the weights are shared, nothing is copied).

    transformers' decoders loop over ``layers[: config.num_hidden_layers]``, so the view is a shallow
    copy of the model and of its decoder with a config saying ``count`` layers (caches made for it
    hold ``count`` layers); the original model and its config are untouched.
    """
    import copy

    decoder = model.get_decoder()
    config = copy.deepcopy(decoder.config)
    config.num_hidden_layers = count
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:count]
    view_decoder = copy.copy(decoder)
    view_decoder._modules = dict(decoder._modules)
    view_decoder.config = config
    view = copy.copy(model)
    view._modules = {name: (view_decoder if module is decoder else module) for name, module in model._modules.items()}
    if not any(module is view_decoder for module in view._modules.values()):
        raise UnsupportedModelError(f"{model_type(model)}: cannot find its decoder to run its first layers")
    view.config = config
    return view


def mtp_layer_count(config) -> int:
    """MTP layers a checkpoint's config declares (``num_nextn_predict_layers`` / ``num_mtp_layers``), 0 if none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_mtp_layers", None) or getattr(text, "num_nextn_predict_layers", None) or 0)


def enable_mtp(model: torch.nn.Module) -> int:
    """Let transformers find ``model``'s MTP layers (its ``generate(use_mtp=True)`` and ``MtpModel``).

    transformers reads them only for architectures that declare ``num_mtp_layers`` and list the layer
    names among the keys a plain load ignores, and DeepSeek-V3's list names layer 61 (the released
    model's). This states both for this model's own depth: ``num_mtp_layers`` and the names of layers
    L .. L + n - 1. Returns n; 0 (and nothing changed) when the config declares no MTP layers.
    """
    count = mtp_layer_count(model.config)
    if count:
        text = model.config.get_text_config()
        text.num_mtp_layers = count
        if getattr(text, "layer_types", None) and not getattr(text, "mtp_layer_types", None):
            text.mtp_layer_types = ["full_attention"] * count  # what an MTP module attends to, when not stated
        layers = int(text.num_hidden_layers)
        model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers + i}\..*" for i in range(count)]
    return count


def mtp_model(model: torch.nn.Module):
    """transformers' ``MtpModel`` holding ``model``'s MTP layers, read from its checkpoint folder."""
    from transformers.modeling_layers import MtpModel

    if not enable_mtp(model):
        raise UnsupportedModelError(f"{model_type(model)} declares no MTP layers (num_nextn_predict_layers)")
    try:
        return MtpModel.from_pretrained(model, device_map={"": next(model.parameters()).device}).eval()
    except Exception as exc:
        raise ModelLoadError(f"cannot read the MTP layers of {model.config.name_or_path}: {first_line(exc)}") from None
