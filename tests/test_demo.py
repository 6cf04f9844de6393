"""The demo and the task-set bench on the committed zoo; greedy parity on trained models."""

from __future__ import annotations

import json

import pytest
import torch

import specdec
from specdec.backends import hf
from specdec.commands.cli import main
from specdec.drafters import DraftModel, PromptLookup
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


@pytest.fixture(scope="module")
def zoo():
    return specdec.load_target(zoo_path("target")), DraftModel(zoo_path("draft"))


def test_demo_runs_every_method_and_finds_identical_outputs(capsys):
    assert main(["demo", "--zoo", "--max-new-tokens", "24", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "all greedy outputs identical" in out
    for method in ("specdec plain", "specdec draft-model k=4", "specdec prompt-lookup k=4",
                   "transformers draft-model k=4", "transformers prompt-lookup k=4"):
        assert method in out


def test_bench_on_a_task_set(capsys):
    code = main(["bench", "--target", str(zoo_path("target")), "--draft", str(zoo_path("draft")),
                 "--tasks", "copy-edit", "--num-prompts", "2", "-k", "4", "--max-new-tokens", "16", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["outputs_identical"] and result["prompts"] == 2


def test_unknown_task_set_is_one_line_error(capsys):
    code = main(["bench", "--target", str(zoo_path("target")), "--tasks", "nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "nope" in err[0]


def test_trained_pair_is_lossless_and_accepts_drafts(zoo):
    target, draft = zoo
    assert target.backend.name == "native"  # the zoo is a Llama: "auto" runs it natively
    model = hf.load_causal_lm(zoo_path("target"))
    prompts = target.encode(load_tasks("code-completion")[:4] + load_tasks("copy-edit")[:2])
    reference = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
        tokens = out[0, len(prompt):].tolist()
        eos = target.eos_token_ids
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        reference.append(tokens[:cut])
    for drafter in (draft, PromptLookup()):
        out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=32)
        assert out.token_ids == reference, drafter.name
        assert out.stats.mean_accepted_length > 1.3, "a trained draft / real code must get drafts accepted"


def test_bench_records_the_fastest_setting_and_the_drafter_uses_it(tmp_path, capsys, zoo):
    import shutil

    from specdec.drafters import Eagle

    from specdec.drafters.draft_model import DraftModel

    folder, draft = tmp_path / "eagle3", tmp_path / "draft"
    shutil.copytree(zoo_path("eagle3"), folder)
    shutil.copytree(zoo_path("draft"), draft)
    code = main(["bench", "--target", str(zoo_path("target")), "--tasks", "code-completion", "copy-edit",
                 "--num-prompts", "1", "-k", "2", "4", "--trees", "3/2/4", "--max-new-tokens", "12", "--no-transformers",
                 "--drafters", f"eagle3={folder}", "--draft", str(draft), "--record", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["prompts"] == 2 and result["cpu"]
    rows = [r for r in result["rows"] if r["family"] == "eagle3"]
    best = max(rows, key=lambda r: r["speedup_vs_plain"])
    recorded = json.loads((folder / "config.json").read_text())["specdec"]["defaults"]
    assert (recorded["num_draft_tokens"], recorded["tree"]) == (best["k"], best["tree"])
    drafter = Eagle(folder)
    assert drafter.default_draft_tokens == best["k"]
    fastest = max((r for r in result["rows"] if r["family"] == "draft-model" and r["impl"] == "specdec"),
                  key=lambda r: r["speedup_vs_plain"])
    recorded = json.loads((draft / "config.json").read_text())["specdec"]["defaults"]
    assert recorded["num_draft_tokens"] == fastest["k"] == DraftModel(draft).default_draft_tokens
    assert (drafter.default_tree is None) == (best["tree"] is None)
    # a generation that asks for neither k nor a tree runs the recorded setting, still exact
    target, _ = zoo
    prompts = target.encode(load_tasks("code-completion")[:2])
    plain = specdec.generate(target, prompts, max_new_tokens=16)
    out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=16)
    assert out.token_ids == plain.token_ids
    assert Eagle(zoo_path("eagle3")).default_tree is None  # the committed zoo folder records nothing


def test_demo_runs_the_real_target_in_bfloat16_where_the_cpu_computes_it(monkeypatch):
    from specdec.commands.demo import demo_dtype
    from specdec.models import kernels

    monkeypatch.setattr(kernels, "fast_bfloat16", lambda: True)
    monkeypatch.setattr(kernels, "bf16_halves", lambda: False)
    assert demo_dtype("auto", zoo=False) == "bfloat16"
    assert demo_dtype("auto", zoo=True) == "float32"
    assert demo_dtype("float32", zoo=False) == "float32"
    monkeypatch.setattr(kernels, "fast_bfloat16", lambda: False)
    assert demo_dtype("auto", zoo=False) == "float32"
    assert demo_dtype("bfloat16", zoo=True) == "bfloat16"
    monkeypatch.setattr(kernels, "bf16_halves", lambda: True)  # AVX2: bfloat16 panels of interleaved halves
    assert demo_dtype("auto", zoo=False) == "bfloat16"
