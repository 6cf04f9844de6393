"""GGUF export: metadata, tokenizer, tensor names, shapes and values, read back with gguf's own reader.

llama.cpp itself is not needed; the RoPE row permutation is checked against both RoPE conventions.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.errors import UnsupportedModelError
from specdec.commands.gguf import CONTROL, export, interleave_rope_rows, main
from specdec.models import llama

gguf = pytest.importorskip("gguf")


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def values(tensor) -> torch.Tensor:
    return torch.from_numpy(tensor.data.copy()).float()


def hf_weights(path) -> dict[str, torch.Tensor]:
    return {name: value.float() for name, value in load_file(path / "model.safetensors").items()}


@pytest.fixture(scope="module")
def llama_export(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    export(model_dirs["llama"], out)
    return out


def test_llama_metadata(model_dirs, llama_export):
    config = json.loads((model_dirs["llama"] / "config.json").read_text())
    tokenizer = json.loads((model_dirs["llama"] / "tokenizer.json").read_text())
    fields, _ = read(llama_export)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    expected = {
        "general.architecture": "llama", "general.file_type": 0,
        "llama.context_length": config["max_position_embeddings"], "llama.embedding_length": hidden,
        "llama.block_count": config["num_hidden_layers"], "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": heads, "llama.attention.head_count_kv": config["num_key_value_heads"],
        "llama.attention.key_length": hidden // heads, "llama.rope.dimension_count": hidden // heads,
        "llama.vocab_size": config["vocab_size"], "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.eos_token_id": config["eos_token_id"], "tokenizer.ggml.bos_token_id": config["bos_token_id"],
        "tokenizer.ggml.padding_token_id": config["pad_token_id"], "tokenizer.ggml.add_bos_token": False,
    }
    for key, value in expected.items():
        assert fields[key] == value, key
    assert fields["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    assert "llama.rope.scaling.type" not in fields

    tokens = fields["tokenizer.ggml.tokens"]
    vocab = tokenizer["model"]["vocab"]
    assert len(tokens) == config["vocab_size"]
    assert all(tokens[i] == token for token, i in vocab.items())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    assert fields["tokenizer.ggml.merges"] == merges
    types = fields["tokenizer.ggml.token_type"]
    specials = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    assert specials and all(types[i] == CONTROL for i in specials)
    assert all(types[i] == 1 for i in range(len(tokens)) if i not in specials)


def test_llama_tensors(model_dirs, llama_export):
    config = json.loads((model_dirs["llama"] / "config.json").read_text())
    weights = hf_weights(model_dirs["llama"])
    _, tensors = read(llama_export)
    layers = config["num_hidden_layers"]
    per_layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{name}.weight" for i in range(layers) for name in per_layer}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"] // heads
    embed = weights["model.embed_tokens.weight"]
    # ggml lists dimensions innermost first: [hidden, vocab] for an HF [vocab, hidden] matrix.
    assert list(tensors["token_embd.weight"].shape) == [config["hidden_size"], config["vocab_size"]]
    assert torch.equal(values(tensors["token_embd.weight"]), embed)
    assert torch.equal(values(tensors["output.weight"]), weights["lm_head.weight"])
    assert torch.equal(values(tensors["output_norm.weight"]), weights["model.norm.weight"])
    for i in range(layers):
        at = f"model.layers.{i}."
        q, k = weights[at + "self_attn.q_proj.weight"], weights[at + "self_attn.k_proj.weight"]
        assert torch.equal(values(tensors[f"blk.{i}.attn_q.weight"]), interleave_rope_rows(q, heads, dim))
        assert torch.equal(values(tensors[f"blk.{i}.attn_k.weight"]), interleave_rope_rows(k, kv, dim))
        assert list(tensors[f"blk.{i}.attn_k.weight"].shape) == [config["hidden_size"], kv * dim]
        for hf_name, name in (("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                              ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
                              ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            assert torch.equal(values(tensors[f"blk.{i}.{name}.weight"]), weights[f"{at}{hf_name}.weight"]), name


def test_interleave_rope_rows_turns_half_split_rope_into_pair_rope():
    """HF rotates (i, i + D/2) of q and k; llama.cpp's llama RoPE rotates (2i, 2i + 1). Same scores."""
    torch.manual_seed(0)
    heads, dim, hidden, n = 2, 8, 5, 6
    wq, wk, x = torch.randn(heads * dim, hidden), torch.randn(heads * dim, hidden), torch.randn(n, hidden)
    angles = torch.arange(n)[:, None] * 10000.0 ** (-torch.arange(0, dim, 2) / dim)  # [n, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def half_split(v):  # [n, heads, D]
        a, b = v[..., : dim // 2], v[..., dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def pairs(v):
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)

    def scores(w_q, w_k, rope):
        q, k = rope((x @ w_q.t()).view(n, heads, dim)), rope((x @ w_k.t()).view(n, heads, dim))
        return torch.einsum("qhd,khd->hqk", q, k)

    expected = scores(wq, wk, half_split)
    permuted = scores(interleave_rope_rows(wq, heads, dim), interleave_rope_rows(wk, heads, dim), pairs)
    assert torch.allclose(permuted, expected, atol=1e-5)
    assert not torch.allclose(scores(wq, wk, pairs), expected, atol=1e-3)  # unpermuted: wrong


