"""The llama.cpp comparison: its error without llama-cpp-python, and (where it is installed) greedy
decoding from token ids that matches specdec's plain decoding on the same tiny model."""

from __future__ import annotations

import sys

import pytest

from specdec.decode import GenerationConfig
from specdec.engine import generate_ids
from specdec.drafters import NoDraft
from specdec.errors import SpecdecError
from specdec.commands.llamacpp import MISSING, compare, file_dtype, first_difference, format_comparison, llama_cpp_plain
from specdec.backends.target import load_target


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 0]) == 2


def test_specdec_computes_in_the_type_of_the_file_both_sides_run(model_dirs, tmp_path):
    """A BF16 file is compared with specdec in bfloat16 (its float32 path would be slower than the file asks
    for), every other type with float32 activations."""
    pytest.importorskip("gguf")
    from specdec.commands.gguf import export

    kinds = {kind: file_dtype(export(model_dirs["llama"], tmp_path / f"{kind}.gguf", kind))
             for kind in ("f32", "bf16", "q8_0")}
    assert kinds == {"f32": "float32", "bf16": "bfloat16", "q8_0": "float32"}
    with pytest.raises(SpecdecError, match="float32, bfloat16 or auto"):
        compare(model_dirs["llama"], dtype="float16", progress=False)


def test_missing_llama_cpp_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes ``import llama_cpp`` fail
    with pytest.raises(SpecdecError, match="pip install llama-cpp-python") as caught:
        llama_cpp_plain(tmp_path / "none.gguf", [[1, 2]], 4, [0])
    assert str(caught.value) == MISSING


def test_a_dependency_llama_cpp_lacks_is_named(monkeypatch, tmp_path):
    """llama-cpp-python's source on the path without a module it imports (its source tree needs diskcache): the
    error names that module, not llama-cpp-python."""
    package = tmp_path / "llama_cpp"
    package.mkdir()
    (package / "__init__.py").write_text("import specdec_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    with pytest.raises(SpecdecError, match="needs the module 'specdec_absent_dependency'"):
        llama_cpp_plain(tmp_path / "none.gguf", [[1, 2]], 4, [0])


@pytest.fixture(scope="module")
def tiny_gguf(model_dirs, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from specdec.commands.gguf import export

    return export(model_dirs["llama"], tmp_path_factory.mktemp("llamacpp") / "llama.gguf")


def test_greedy_matches_specdec_plain(model_dirs, tiny_gguf):
    target = load_target(model_dirs["llama"], backend="native")
    prompts = target.encode(["def parse(self, value):\n", "import os\nimport sys\n", "class A:\n    x = 1\n"])
    eos = list(target.eos_token_ids)
    outputs, seconds = llama_cpp_plain(tiny_gguf, prompts, 24, eos)
    assert seconds > 0
    expected = generate_ids(target, prompts, NoDraft(), GenerationConfig(num_draft_tokens=1, max_new_tokens=24))
    assert outputs == expected.token_ids
    # A stop token ends the output right after it, as in specdec.
    first = outputs[0][3]
    stopped, _ = llama_cpp_plain(tiny_gguf, prompts[:1], 24, [first])
    assert stopped[0] == outputs[0][: outputs[0].index(first) + 1]


def test_compare_table(model_dirs, tiny_gguf):
    result = compare(model_dirs["llama"], model_dirs["llama-draft"], num_prompts=2, max_new_tokens=8, k=2,
                     gguf_path=tiny_gguf, kv_caches=("f32", "f16"), progress=False)
    methods = {row["method"]: row for row in result["methods"]}
    assert set(methods) == {"llama.cpp plain (f32 KV)", "llama.cpp plain (f16 KV)", "specdec plain",
                            "specdec draft-model k=2", "specdec prompt-lookup k=2", "llama.cpp prompt-lookup k=2 (f32 KV)"}
    assert methods["specdec plain"]["identical_to_llama_cpp"] == 2
    assert methods["llama.cpp prompt-lookup k=2 (f32 KV)"]["identical_to_llama_cpp"] == 2
    assert all(row["identical_to_specdec_plain"] == 2 for name, row in methods.items() if name.startswith("specdec"))
    assert "specdec plain" in format_comparison(result)


def test_llama_cpp_prompt_lookup_equals_its_plain_decoding(model_dirs, tiny_gguf):
    from specdec.commands.llamacpp import LlamaCpp

    target = load_target(model_dirs["llama"], backend="native")
    prompts = target.encode(["def parse(self, value):\n    return value\n" * 3, "a b c a b c a b"])
    eos = list(target.eos_token_ids)
    plain, _ = llama_cpp_plain(tiny_gguf, prompts, 24, eos)
    with LlamaCpp(tiny_gguf, n_ctx=256, logits_all=True) as runner:
        for prompt, expected in zip(prompts, plain):
            output, steps = runner.lookup(prompt, 24, eos, 4)
            assert output == expected and steps <= len(output)


def test_repacking_off_wraps_llama_cpps_default_model_parameters(monkeypatch):
    """--no-repack: models loaded meanwhile get use_extra_bufts False (llama-bench --repack 0), and the
    default parameters are llama.cpp's own again afterwards."""
    import sys
    import types

    from specdec.commands import llamacpp

    class Params:
        use_extra_bufts = True

    inner = types.SimpleNamespace(llama_model_default_params=lambda: Params())
    package = types.ModuleType("llama_cpp")
    package.llama = types.SimpleNamespace(llama_cpp=inner)
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    with llamacpp._repacking(False):
        assert inner.llama_model_default_params().use_extra_bufts is False
    assert inner.llama_model_default_params().use_extra_bufts is True
    with llamacpp._repacking(True):
        assert inner.llama_model_default_params().use_extra_bufts is True
