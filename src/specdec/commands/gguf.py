"""Export a Llama-family model directory (HF layout) to a GGUF file that llama.cpp runs.

Why specdec has its own exporter: the comparison with llama.cpp (``specdec.commands.llamacpp``) must run
the same weights and the same tokenizer, and llama.cpp's converter refuses byte-level BPE
tokenizers whose pre-tokenizer it does not recognise by hash (the zoo's among them). Here the
tokenizer is written as what it is, a GPT-2-style byte-level BPE with GPT-2's split regex.

    python -m specdec.commands.gguf MODEL_DIR OUT.gguf [--dtype f32|f16|bf16|q8_0|q4_0|q4_1]

Covers the native backend's families: llama and mistral (llama.cpp's "llama" architecture),
qwen2 and qwen3. What changes on the way, besides names:

- llama.cpp's "llama" architecture rotates dimensions (2i, 2i + 1) of a head together, HF's
  rotates (i, i + D/2). The rows of q_proj and k_proj (and their biases) are permuted per head so
  that HF's pair (i, i + D/2) lands on rows (2i, 2i + 1); attention scores are unchanged because q
  and k get the same permutation. qwen2/qwen3 run llama.cpp's half-split ("neox") RoPE: no change.
- llama3 RoPE scaling becomes the ``rope_freqs`` tensor: per pair, the factor that divides
  the unscaled frequency (linear scaling is metadata).
- ``output.weight`` is written only for untied embeddings; llama.cpp reuses ``token_embd`` otherwise.
- The token list is padded with unused tokens up to the config's vocab_size (the embedding rows).

Matrices are f32 (default) or f16; norms and other 1-D tensors always stay f32. The file is
written under a temporary name in the target folder and renamed when complete. Needs the
``gguf`` package (``pip install gguf``); no part of llama.cpp itself.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.errors import InvalidArgumentError, ModelLoadError, SpecdecError, UnsupportedModelError

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # HF -> GGUF
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
GPT2_PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for GPT-2's split regex
# GGUF token types (gguf.TokenType), as plain numbers so this module imports without gguf.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _gguf():
    try:
        import gguf
    except ImportError:
        raise SpecdecError("GGUF export needs the gguf package (pip install gguf)") from None
    return gguf


# ---------------------------------------------------------------------------------------------
# The tokenizer.

@dataclass
class Vocabulary:
    tokens: list[str]        # by id, byte-level strings as tokenizer.json spells them
    types: list[int]         # NORMAL, CONTROL, USER_DEFINED or UNUSED per token
    merges: list[str]        # "left right", by rank
    special: dict[str, int]  # content -> id of special tokens
    add_bos: bool
    add_eos: bool


def _pre_tokenizers(node: dict | None) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [p for child in node.get("pretokenizers", []) for p in _pre_tokenizers(child)]
    return [node]


def read_vocabulary(path: Path, vocab_size: int) -> Vocabulary:
    """The directory's tokenizer.json as GGUF wants it; refuses what is not a GPT-2-style byte-level BPE."""
    file = path / "tokenizer.json"
    if not file.is_file():
        raise UnsupportedModelError(f"{path} has no tokenizer.json (GGUF export needs a fast tokenizer)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"unreadable tokenizer.json in {path}: {exc}") from None
    model = data.get("model") or {}
    pre = _pre_tokenizers(data.get("pre_tokenizer"))
    byte_level = (model.get("type") == "BPE" and data.get("normalizer") is None and len(pre) == 1
                  and pre[0].get("type") == "ByteLevel" and pre[0].get("use_regex", True)
                  and not pre[0].get("add_prefix_space", False))
    if not byte_level:
        raise UnsupportedModelError(
            f"the tokenizer of {path} is not a GPT-2-style byte-level BPE (model {model.get('type')!r}, "
            f"pre-tokenizer {[p.get('type') for p in pre]}, normalizer "
            f"{(data.get('normalizer') or {}).get('type')!r}); GGUF export supports only that kind")

    by_id: dict[int, str] = {int(i): token for token, i in model.get("vocab", {}).items()}
    types: dict[int, int] = {}
    special = {}
    for added in data.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = CONTROL if added.get("special") else USER_DEFINED
        if added.get("special"):
            special[added["content"]] = int(added["id"])
    if by_id and max(by_id) >= vocab_size:
        raise UnsupportedModelError(
            f"the tokenizer of {path} has ids up to {max(by_id)}, past the model's vocab_size {vocab_size}")
    tokens, kinds = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            kinds.append(types.get(i, NORMAL))
        else:  # rows of the embedding no token uses
            tokens.append(f"[PAD{i}]")
            kinds.append(UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    config_file = path / "tokenizer_config.json"
    options = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    return Vocabulary(tokens, kinds, merges, special, bool(options.get("add_bos_token", False)),
                      bool(options.get("add_eos_token", False)))


def _special_id(config, name: str, vocab: Vocabulary, path: Path) -> int | None:
    """bos/eos/pad id from the config, else from the tokenizer's declared special token."""
    value = getattr(config, f"{name}_token_id", None)
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if value is not None:
        return int(value)
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        token = json.loads(config_file.read_text(encoding="utf-8")).get(f"{name}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if token in vocab.special:
            return vocab.special[token]
    return None


# ---------------------------------------------------------------------------------------------
# The weights.

def interleave_rope_rows(w: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Rows of q/k (or a bias) from HF's half-split RoPE order to llama.cpp's adjacent pairs.

    Within each head, HF rotates row i with row i + D/2; llama.cpp's "llama" RoPE rotates row 2i
    with row 2i + 1. So new row 2i + h takes old row h * D/2 + i (h = 0, 1).
    """
    return w.reshape(heads, 2, dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check(config, path: Path) -> str:
    """The GGUF architecture for ``config``, or UnsupportedModelError naming what is supported."""
    from specdec.models import llama

    supported = ("model_type llama, mistral, qwen2 or qwen3 with a silu MLP, default/linear/llama3 RoPE, "
                 "full attention and safetensors weights")
    kind = getattr(config, "model_type", None)
    reason = llama.unsupported(config)
    if reason is None and kind not in ARCHITECTURES:
        reason = f"model_type {kind!r}"
    if reason is None and any(window != llama.FULL for window in llama.layer_windows(config)):
        reason = "sliding-window attention"
    rope = llama.rope_parameters(config)["rope_type"] if reason is None else None
    if reason is None and rope == "llama3" and ARCHITECTURES[kind] != "llama":
        reason = f"llama3 RoPE scaling on {kind}"
    if reason is None and kind in ("qwen2", "qwen3") and getattr(config, "mlp_bias", False):
        reason = f"MLP biases on {kind}"
    if reason is None and kind == "qwen3" and getattr(config, "attention_bias", False):
        reason = "attention biases on qwen3"
    if reason:
        raise UnsupportedModelError(f"cannot export {path} to GGUF: {reason}; supported: {supported}")
    return ARCHITECTURES[kind]


def gguf_tensors(path: Path, config, arch: str) -> dict[str, torch.Tensor]:
    """llama.cpp's tensor names -> tensors (float32, HF's [out, in] orientation)."""
    from specdec.models import llama

    weights = {name: value.float() for name, value in llama.read_weights(path).items()}
    heads = config.num_attention_heads
    kv = config.num_key_value_heads or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    used: set[str] = set()

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        if name not in weights:
            if required:
                raise ModelLoadError(f"{path} lacks the tensor {name}")
            return None
        used.add(name)
        return weights[name]

    out: dict[str, torch.Tensor] = {"token_embd.weight": take("model.embed_tokens.weight"),
                                    "output_norm.weight": take("model.norm.weight")}
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:
        used.add("lm_head.weight")  # some checkpoints store the tied copy too
    else:
        out["output.weight"] = take("lm_head.weight")
    interleave = arch == "llama"
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for index in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            for part in ("weight", "bias"):
                required = part == "weight" and not hf_name.endswith(("q_norm", "k_norm"))
                tensor = take(f"model.layers.{index}.{hf_name}.{part}", required)
                if tensor is None:
                    continue
                if interleave and hf_name in ("self_attn.q_proj", "self_attn.k_proj"):
                    tensor = interleave_rope_rows(tensor, heads if hf_name.endswith("q_proj") else kv, dim)
                out[f"blk.{index}.{gguf_name}.{part}"] = tensor
    if llama.rope_parameters(config)["rope_type"] == "llama3":
        # llama.cpp divides each pair's base frequency by this factor.
        theta = float(llama.rope_parameters(config)["rope_theta"])
        plain = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        out["rope_freqs.weight"] = plain / llama.inverse_frequencies(config, dim)
    left = sorted(name for name in weights if name not in used and not name.endswith("rotary_emb.inv_freq"))
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise UnsupportedModelError(
            f"cannot export {path} to GGUF: tensors without a llama.cpp counterpart: {', '.join(left[:3])}{more}")
    return out


# ---------------------------------------------------------------------------------------------
# The file.

def export(model_dir: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "f32") -> Path:
    """Write ``model_dir`` as a GGUF file at ``out_path`` (atomically); returns the path."""
    from specdec.models import llama

    if dtype not in DTYPES:
        raise InvalidArgumentError(f"unknown GGUF dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    gguf = _gguf()
    path, out_path = Path(model_dir), Path(out_path)
    if not out_path.parent.is_dir():
        raise InvalidArgumentError(f"output folder does not exist: {out_path.parent}")
    config = llama.read_config(path)
    arch = _check(config, path)
    vocab = read_vocabulary(path, config.vocab_size)
    tensors = gguf_tensors(path, config, arch)

    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = llama.rope_parameters(config)
    handle, temporary = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(temporary, arch)
        writer.add_name(path.resolve().name)
        writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                              "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                              "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[dtype])
        writer.add_context_length(int(config.max_position_embeddings))
        writer.add_embedding_length(int(config.hidden_size))
        writer.add_block_count(int(config.num_hidden_layers))
        writer.add_feed_forward_length(int(config.intermediate_size))
        writer.add_head_count(int(heads))
        writer.add_head_count_kv(int(config.num_key_value_heads or heads))
        writer.add_key_length(int(dim))
        writer.add_value_length(int(dim))
        writer.add_rope_dimension_count(int(dim))
        writer.add_rope_freq_base(float(rope["rope_theta"]))
        if rope["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        writer.add_vocab_size(int(config.vocab_size))

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(GPT2_PRE_TOKENIZER)
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.types)
        writer.add_token_merges(vocab.merges)
        for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                          ("pad", writer.add_pad_token_id)):
            token = _special_id(config, name, vocab, path)
            if token is not None:
                add(token)
        writer.add_add_bos_token(vocab.add_bos)
        writer.add_add_eos_token(vocab.add_eos)

        for name, tensor in tensors.items():
            if dtype.startswith("q") and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
                # matrices in blocks of 32 inputs (llama.cpp's reference rounding); vectors stay float32
                from specdec.models.kernels import quantize_blocks

                kind = dtype.upper()
                writer.add_tensor(name, quantize_blocks(tensor, kind).numpy(),
                                  raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
                continue
            if dtype == "bf16" and tensor.dim() > 1:
                writer.add_tensor(name, tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy(),
                                  raw_dtype=gguf.GGMLQuantizationType.BF16)
                continue
            wide = dtype != "f32" and tensor.dim() > 1
            writer.add_tensor(name, tensor.to(torch.float16 if wide else torch.float32).contiguous().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp made it private; a finished export is an ordinary file
        os.replace(temporary, out_path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return out_path


def main(argv: list[str] | None = None) -> int:
    from specdec.commands.clitools import ArgumentParser

    parser = ArgumentParser(prog="python -m specdec.commands.gguf",
                            description="Export a Llama-family model directory (HF layout) to GGUF for llama.cpp.")
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("out", metavar="OUT.gguf")
    parser.add_argument("--dtype", choices=DTYPES, default="f32",
                        help="matrix precision: f32 (default), f16, bf16, or block-quantized q8_0, q4_0, q4_1 (matrices whose "
                             "input size is a multiple of 32; vectors stay f32)")
    args = parser.parse_args(argv)
    try:
        out = export(args.model_dir, args.out, args.dtype)
    except SpecdecError as exc:
        print(f"specdec.commands.gguf: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2 ** 20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
