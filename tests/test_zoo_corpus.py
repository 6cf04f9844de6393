"""Corpus split: disjoint, stable, non-empty, and free of excluded files."""

import pytest

from specdec.zoo import corpus


@pytest.fixture(scope="module")
def splits():
    return {name: corpus.list_split(name) for name in corpus.SPLITS}


def test_splits_are_disjoint_and_non_empty(splits):
    seen = {}
    for name, paths in splits.items():
        assert paths, f"{name} split is empty"
        for path in paths:
            assert path not in seen, f"{path} is in both {seen[path]} and {name}"
            seen[path] = name
    assert len(splits["train"]) > 10 * len(splits["test"])


def test_split_is_stable_across_calls(splits):
    corpus._classified.cache_clear()  # recompute from disk, not from the cache
    for name in corpus.SPLITS:
        assert corpus.list_split(name) == splits[name]


def test_excluded_files_are_absent(splits):
    root = corpus.stdlib_root()
    for paths in splits.values():
        for path in paths:
            rel = path.relative_to(root)
            assert path.suffix == ".py"
            assert not {"site-packages", "test", "tests", "idle_test"} & set(rel.parts[:-1])
            assert rel.as_posix() != "pydoc_data/topics.py"


def test_split_of_is_a_pure_function_of_the_path():
    assert corpus.split_of("json/decoder.py") == corpus.split_of("json/decoder.py")
    buckets = {corpus.split_of(f"pkg/module_{i}.py") for i in range(200)}
    assert buckets == set(corpus.SPLITS)


def test_read_split_matches_list_split(splits):
    texts = corpus.read_split("test")
    assert len(texts) == len(splits["test"])
    assert texts[0] == splits["test"][0].read_text(encoding="utf-8")


def test_unknown_split_is_a_clear_error():
    with pytest.raises(corpus.CorpusError, match="unknown corpus split"):
        corpus.list_split("dev")
