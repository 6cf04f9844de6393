"""The bench runs every method, interleaved, and checks the outputs agree."""

import pytest

from specdec.errors import InvalidArgumentError

from specdec.commands.bench import DRAFT_MODEL, Method, format_table, model_time_bound, run_bench
from specdec.drafters import DraftModel


def test_bench_compares_specdec_and_transformers(targets, model_dirs):
    target = targets["llama"]
    target.eos_token_ids = (target.tokenizer.eos_token_id,)
    prompts = target.encode(["x = x + 1\nx = x + 1\n", "def f(a):\n    return a\n"])
    # A second copy of the target as draft: every draft is accepted, so tau tells the k each method used.
    result = run_bench(target, prompts, draft=DraftModel(model_dirs["llama"]), ks=[2, 4],
                       max_new_tokens=12, batch_sizes=[1, 2], progress=False, tasks=["repeat", "code"])
    assert result["outputs_identical"], result["mismatches"]
    labels = [row["method"] for row in result["rows"]]
    for label in ("specdec plain", "specdec draft-model k=4", "specdec prompt-lookup k=2",
                  "specdec draft-model k=4 batch=2", "transformers plain", "transformers draft-model k=2",
                  "transformers prompt-lookup k=4"):
        assert label in labels
    rows = {row["method"]: row for row in result["rows"]}
    assert rows["specdec plain"]["speedup_vs_plain"] == 1.0
    assert rows["specdec draft-model k=4"]["ratio_vs_transformers"] is not None
    assert rows["specdec draft-model k=4 batch=2"]["ratio_vs_batch_1"] is not None
    assert rows["transformers plain"]["tau"] == 1.0
    assert all(row["new_tokens"] > 0 for row in result["rows"])
    for impl in ("specdec", "transformers"):
        assert rows[f"{impl} draft-model k=2"]["tau"] < rows[f"{impl} draft-model k=4"]["tau"]
        assert rows[f"{impl} draft-model k=4"]["tau"] > 3.5
    assert "all greedy outputs identical" in format_table(result)

    # Per task: the chunks of one task (batch 2 mixes both: none); each task's tau is that of its prompt alone.
    assert rows["specdec plain"]["by_task"]["code"]["speedup_vs_plain"] == 1.0
    assert rows["specdec draft-model k=4 batch=2"]["by_task"] == {}
    alone = {row["method"]: row for row in run_bench(target, prompts[1:], ks=[2], max_new_tokens=12,
                                                    with_transformers=False, progress=False)["rows"]}
    assert rows["specdec prompt-lookup k=2"]["by_task"]["code"]["tau"] == alone["specdec prompt-lookup k=2"]["tau"]
    assert rows["transformers prompt-lookup k=2"]["by_task"]["code"]["tau"] is not None
    assert "per task, tau / speed over plain decoding on the task's prompts: repeat, code" in format_table(result)
    with pytest.raises(InvalidArgumentError, match="1 task names for 2 prompts"):
        run_bench(target, prompts, ks=[2], max_new_tokens=4, progress=False, tasks=["code"])


def test_outputs_are_checked_against_plain_decoding_of_their_own_implementation():
    from specdec.commands.bench import PLAIN, Method, compare_outputs

    def method(impl, family, tag=""):
        return Method(family, impl, 4 if family != PLAIN else None, 1, None, tag=tag)

    plain, spec = method("specdec", PLAIN), method("specdec", "prompt-lookup")
    hf_plain, hf_spec = method("transformers", PLAIN), method("transformers", "prompt-lookup")
    runs = [(spec, 0, [1, 2]), (plain, 0, [1, 2]), (hf_plain, 0, [1, 3]), (hf_spec, 0, [1, 3]),
            (plain, 1, [5]), (spec, 1, [6]), (hf_plain, 1, [5]), (hf_spec, 1, [5])]
    mismatches, differences = compare_outputs(runs)
    assert mismatches == [{"prompt": 1, "method": "specdec prompt-lookup k=4"}]  # compared with its own plain
    assert differences == [{"prompt": 0, "implementations": ["specdec", "transformers"]}]


def test_half_precision_bench_fails_only_on_speculation_errors(model_dirs):
    import torch

    from specdec.backends.target import load_target

    target = load_target(model_dirs["llama"], dtype=torch.bfloat16, backend="native")
    target.eos_token_ids = ()
    prompts = target.encode(["x = x + 1\nx = x + 1\n", "def f(a):\n    return a\n", "import os\n"])
    result = run_bench(target, prompts, draft=DraftModel(model_dirs["llama-draft"], dtype=torch.bfloat16),
                       ks=[4], max_new_tokens=24, progress=False)
    assert not [m for m in result["mismatches"] if m["method"].startswith("specdec")]  # bit for bit lossless
    assert result["implementations_compared_exactly"] is False  # bf16: transformers rounds its own way
    assert result["outputs_identical"] == (not result["mismatches"])