def tied_copy(source, directory):
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (directory / "config.json").write_text(json.dumps(config))
    weights = load_file(directory / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_tied_embeddings_write_no_output_matrix(model_dirs, tmp_path):
    tied = tied_copy(model_dirs["llama"], tmp_path / "tied")
    export(tied, tmp_path / "tied.gguf")
    _, tensors = read(tmp_path / "tied.gguf")
    assert "output.weight" not in tensors and "token_embd.weight" in tensors


def test_f16_keeps_norms_in_f32(model_dirs, tmp_path):
    export(model_dirs["llama"], tmp_path / "half.gguf", dtype="f16")
    fields, tensors = read(tmp_path / "half.gguf")
    assert fields["general.file_type"] == 1
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    embed = hf_weights(model_dirs["llama"])["model.embed_tokens.weight"]
    assert torch.equal(values(tensors["token_embd.weight"]), embed.half().float())


@pytest.mark.parametrize("arch, expected, extra", [
    ("qwen2", "qwen2", {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"}),
    ("qwen3", "qwen3", {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"}),
    ("mistral", "llama", set()),
])
def test_other_families(model_dirs, tmp_path, arch, expected, extra):
    export(model_dirs[arch], tmp_path / f"{arch}.gguf")
    fields, tensors = read(tmp_path / f"{arch}.gguf")
    assert fields["general.architecture"] == expected
    assert extra <= set(tensors)
    config = json.loads((model_dirs[arch] / "config.json").read_text())
    heads = config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    q = hf_weights(model_dirs[arch])["model.layers.0.self_attn.q_proj.weight"]
    # Half-split ("neox") RoPE in llama.cpp's qwen2/qwen3: rows as they are; llama (mistral): permuted.
    want = interleave_rope_rows(q, heads, dim) if expected == "llama" else q
    assert torch.equal(values(tensors["blk.0.attn_q.weight"]), want)
    if arch == "qwen2":
        bias = hf_weights(model_dirs[arch])["model.layers.0.self_attn.q_proj.bias"]
        assert torch.equal(values(tensors["blk.0.attn_q.bias"]), bias)


def test_llama3_rope_becomes_rope_freqs(model_dirs, tmp_path):
    directory = shutil.copytree(model_dirs["llama"], tmp_path / "llama3")
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (directory / "config.json").write_text(json.dumps(config))
    export(directory, tmp_path / "llama3.gguf")
    _, tensors = read(tmp_path / "llama3.gguf")
    factors = values(tensors["rope_freqs.weight"])
    loaded = llama.read_config(directory)
    dim = config["hidden_size"] // config["num_attention_heads"]
    plain = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    assert factors.shape == (dim // 2,) and factors.min() >= 1.0 and factors.max() == pytest.approx(8.0)
    assert torch.allclose(plain / factors, llama.inverse_frequencies(loaded, dim), rtol=1e-6)


def test_unsupported_models_are_refused_without_leaving_files(model_dirs, tmp_path):
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2 or qwen3"):
        export(model_dirs["gpt2"], tmp_path / "gpt2.gguf")
    directory = shutil.copytree(model_dirs["llama"], tmp_path / "sentencepiece")
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581"}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(UnsupportedModelError, match="byte-level BPE"):
        export(directory, tmp_path / "sp.gguf")
    assert not list(tmp_path.glob("*.gguf*")) and not list(tmp_path.glob(".*.tmp"))


def test_command_line(model_dirs, tmp_path, capsys):
    assert main([str(model_dirs["llama"]), str(tmp_path / "cli.gguf"), "--dtype", "f16"]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "cli.gguf").is_file()
    assert main([str(model_dirs["gpt2"]), str(tmp_path / "no.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec.commands.gguf: error:") and "gpt2" in err[0]
    assert not (tmp_path / "no.gguf").exists()
