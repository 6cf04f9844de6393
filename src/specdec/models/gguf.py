"""Reading a GGUF file (llama.cpp's single-file format) into a model folder the backends load.

CPU users hold their models as GGUF files, mostly quantized. ``build_folder`` turns one into what
every backend of specdec reads: ``config.json`` (from the file's metadata), the tokenizer with its
chat template (transformers' GGUF tokenizer reader), ``generation_config.json`` and
``model.safetensors`` with every tensor dequantized (float32 holds Q8_0, Q4_0 and Q4_1 values
exactly: each is a small integer times a float16 scale, plus a float16 minimum for Q4_1).

What changes on the way besides names: llama.cpp's converter permutes the rows of q and k of the
"llama" architecture so that RoPE rotates adjacent pairs; HF's layout rotates (i, i + D/2), so the
permutation is undone here (``half_split_rope_rows``, the inverse of the export's). The folder is
built in a temporary folder and renamed at the end: a reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.errors import ModelLoadError, SpecdecError, UnsupportedModelError

ARCHITECTURES = ("llama",)
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_VOCABULARY_FIELDS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                      "tokenizer.ggml.scores"}  # long lists, read by the tokenizer reader instead
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise SpecdecError("reading GGUF files needs the gguf package (pip install gguf)") from None
    return gguf


def half_split_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q/k from llama.cpp's adjacent RoPE pairs (2i, 2i + 1) back to HF's (i, i + D/2), per head."""
    dim = w.shape[0] // heads
    return w.reshape(heads, dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# GGUF metadata value types: struct format of the scalars (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers (gguf's reader gives their values; every other type its bytes).
_NUMERIC = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
            "I32": np.int32, "I64": np.int64}


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its type, shape as stored (fastest dimension first) and its data, mapped
    from the file: values [*reversed(shape)] for plain number types, bytes [..., bytes per row] otherwise
    (the layout gguf's own reader gives)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class _Header:
    """Reads a GGUF header front to back (little-endian, versions 2 and 3)."""

    def __init__(self, raw: np.ndarray):
        self.raw, self.at = raw, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.raw):
            raise EOFError("the file ends inside its header")
        value = struct.unpack_from("<" + fmt, self.raw, self.at)
        self.at += size
        return value[0] if len(value) == 1 else value

    def string(self, keep: bool = True) -> str | None:
        size = self.take("Q")
        if self.at + size > len(self.raw):
            raise EOFError("the file ends inside a string of its header")
        start, self.at = self.at, self.at + size
        return bytes(self.raw[start:self.at]).decode("utf-8") if keep else None

    def value(self, kind: int, keep: bool = True):
        if kind == _STRING:
            return self.string(keep)
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS:  # one read for a whole array of numbers
                size = struct.calcsize("<" + _SCALARS[item])
                start, self.at = self.at, self.at + size * count
                if self.at > len(self.raw):
                    raise EOFError("the file ends inside an array of its header")
                return list(struct.unpack_from(f"<{count}{_SCALARS[item]}", self.raw, start)) if keep else None
            values = [self.value(item, keep) for _ in range(count)]
            return values if keep else None
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def read_gguf(path: Path, skip: frozenset | set = frozenset()) -> tuple[dict, list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF file: the metadata as Python values (the keys in ``skip`` left out
    unread: the tokenizer's long lists), the tensors mapped from the file, not read. gguf's own reader
    builds an object for every element of every list (98,000 strings of SmolLM2's vocabulary and merges:
    4 s before a weight is touched); this reads the header in one pass."""
    gguf = _gguf()
    raw = np.memmap(path, mode="r")
    header = _Header(raw)
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    header.at = 4
    version, count, kv_count = header.take("I"), header.take("Q"), header.take("Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian, or not 2-3)")
    fields = {}
    for _ in range(kv_count):
        key, kind = header.string(), header.take("I")
        value = header.value(kind, keep=key not in skip)
        if key not in skip:
            fields[key] = value
    infos = []
    for _ in range(count):
        name = header.string()
        dims = [header.take("Q") for _ in range(header.take("I"))]
        infos.append((name, dims, header.take("I"), header.take("Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-header.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        kind = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        if kind.name in _NUMERIC:
            dtype = np.dtype(_NUMERIC[kind.name])
            nbytes = elements * dtype.itemsize
        else:
            dtype, nbytes = np.dtype(np.uint8), elements * size // block
            shape = (*shape[:-1], shape[-1] // block * size)
        begin = start + offset
        if begin + nbytes > len(raw):
            raise EOFError(f"tensor {name} runs past the end of the file")
        data = raw[begin:begin + nbytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), data))
    return fields, tensors


class GGUFFile:
    """A GGUF file's metadata and tensors (dequantized to float32 on request)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such GGUF file")
        try:
            self.fields, self.tensor_list = read_gguf(self.path, _VOCABULARY_FIELDS)
        except (ValueError, IndexError, KeyError, OSError, EOFError, UnicodeDecodeError, struct.error) as error:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file ({error})") from None
        self.arch = self.fields.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                                        f"supported: {', '.join(ARCHITECTURES)}")

    def field(self, key: str, default=None):
        return self.fields.get(f"{self.arch}.{key}", default)

    def required(self, key: str) -> int:
        value = self.field(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: the GGUF metadata lacks {self.arch}.{key}")
        return int(value)

    def real(self, key: str, default: float) -> float:
        """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
        return float(str(np.float32(self.field(key, default))))

    def config(self) -> dict:
        """The HF config of the model (Llama)."""
        heads = self.required("attention.head_count")
        hidden = self.required("embedding_length")
        names = {t.name for t in self.tensor_list}
        embedding = next((t for t in self.tensor_list if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ModelLoadError(f"{self.path}: the GGUF file has no token_embd.weight")
        vocab = self.field("vocab_size") or int(embedding.shape[1])
        special = {key: self.fields.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": self.required("feed_forward_length"),
            "num_hidden_layers": self.required("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": int(self.field("attention.head_count_kv", heads)),
            "head_dim": int(self.field("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.field("context_length", 2048)),
            "rms_norm_eps": self.real("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": self.real("rope.freq_base", 10000.0),
            "vocab_size": int(vocab), "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": special["bos"], "eos_token_id": special["eos"],
            "pad_token_id": special["padding"] if special["padding"] is not None else special["eos"],
            "torch_dtype": "float32",
        }

    def tensor_types(self) -> dict[str, str]:
        return {t.name: t.tensor_type.name for t in self.tensor_list}

    def tensors(self) -> dict[str, torch.Tensor]:
        """HF names -> float32 tensors in HF's [out, in] orientation, RoPE rows in HF's order."""
        gguf = _gguf()
        config = self.config()
        heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
        out = {}
        for tensor in self.tensor_list:
            name = _hf_name(tensor.name)
            if name is None:
                if tensor.name == "rope_freqs.weight":
                    raise UnsupportedModelError(f"{self.path}: RoPE frequency factors (llama3 scaling) are not supported")
                raise UnsupportedModelError(f"{self.path}: tensor {tensor.name!r} has no HF counterpart")
            try:
                values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except (NotImplementedError, ValueError) as error:
                raise UnsupportedModelError(f"{self.path}: tensor type {tensor.tensor_type.name} of {tensor.name} "
                                            f"cannot be read ({error})") from None
            shape = [int(d) for d in reversed(tensor.shape.tolist())]   # GGUF lists the fastest dimension first
            value = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                value = half_split_rope_rows(value, heads if "q_proj" in name else kv)
            out[name] = value
        return out


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """The file's tokenizer (with its chat template) as tokenizer.json and its config, via transformers."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:  # transformers raises many kinds for a tokenizer it cannot convert
        raise ModelLoadError(f"{gguf_path}: cannot read its tokenizer ({type(error).__name__}: {error})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    tokenizer.save_pretrained(str(out_dir))


def _write_folder(model: GGUFFile, gguf_path: Path, work: Path, config: dict) -> None:
    """Tokenizer, generation config and config.json of a folder built from ``gguf_path``."""
    save_tokenizer(gguf_path, work)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config[key] is not None}
    (work / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_folder(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 extra: dict | None = None) -> Path:
    """A model folder (config, tokenizer, generation config, safetensors in ``dtype``) from a GGUF file,
    written atomically: built beside ``out_dir`` and renamed into place."""
    from safetensors.torch import save_file

    from specdec.models.files import replaced_dir

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    model = GGUFFile(gguf_path)
    config = model.config()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["specdec_source"] = {"gguf": gguf_path.name, "tensor_types": sorted(set(model.tensor_types().values())),
                                **(extra or {})}
    with replaced_dir(out_dir) as work:
        tensors = {name: value.to(dtype).contiguous() for name, value in model.tensors().items()}
        save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
        _write_folder(model, gguf_path, work, config)
    return out_dir


GGUF_WEIGHTS = "model.gguf"


def link_folder(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, extra: dict | None = None) -> Path:
    """A model folder whose weights are the GGUF file itself (``model.gguf``, a link to it): config,
    tokenizer and generation config from its metadata. The native backend runs its quantized
    tensors as they are (``llama.load_gguf``); transformers dequantizes them. Written atomically."""
    from specdec.models.files import replaced_dir

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    model = GGUFFile(gguf_path)
    config = model.config()
    config["specdec_source"] = {"gguf": str(gguf_path), "tensor_types": sorted(set(model.tensor_types().values())),
                                "weights": "quantized, as stored", **(extra or {})}
    with replaced_dir(out_dir) as work:
        os.symlink(gguf_path, work / GGUF_WEIGHTS)
        _write_folder(model, gguf_path, work, config)
    return out_dir


def gguf_folder(gguf_path: str | os.PathLike) -> Path:
    """The folder ``link_folder`` makes for a GGUF file, in specdec's cache (made once per file: its
    path, size and modification time name it)."""
    import hashlib

    from specdec.models.kernels import cache_dir, writable

    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: no such GGUF file")
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = writable(cache_dir()) / "gguf" / f"{gguf_path.stem}-{key}"
    if not (folder / "config.json").is_file():
        forget_removed_files(folder.parent)
        link_folder(gguf_path, folder)
    return folder


def forget_removed_files(parent: Path) -> None:
    """Removes the cached folders whose GGUF file is gone (their link dangles), so the cache holds one
    folder per file that still exists, not one per file ever opened."""
    import shutil

    for folder in parent.iterdir() if parent.is_dir() else ():
        link = folder / GGUF_WEIGHTS
        if link.is_symlink() and not link.exists():
            shutil.rmtree(folder, ignore_errors=True)


def raw_tensors(path: str | os.PathLike) -> dict[str, tuple[str, np.ndarray, tuple[int, ...]]]:
    """GGUF tensor name -> (type name, its bytes or values as stored, shape [out, in] or [n])."""
    return {t.name: (t.tensor_type.name, t.data, tuple(int(d) for d in reversed(t.shape.tolist())))
            for t in GGUFFile(path).tensor_list}


def dequantized(kind: str, data: np.ndarray, shape: tuple[int, ...], where: str) -> torch.Tensor:
    """A stored tensor as float32 of ``shape``; a type gguf cannot read is one line naming it."""
    gguf = _gguf()
    try:
        values = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind))
    except (NotImplementedError, ValueError, AttributeError) as error:
        raise UnsupportedModelError(f"{where}: tensor type {kind} cannot be read ({error})") from None
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