def test_recorded_runs_each_drafter_once_at_its_folders_fastest_setting(targets, model_dirs):
    """The demo's form: the draft model at the k its folder records, transformers' plain decoding only."""
    from specdec.commands.bench import own_setting
    from specdec.drafters.base import TreeConfig

    target = targets["llama"]
    prompts = target.encode(["x = x + 1\nx = x + 1\n"])
    draft = DraftModel(model_dirs["llama"])
    draft.default_draft_tokens = 3  # what `bench --record` leaves in a folder, read at load
    result = run_bench(target, prompts, draft=draft, ks=[2, 4], max_new_tokens=8, progress=False,
                       recorded=True, reference_families=())
    labels = [row["method"] for row in result["rows"]]
    assert labels == ["specdec plain", "specdec prompt-lookup k=2", "specdec prompt-lookup k=4",
                      "specdec draft-model k=3", "transformers plain"]
    assert result["outputs_identical"]

    class Chain:
        name, default_draft_tokens, default_tree = "eagle3", None, None

    tree = TreeConfig(4, 2, 6)
    chain, treed = Chain(), Chain()
    treed.default_tree = tree
    assert own_setting(chain, [2, 4]) == ([4], ())  # nothing recorded: the largest k asked for
    chain.default_draft_tokens = 2
    assert own_setting(chain, [2, 4]) == ([2], ())
    assert own_setting(treed, [2, 4]) == ([], (tree,))


def test_record_writes_each_folders_own_fastest_setting_when_a_method_runs_twice(tmp_path):
    """Two folders of one method in one bench run: each records its own best row, not the method's."""
    import json

    from specdec.commands.bench import record_fastest

    folders = {}
    for name in ("new", "old"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "config.json").write_text("{}")

    def row(label, k, speedup):
        return {"impl": "specdec", "family": "eagle", "batch_size": 1, "method": f"specdec eagle k={k} ({label})",
                "k": k, "tree": None, "tau": 1.5, "speedup_vs_plain": speedup}

    result = {"rows": [row("new", 2, 1.15), row("new", 4, 0.9), row("old", 2, 1.0), row("old", 4, 1.05)]}
    for name, folder in folders.items():
        record_fastest(result, "eagle", str(folder), "test", several=True)
    recorded = {name: json.loads((folder / "config.json").read_text())["specdec"]["defaults"]
                for name, folder in folders.items()}
    assert (recorded["new"]["num_draft_tokens"], recorded["new"]["speedup_vs_plain"]) == (2, 1.15)
    assert (recorded["old"]["num_draft_tokens"], recorded["old"]["speedup_vs_plain"]) == (4, 1.05)


def test_two_folders_of_one_method_are_labelled_by_their_folders_mtp_modules_too():
    """Rows of two folders of one method in one run name each folder, so that record_fastest finds its own; MTP
    modules kept apart from their target are named by their folder as well."""
    from types import SimpleNamespace

    from specdec.commands.bench import drafter_note

    for attribute in ("path", "modules"):
        new, old = (SimpleNamespace(**{attribute: f"/runs/{name}"}, setting="") for name in ("new", "old"))
        engine = SimpleNamespace(drafters=[("mtp", new), ("mtp", old)])
        assert (drafter_note(engine, "mtp", new), drafter_note(engine, "mtp", old)) == ("(new)", "(old)")
    alone = SimpleNamespace(modules="/runs/new", setting="")
    assert drafter_note(SimpleNamespace(drafters=[("mtp", alone)]), "mtp", alone) == ""


def test_a_draft_models_efficiency_bound_uses_its_own_pass():
    """Two draft models in one run (--draft beside a quantized file among the drafters, as the demo runs): each
    method's bound counts the pass of the model that drafted it."""
    small, big = object(), object()
    costs = {"target": {1: 0.010, 5: 0.012}, "draft": 0.001, "draft_models": {id(small): 0.001, id(big): 0.004}}

    def method(drafter):
        return Method(DRAFT_MODEL, "specdec", 4, 1, run=None, tau_tokens=30, tau_steps=10, k_sum=40, drafter=drafter)

    assert model_time_bound(method(small), costs) == pytest.approx(3.0 / (4 * 0.001 + 0.012))
    assert model_time_bound(method(big), costs) == pytest.approx(3.0 / (4 * 0.004 + 0.012))


def test_bench_bounds_take_each_pass_at_its_least_time(timed_backend):
    """The passes a bench's bounds and feature costs rest on are timed in turn, each at its least time: a slow
    spell while they are timed (here 10 passes at 4x their cost, as a busy host gives) raises none of them,
    so plain decoding's bound 1 / T(1) is not below the speed it measured."""
    from specdec.backends import costs
    from specdec.commands.bench import feature_cost

    def cost(width, layers, call):
        own = 1e-3 * (1 + 0.1 * width) + 0.5e-3 * len(layers) if width <= 8 else 0.0
        return own * (4 if 5 <= call < 15 else 1)

    backend, clock = timed_backend(cost)
    result = feature_cost(backend, (2, 5), 5, 16)
    assert (result["verify_ms"], result["with_features_ms"]) == (pytest.approx(1.5), pytest.approx(2.5))
    clock["calls"] = 100  # past the spell: each case's own cost, hidden layers included
    assert costs.least_times(backend, {"a": (1, ()), "b": (3, (1,))}, 16, repeats=3) == pytest.approx(
        {"a": 1.1e-3, "b": 1.8e-3})


