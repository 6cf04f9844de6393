"""Task sets: sizes, lengths, determinism, and clear errors."""

import pytest

from specdec.zoo import ZooError, tasks, zoo_path
from specdec.zoo import tokenizer as zt
from specdec.zoo import default_tokenizer_dir


def test_each_committed_task_set_has_enough_prompts():
    for name in tasks.TASK_NAMES:
        records = tasks.load_task_records(name)
        assert len(records) >= 50, name
        assert len({r["id"] for r in records}) == len(records)
        assert all(r["prompt"].strip() and r["max_new_tokens"] > 0 for r in records)
        assert tasks.load_tasks(name) == [r["prompt"] for r in records]


def test_long_context_prompts_fit_the_context_window():
    raw = zt.load_tokenizer(default_tokenizer_dir())
    from specdec.train.target import PRESETS

    max_positions = PRESETS["zoo"].shape.max_position_embeddings
    for prompt in tasks.load_tasks("long-context"):
        n = len(raw.encode(prompt).ids)
        assert 1000 <= n <= max_positions - 128


def test_committed_task_sets_match_a_fresh_build():
    fresh = tasks.build_task_sets()
    for name in tasks.TASK_NAMES:
        assert fresh[name] == tasks.load_task_records(name), f"{name}.jsonl is stale; run `specdec zoo tasks`"


def test_copy_edit_prompt_announces_the_rename():
    for prompt in tasks.load_tasks("copy-edit")[:10]:
        assert "# Same function, with `" in prompt


def test_rename_identifier_skips_attributes():
    src = "def f(a, b):\n    a = a + b.a\n    return a\n"
    assert tasks.rename_identifier(src, "a", "z") == "def f(z, b):\n    z = z + b.a\n    return z\n"


def test_unknown_names_are_clear_errors():
    with pytest.raises(ZooError, match="unknown task set"):
        tasks.load_tasks("summarise")
    with pytest.raises(ZooError, match="unknown zoo model"):
        zoo_path("medium")
