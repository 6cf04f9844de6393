"""The command line: results on good input, one line and exit status 2 on every kind of bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from specdec.commands.cli import main
from specdec.commands.tiny import build_tokenizer, save_tiny


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("other") / "m", "llama", build_tokenizer(vocab_size=300))


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_text_and_json(capsys, model_dirs, tmp_path):
    code, out, err = run(capsys, "generate", "--target", model_dirs["llama"], "--prompt", "def f(x):",
                         "--max-new-tokens", 8)
    assert code == 0 and out.strip() and "tau" in err
    output = tmp_path / "result.json"
    code, out, _ = run(capsys, "generate", "--target", model_dirs["llama"], "--prompt", "def f(x):", "--json",
                       "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                       model_dirs["llama-draft"], "--speculative-num-draft-tokens", 3, "--max-new-tokens", 8,
                       "--output", output)
    result = json.loads(out)
    assert code == 0 and result["stats"]["drafter"] == "draft-model"
    assert len(result["outputs"][0]["token_ids"]) <= 8
    assert json.loads(output.read_text()) == result


def test_generate_from_jsonl_batch(capsys, model_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os"}\n\n"x = 1"\n{"prompt_ids": [5, 6, 7]}\n')
    code, out, _ = run(capsys, "generate", "--target", model_dirs["qwen2"], "--prompts", prompts, "--json",
                       "--drafter", "prompt-lookup", "--max-new-tokens", 5, "--temperature", 0.8, "--top-k", 20)
    assert code == 0
    assert len(json.loads(out)["outputs"]) == 3


@pytest.mark.parametrize("extra,needles", [
    (["-k", "0"], ["k must be >= 1"]),
    (["--max-new-tokens", "-1"], ["max_new_tokens"]),
    (["--temperature", "-0.5"], ["temperature"]),
    (["--top-p", "0"], ["top_p"]),
    (["--top-p", "1.5"], ["top_p"]),
    (["--top-k", "0"], ["top_k"]),
    (["--max-new-tokens", "300"], ["context window"]),
    (["--drafter", "draft-model"], ["--draft"]),
    (["--dtype", "int3"], ["dtype"]),
    (["--tree-depth", "5", "--tree-nodes", "3"], ["num_nodes >= 5"]),
    (["--tree-topk", "0"], ["must be >= 1"]),
    (["--speculative-num-steps", "4", "--speculative-num-draft-tokens", "4"], ["num_nodes >= 4"]),
    (["--speculative-num-draft-tokens", "1"], ["counts the pending token"]),
    (["--backend", "native", "--target-is-gpt2"], []),
])
def test_bad_generation_arguments(capsys, model_dirs, tmp_path, extra, needles):
    output = tmp_path / "never.json"
    target = model_dirs["llama"]
    if "--target-is-gpt2" in extra:  # the native backend runs the Llama family only
        extra, target, needles = ["--backend", "native"], model_dirs["gpt2"], ["native backend", "llama"]
    code, out, err = run(capsys, "generate", "--target", target, "--prompt", "x = 1",
                         "--output", output, *extra)
    assert_one_line_error(code, err, *needles)
    assert not output.exists() and not list(tmp_path.iterdir())


def test_tree_flags_and_sglang_names(capsys, model_dirs):
    base = ["generate", "--target", model_dirs["llama"], "--prompt", "x = 1\nx = 1\n", "--json",
            "--max-new-tokens", 12, "--drafter", "prompt-lookup"]
    code, out, _ = run(capsys, *base, "--tree-depth", 3, "--tree-topk", 2, "--tree-nodes", 5)
    stats = json.loads(out)["stats"]
    assert code == 0 and stats["mean_k"] <= 5 and len(stats["acceptance_by_position"]) <= 3
    # SGLang counts the pending token: 6 verified tokens = 5 tree nodes
    code, sglang, _ = run(capsys, *base, "--speculative-num-steps", 3, "--speculative-eagle-topk", 2,
                          "--speculative-num-draft-tokens", 6)
    assert code == 0 and json.loads(sglang)["stats"]["k_history"] == stats["k_history"]
    assert json.loads(sglang)["stats"]["k_sum"] == stats["k_sum"]
    code, out, _ = run(capsys, *base[:-2], "--drafter", "draft-model", "--draft", model_dirs["llama-draft"],
                       "--speculative-num-draft-tokens", 4)  # a chain of 3
    assert code == 0 and json.loads(out)["stats"]["k_history"][0] == 3


def test_output_folder_must_exist_before_any_work(capsys, model_dirs, tmp_path):
    code, _, err = run(capsys, "generate", "--target", model_dirs["llama"], "--prompt", "x",
                       "--output", tmp_path / "missing" / "out.json")
    assert_one_line_error(code, err, "output folder does not exist")


def test_missing_and_invalid_model_directories(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", tmp_path / "nope", "--prompt", "x")
    assert_one_line_error(code, err, "not found")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    code, _, err = run(capsys, "generate", "--target", broken, "--prompt", "x")
    assert_one_line_error(code, err, "config.json")
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = run(capsys, "generate", "--target", empty, "--prompt", "x")
    assert_one_line_error(code, err, "weights")


@pytest.fixture(scope="module")
def truncated_dir(tmp_path_factory, model_dirs):
    """A copy of the tiny Llama whose model.safetensors lost its second half (an interrupted download)."""
    broken = shutil.copytree(model_dirs["llama"], tmp_path_factory.mktemp("truncated") / "llama")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return broken


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("role", ["--target", "--draft"])
def test_truncated_weights_are_one_line(capsys, model_dirs, truncated_dir, tmp_path, backend, role):
    models = {"--target": model_dirs["llama"], "--draft": model_dirs["llama-draft"], role: truncated_dir}
    common = ["--target", models["--target"], "--draft", models["--draft"], "--backend", backend]
    code, _, err = run(capsys, "generate", *common, "--drafter", "draft-model", "--prompt", "x = 1",
                       "--max-new-tokens", 4)
    assert_one_line_error(code, err, str(truncated_dir))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"x = 1"\n')
    code, _, err = run(capsys, "bench", *common, "--prompts", prompts, "--no-transformers", "--max-new-tokens", 2)
    assert_one_line_error(code, err, str(truncated_dir))


def test_inexact_numerics_warning_is_one_line(capsys, model_dirs):
    code, out, err = run(capsys, "generate", "--target", model_dirs["llama"], "--backend", "hf", "--dtype", "bf16",
                         "--drafter", "prompt-lookup", "--prompt", "x = 1", "--max-new-tokens", 4, "--json")
    assert code == 0 and json.loads(out)["stats"]["exact_numerics"] is False
    assert err.startswith("specdec: warning: speculative output may differ from plain decoding in bfloat16")
    assert len(err.strip().splitlines()) == 1, err


def test_draft_vocabulary_must_match(capsys, model_dirs, other_vocab_dir):
    code, _, err = run(capsys, "generate", "--target", model_dirs["llama"], "--drafter", "draft-model",
                       "--draft", other_vocab_dir, "--prompt", "x = 1")
    assert_one_line_error(code, err, "vocabulary")


def test_empty_prompts(capsys, model_dirs, tmp_path):
    code, _, err = run(capsys, "generate", "--target", model_dirs["llama"], "--prompt", "")
    assert_one_line_error(code, err, "empty")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    code, _, err = run(capsys, "generate", "--target", model_dirs["llama"], "--prompts", prompts)
    assert_one_line_error(code, err, "line 2", "empty")


@pytest.mark.parametrize("content,line", [('{"prompt": "a"}\n{"prompt": \n', 2), ('"a"\n"b"\n[1, 2]\n', 3),
                                          ('{"prompt": "a"}\n{"other": 1}\n', 2),
                                          ('{"prompt_ids": [1, "x"]}\n', 1)])
def test_malformed_jsonl_names_the_line(capsys, model_dirs, tmp_path, content, line):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    code, _, err = run(capsys, "generate", "--target", model_dirs["llama"], "--prompts", prompts)
    assert_one_line_error(code, err, f"line {line}")


def test_missing_prompts_file_and_unknown_drafter(capsys, model_dirs, tmp_path):
    code, _, err = run(capsys, "generate", "--target", model_dirs["llama"], "--prompts", tmp_path / "none.jsonl")
    assert_one_line_error(code, err, "not found")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", str(model_dirs["llama"]), "--prompt", "x", "--drafter", "medusa-x"])
    assert exit_info.value.code == 2
    assert_one_line_error(2, capsys.readouterr().err, "unknown drafter")


def test_installed_command_prints_no_traceback(model_dirs):
    result = subprocess.run([sys.executable, "-m", "specdec.commands.cli", "generate", "--target", str(model_dirs["llama"]),
                             "--prompt", "x", "--top-p", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["specdec: error: top_p must be in (0, 1], got 2.0"]


def test_draft_p_min(capsys, model_dirs):
    """--draft-p-min (llama.cpp's flag) reaches the draft model; outside (0, 1) it is one line."""
    base = ["generate", "--target", model_dirs["llama"], "--prompt", "x = 1", "--max-new-tokens", 8, "--json",
            "--drafter", "draft-model", "--draft", model_dirs["llama-draft"], "-k", 4]
    code, plain, _ = run(capsys, *base)
    assert code == 0
    code, cut, _ = run(capsys, *base, "--draft-p-min", 0.99)
    assert code == 0 and json.loads(cut)["outputs"] == json.loads(plain)["outputs"]
    assert json.loads(cut)["stats"]["drafts_proposed"] < json.loads(plain)["stats"]["drafts_proposed"]
    code, _, err = run(capsys, *base, "--draft-p-min", 1.5)
    assert_one_line_error(code, err, "p_min must be in (0, 1)")


def test_bench_measures_several_cuts_and_records_the_fastest(capsys, model_dirs, tmp_path):
    """bench --draft-p-min P1 P2 ...: every drafter that takes a cut runs at each (labels tell them apart),
    the others once; --record keeps the fastest row's k and cut; a cut no measured drafter takes, or one
    given to a drafter that takes none, is one line."""
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(model_dirs["llama-draft"], draft)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"x = 1\\ny = x + 1\\n"\n"def f(a):\\n    return a"\n')
    common = ["--target", model_dirs["llama"], "--prompts", prompts, "--no-transformers", "--max-new-tokens", 12]
    code, out, _ = run(capsys, "bench", *common, "--draft", draft, "-k", 2, 4, "--draft-p-min", 0, 0.3, 0.99,
                       "--record", "--json")
    assert code == 0
    result = json.loads(out)
    rows = [r for r in result["rows"] if r["family"] == "draft-model"]
    assert result["outputs_identical"] and len(rows) == 6 and len({r["method"] for r in rows}) == 6
    assert sorted({str(r["p_min"]) for r in rows}) == ["0.3", "0.99", "None"]
    assert {r["method"] for r in rows if r["p_min"] == 0.3} == {"specdec draft-model k=2 p>=0.3",
                                                                "specdec draft-model k=4 p>=0.3"}
    assert len([r for r in result["rows"] if r["family"] == "prompt-lookup"]) == 2  # takes no cut: once per k
    best = max(rows, key=lambda r: r["speedup_vs_plain"])
    recorded = json.loads((draft / "config.json").read_text())["specdec"]["defaults"]
    assert (recorded["num_draft_tokens"], recorded.get("p_min")) == (best["k"], best["p_min"])
    code, _, err = run(capsys, "bench", *common, "--draft-p-min", 0.3)
    assert_one_line_error(code, err, "none of the drafters measured takes it")
    code, _, err = run(capsys, "generate", "--target", model_dirs["llama"], "--prompt", "x = 1", "--drafter",
                       "prompt-lookup", "--draft-p-min", 0.3)
    assert_one_line_error(code, err, "--draft-p-min cuts the chains of draft-model, eagle, eagle3, mtp")