def test_passes_after_no_context_read_no_empty_block(timed_backend):
    """Timing passes after an empty cache (context 0) runs no pass of zero tokens first: the native cache
    refuses an empty block."""
    from specdec.backends import costs

    def cost(width, layers, call):
        assert width > 0, "a pass of no tokens"
        return 1e-3 * width

    backend, _ = timed_backend(cost)
    assert costs.forward_times(backend, [1, 4], 0, repeats=2) == pytest.approx({1: 1e-3, 4: 4e-3})


def test_bench_measures_a_draft_model_staged_and_alone_and_records_the_staged_choice(model_dirs, tmp_path, capsys):
    """--draft-staged none prompt-lookup retrieval=DIR: the draft model measured three ways in one run, outputs
    identical; --record keeps the fastest row's staged choice (retrieval's with its datastore), which
    DraftModel then uses by default."""
    import json
    import shutil

    from specdec.commands.bench import record_fastest
    from specdec.commands.cli import main
    from specdec.drafters import DraftModel
    from specdec.drafters.retrieval import build_datastore

    folder = tmp_path / "draft"
    shutil.copytree(model_dirs["llama"], folder)  # the target itself: it agrees with every draft
    store = build_datastore([[5, 17, 33, 5, 17, 33, 40], [60, 61, 62, 63]], tmp_path / "store", vocab_size=90)
    out, prompts = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [5, 17, 33, 5, 17, 33, 5]}\n{"prompt_ids": [60, 61, 62]}\n')
    assert main(["bench", "--target", str(model_dirs["llama"]), "--draft", str(folder), "--prompts",
                 str(prompts), "--max-new-tokens", "12", "-k", "4", "--draft-staged", "none",
                 "prompt-lookup", f"retrieval={store}", "--staged-guesses", "2", "--no-transformers",
                 "--output", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["family"] == "draft-model"]
    assert sorted(r.get("staged") or "none" for r in rows) == ["none", "prompt-lookup", "retrieval"]
    assert [r["staged_guesses"] for r in rows if r.get("staged")] == [2, 2]
    assert [r.get("staged_datastore") for r in rows] == [None, None, str(store.resolve())]
    assert len({r["tau"] for r in rows}) == 1          # the same drafts either way
    staged = next(r for r in rows if r.get("staged") == "prompt-lookup")
    retrieval = next(r for r in rows if r.get("staged") == "retrieval")
    others = [{**r, "speedup_vs_plain": 0.5} for r in rows if not r.get("staged")]
    record_fastest({"rows": [{**staged, "speedup_vs_plain": 2.0}, {**retrieval, "speedup_vs_plain": 1.5}, *others]},
                   "draft-model", str(folder), "test")
    defaults = json.loads((folder / "config.json").read_text())["specdec"]["defaults"]
    assert (defaults["staged"], defaults["staged_guesses"], defaults["speedup_vs_plain"]) == ("prompt-lookup", 2, 2.0)
    assert "staged_datastore" not in defaults
    assert DraftModel(folder).staged.name == "prompt-lookup"
    record_fastest({"rows": [{**staged, "speedup_vs_plain": 2.0}, {**retrieval, "speedup_vs_plain": 3.0}, *others]},
                   "draft-model", str(folder), "test")
    defaults = json.loads((folder / "config.json").read_text())["specdec"]["defaults"]
    assert (defaults["staged"], defaults["staged_datastore"]) == ("retrieval", str(store.resolve()))
    drafter = DraftModel(folder)
    assert drafter.staged.name == "retrieval" and drafter.staged_guesses == 2
    assert drafter.staged.store.folder.resolve() == store.resolve()


def test_repeats_time_each_prompt_by_its_fastest_run(targets, monkeypatch):
    """With repeats, each prompt's fastest run gives the speeds: a slow spell that lands on one run of plain
    decoding's turn does not move the ratios; the tokens counted are one run's."""
    import specdec.commands.bench as bench

    target = targets["llama"]
    prompts = target.encode(["x = x + 1\nx = x + 1\n", "def f(a):\n    return a\n"])
    real, runs = bench._run_timed, []

    def timed(method, chunk):  # plain decoding 1 s a prompt, but 9 s on its first run; prompt lookup 2 s
        outputs, info, _ = real(method, chunk)
        runs.append(method.family)
        return outputs, info, (9.0 if runs.count("plain") == 1 else 1.0) if method.family == "plain" else 2.0

    monkeypatch.setattr(bench, "_run_timed", timed)
    result = run_bench(target, prompts, ks=[2], max_new_tokens=8, with_transformers=False, progress=False,
                       repeats=2)
    rows = {row["method"]: row for row in result["rows"]}
    plain, lookup = rows["specdec plain"], rows["specdec prompt-lookup k=2"]
    assert plain["seconds"] == 2.0 and lookup["seconds"] == 4.0
    assert plain["new_tokens"] == lookup["new_tokens"] == 16
    assert lookup["speedup_vs_plain"] == 0.5
    assert "each prompt's fastest repeat timed" in format_table(result)
