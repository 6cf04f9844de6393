"""The bench runs every method, interleaved, and checks the outputs agree."""

from specdec.bench import format_table, run_bench
from specdec.drafters import DraftModel


def test_bench_compares_specdec_and_transformers(targets, model_dirs):
    target = targets["llama"]
    target.eos_token_ids = (target.tokenizer.eos_token_id,)
    prompts = target.encode(["x = x + 1\nx = x + 1\n", "def f(a):\n    return a\n"])
    # A second copy of the target as draft: every draft is accepted, so tau tells the k each method used.
    result = run_bench(target, prompts, draft=DraftModel(model_dirs["llama"]), ks=[2, 4],
                       max_new_tokens=12, batch_sizes=[1, 2], progress=False)
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
