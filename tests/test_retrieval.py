"""Retrieval drafting (REST): the datastore's search, the drafts it makes, and lossless generation with it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import specdec
from specdec import TreeConfig
from specdec.commands.cli import main
from specdec.drafters.retrieval import (Datastore, DatastoreError, Retrieval, build_datastore, score_paths,
                                        select_nodes)
from specdec.errors import InvalidArgumentError
from test_greedy_parity import MAX_NEW, PROMPTS, reference_with_stop


def brute_force(sequences, query):
    """(sequence, start) of every occurrence of query inside one sequence."""
    return sorted((i, s) for i, seq in enumerate(sequences) for s in range(len(seq) - len(query) + 1)
                  if seq[s: s + len(query)] == query)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(1, 60))] for _ in range(40)]
    return sequences, Datastore(build_datastore(sequences, tmp_path_factory.mktemp("ds") / "store", vocab_size=6))


def test_find_returns_exactly_the_occurrences(small_store):
    sequences, store = small_store
    starts = np.cumsum([0] + [len(s) + 1 for s in sequences[:-1]])  # each sequence is followed by a separator
    rng = random.Random(1)
    for n in range(1, store.key_length + 1):
        for _ in range(25):
            query = [rng.randrange(6) for _ in range(n)]
            lo, hi = store.find(query)
            found = sorted(int(p) for p in store.order[lo:hi])
            expected = sorted(int(starts[i]) + s for i, s in brute_force(sequences, query))
            assert found == expected, query  # never across the end of a sequence


def test_match_is_the_longest_occurring_tail(small_store):
    """match bisects over the tail's length; it finds what trying every length finds, ids outside the
    vocabulary (a separator, a token the store cannot hold) ending the tail."""
    sequences, store = small_store
    rng = random.Random(2)
    for _ in range(400):
        context = [rng.choice([-1, 7]) if rng.random() < 0.05 else rng.randrange(6) for _ in range(rng.randrange(12))]
        max_ngram = rng.randrange(1, 10)
        min_ngram = rng.randrange(1, max_ngram + 1)
        expected = (0, 0, 0)
        for n in range(min_ngram, min(max_ngram, store.key_length, len(context)) + 1):
            tail = context[len(context) - n:]
            if not all(0 <= token < 6 for token in tail) or not brute_force(sequences, tail):
                break
            expected = (n, *store.find(tail))
        assert store.match(context, max_ngram, min_ngram) == expected, (context, max_ngram, min_ngram)


def test_continuations_follow_the_longest_tail_and_stop_at_a_sequence_end(tmp_path):
    store = Datastore(build_datastore([[1, 2, 3, 4, 5], [9, 3, 4, 7], [3, 4, 8, 8, 8, 8]], tmp_path / "s", vocab_size=10))
    # tail (2, 3, 4) occurs once: followed by 5, then the sequence ends
    assert store.continuations([7, 2, 3, 4], depth=3, max_ngram=4, min_ngram=1, samples=8) == [[5]]
    # tail (3, 4) alone: three occurrences, in the order of what follows them
    assert store.continuations([6, 3, 4], depth=2, max_ngram=4, min_ngram=1, samples=8) == [[5], [7], [8, 8]]
    assert store.continuations([6, 3, 4], depth=2, max_ngram=4, min_ngram=3, samples=8) == []
    assert len(store.continuations([6, 3, 4], depth=2, max_ngram=4, min_ngram=1, samples=2)) == 2


def test_nodes_are_the_best_scored_with_topk_children_parents_first():
    scores = score_paths([[5, 6]], [[1, 2], [1, 2], [1, 3], [4]])
    assert scores[(5,)] == 1.0 and scores[(1,)] == 0.75 and scores[(1, 2)] == 0.5
    tokens, parents, depths = select_nodes(scores, depth=2, topk=1, num_nodes=2)  # a chain: the best child each time
    assert tokens == [5, 6] and parents == [-1, 0] and depths == [1, 2]
    tokens, parents, depths = select_nodes(scores, depth=2, topk=2, num_nodes=5)
    assert tokens == [5, 1, 6, 2, 3] and parents == [-1, -1, 0, 1, 1] and depths == [1, 1, 2, 2, 2]
    tokens, _, _ = select_nodes(scores, depth=1, topk=3, num_nodes=5)
    assert tokens == [5, 1, 4]
    tokens, parents, _ = select_nodes(scores, depth=2, topk=2, num_nodes=5, min_score=0.6)  # rare paths left out
    assert tokens == [5, 1, 6] and parents == [-1, -1, 0]


def test_a_failed_build_leaves_nothing(tmp_path, capsys):
    with pytest.raises(InvalidArgumentError, match="must lie in"):
        build_datastore([[1, 2], [3, 99]], tmp_path / "store", vocab_size=10)
    assert not (tmp_path / "store").exists() and not list(tmp_path.iterdir())
    build_datastore([[1, 2, 3]], tmp_path / "store", vocab_size=10)
    assert "3 tokens" in capsys.readouterr().err  # the size, said before writing
    assert Datastore(tmp_path / "store").config["sequences"] == 1


def test_damaged_or_missing_datastores_are_one_line(model_dirs, tmp_path, capsys):
    with pytest.raises(DatastoreError, match="is not a datastore"):
        Datastore(tmp_path / "nothing")
    folder = build_datastore([[1, 2, 3, 4]], tmp_path / "store", vocab_size=10)
    np.save(folder / "order.npy", np.zeros(2, dtype=np.int32))
    with pytest.raises(DatastoreError, match="damaged"):
        Datastore(folder)
    (folder / "order.npy").write_bytes(b"junk")
    with pytest.raises(DatastoreError, match="does not read"):
        Datastore(folder)
    capsys.readouterr()
    code = main(["generate", "--target", str(model_dirs["llama"]), "--drafter", "retrieval", "--draft", str(folder),
                 "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "order.npy does not read" in err and len(err.splitlines()) == 1
    from specdec.zoo import zoo_path
    eagle = zoo_path("eagle")  # another method's folder: a drafter's config.json, not a datastore
    code = main(["generate", "--target", str(model_dirs["llama"]), "--drafter", "retrieval", "--draft", str(eagle),
                 "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is not a specdec datastore" in err and len(err.splitlines()) == 1


def target_store(target, prompts, reference, folder):
    """A datastore of the target's own greedy text: drafts from it are accepted, several at a time."""
    return build_datastore([p + r for p, r in zip(prompts, reference)], folder, vocab_size=target.vocab_size)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_retrieval_matches_transformers_greedy(arch, targets, hf_models, tmp_path, backend):
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    _, reference = reference_with_stop(target, model, prompts)
    rng = random.Random(2)
    noise = build_datastore([[rng.randrange(target.vocab_size) for _ in range(300)] for _ in range(5)],
                            tmp_path / "noise", vocab_size=target.vocab_size)
    own = target_store(target, prompts, reference, tmp_path / "own")
    for folder in (own, noise):
        for drafter in (Retrieval(folder), Retrieval(folder, context_paths=0, min_ngram=1, min_score=0.0)):
            for tree in (None, TreeConfig(3, 2, 6), TreeConfig(5, 3, 10)):
                out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=MAX_NEW,
                                       tree=tree)
                assert out.token_ids == reference, (folder.name, drafter, tree)
                alone = specdec.generate(target, prompts[2:3], drafter=drafter, num_draft_tokens=3,
                                         max_new_tokens=MAX_NEW, tree=tree)
                assert alone.token_ids == reference[2:3], (folder.name, drafter, tree, "alone")
    stats = specdec.generate(target, prompts, drafter=Retrieval(own, context_paths=0), num_draft_tokens=4,
                             max_new_tokens=MAX_NEW).stats
    assert stats.mean_accepted_length > 2.0, "drafts from the target's own text must be accepted"


def test_a_datastore_of_another_tokenizer_is_refused(targets, model_dirs, tmp_path):
    from specdec.backends.hf import load_tokenizer
    from specdec.zoo.datastores import build

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    folder = build(load_tokenizer(model_dirs["llama"]), [str(text)], tmp_path / "store", progress=False)
    target = targets["llama"]
    out = specdec.generate(target, target.encode(["def f(x):\n"]), drafter=Retrieval(folder), max_new_tokens=4)
    assert len(out.token_ids[0]) == 4
    config = json.loads((folder / "config.json").read_text())
    config["tokenizer"] = "0123456789abcdef"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgumentError, match="another tokenizer"):
        specdec.generate(target, target.encode(["def f(x):\n"]), drafter=Retrieval(folder), max_new_tokens=4)
    big = build_datastore([[target.vocab_size + 5]], tmp_path / "big", vocab_size=target.vocab_size + 10)
    with pytest.raises(InvalidArgumentError, match="target's vocabulary"):
        specdec.generate(target, target.encode(["x"]), drafter=Retrieval(big), max_new_tokens=2)


def test_datastore_command(model_dirs, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("for row in rows:\n    print(row)\n" * 10)
    out = tmp_path / "store"
    assert main(["datastore", "--target", str(model_dirs["llama"]), "--out", str(out), "--sources", str(text)]) == 0
    store = Datastore(out)
    assert store.config["sources"] == ["notes.txt"] and store.config["tokens"] > 10
    capsys.readouterr()
    for argv, message in ((["--sources", str(tmp_path / "missing.txt")], "neither"),
                          (["--out", str(text)], "not a datastore")):
        options = {"--target": str(model_dirs["llama"]), "--out": str(tmp_path / "other"), "--sources": str(text)}
        options.update(dict(zip(argv[::2], argv[1::2])))
        code = main(["datastore"] + [part for pair in options.items() for part in pair])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and len(err.splitlines()) == 1
    assert text.read_text().startswith("for row")  # nothing lost
    assert not (tmp_path / "other").exists()


def test_bench_records_each_of_two_datastores_by_its_folder(model_dirs, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("for row in rows:\n    print(row)\n" * 10)
    stores = [tmp_path / "first", tmp_path / "second"]
    for store in stores:
        assert main(["datastore", "--target", str(model_dirs["llama"]), "--out", str(store), "--sources", str(text)]) == 0
    out, prompts = tmp_path / "bench.json", tmp_path / "prompts.txt"
    prompts.write_text(json.dumps({"prompt": "for row in rows:\n"}) + "\n")
    assert main(["bench", "--target", str(model_dirs["llama"]), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "-k", "2", "--trees", "2/2/3", "--drafters", f"retrieval={stores[0]}", f"retrieval={stores[1]}",
                 "--no-transformers",
                 "--record", "--output", str(out)]) == 0
    labels = [row["method"] for row in json.loads(out.read_text())["rows"]]
    for setting in ("k=2", "tree=2/2/3"):  # each row names its datastore's folder
        assert f"specdec retrieval {setting} (first)" in labels and f"specdec retrieval {setting} (second)" in labels
    for store in stores:
        assert Datastore(store).config["specdec"]["defaults"]["measured_on"].endswith(" threads, float32")


def test_recorded_defaults_are_used(tmp_path):
    folder = build_datastore([[1, 2, 3]], tmp_path / "store", vocab_size=10)
    config = json.loads((folder / "config.json").read_text())
    config["specdec"] = {"defaults": {"num_draft_tokens": 3, "tree": [4, 2, 6]}}
    (folder / "config.json").write_text(json.dumps(config))
    drafter = Retrieval(folder)
    assert drafter.default_draft_tokens == 3 and drafter.default_tree == TreeConfig(4, 2, 6)
    with pytest.raises(InvalidArgumentError, match="min_ngram"):
        Retrieval(folder, min_ngram=0)


def test_proposals_are_point_masses_of_the_right_shape(tmp_path):
    from specdec.batch import Sequences
    from specdec.drafters.retrieval import RetrievalSession

    folder = build_datastore([[1, 2, 3, 4, 5, 6], [1, 2, 9]], tmp_path / "store", vocab_size=10)
    seqs = Sequences([[7, 1, 2], [1, 2, 3, 4]], capacity=8, pad_token_id=0)
    chain = RetrievalSession(Retrieval(folder, context_paths=0, min_ngram=1)).propose(seqs, 3)
    assert chain.tokens.shape == (2, 3) and chain.probs is None and chain.parents is None
    assert chain.tokens[1].tolist() == [5, 6, 0] and chain.lengths.tolist() == [3, 2]
    tree = RetrievalSession(Retrieval(folder, context_paths=0, min_ngram=1), TreeConfig(2, 2, 3)).propose(seqs, 3)
    assert tree.tokens[0].tolist() == [3, 9, 4] and tree.parents[0].tolist() == [-1, -1, 0]


def test_the_real_targets_datastore_is_built_once_with_its_measured_setting(monkeypatch, tmp_path, model_dirs):
    import specdec.zoo as zoo
    from specdec.zoo import datastores

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "answers.txt"
    text.write_text("Here is an example:\n```python\nprint(1)\n```\n" * 5)
    monkeypatch.setattr(datastores, "REAL_SOURCES", (str(text),))
    real_zoo_path = zoo.zoo_path
    monkeypatch.setattr(zoo, "zoo_path", lambda name: model_dirs["llama"] if name == "smollm2-135m" else real_zoo_path(name))
    folder = real_zoo_path("smollm2-135m/retrieval")
    assert folder == tmp_path / "cache" / "datastores" / "smollm2-135m"
    drafter = Retrieval(folder)
    assert drafter.default_draft_tokens == datastores.REAL_DEFAULTS["num_draft_tokens"] and drafter.default_tree is None
    text.write_text("changed")
    assert real_zoo_path("smollm2-135m/retrieval") == folder  # reused, not rebuilt
    tokens = Datastore(folder).config["tokens"]
    assert tokens > 20
    other = tmp_path / "other.txt"  # a folder built from other sources (an earlier version's) is rebuilt
    other.write_text("Sure! Here is a list:\n1. one\n2. two\n" * 5)
    monkeypatch.setattr(datastores, "REAL_SOURCES", (str(other),))
    assert real_zoo_path("smollm2-135m/retrieval") == folder
    assert Datastore(folder).config["sources"] == ["other.txt"] and Datastore(folder).config["tokens"] != tokens


def test_bench_asks_for_a_datastore_where_the_zoo_has_none(capsys):
    from specdec.commands.bench import parse_drafter

    with pytest.raises(InvalidArgumentError, match="specdec datastore"):
        parse_drafter("retrieval", "some/folder")
    assert parse_drafter("retrieval=/data/store", "some/folder") == ("retrieval", "/data/store")


def test_kept_answers_serve_only_their_target_and_recipe(tmp_path):
    from specdec.zoo.datastores import kept_answers, save_answers

    rows = [[5, 6, 7], [8], [70000, 1]]
    meta = {"target": "abc", "count": 3, "prompt_len": 4, "new_tokens": 2}
    save_answers(rows, tmp_path / "m" / "answers", meta)
    assert kept_answers(meta, [tmp_path / "none", tmp_path / "m" / "answers"]) == rows
    assert kept_answers({**meta, "target": "xyz"}, [tmp_path / "m" / "answers"]) is None
    assert kept_answers({**meta, "new_tokens": 3}, [tmp_path / "m" / "answers"]) is None
    assert not list((tmp_path / "m" / "answers").glob(".*"))  # no temporary left


def test_the_real_datastore_leaves_out_answers_the_zoo_lacks(monkeypatch, tmp_path, model_dirs, capsys):
    import specdec.zoo as zoo
    from specdec.zoo import datastores

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "notes.txt"
    text.write_text("Here is an example:\n```python\nprint(1)\n```\n" * 5)
    monkeypatch.setattr(datastores, "REAL_SOURCES", (str(text), "answers"))
    real_zoo_path = zoo.zoo_path
    monkeypatch.setattr(zoo, "zoo_path", lambda name: model_dirs["llama"] if name == "smollm2-135m" else real_zoo_path(name))
    monkeypatch.setattr(datastores, "target_answers", lambda *a, **k: pytest.fail("answers generated on first use"))
    folder = real_zoo_path("smollm2-135m/retrieval")
    assert "holds no answers" in capsys.readouterr().err
    assert Datastore(folder).config["sources"] == ["notes.txt"]
    assert real_zoo_path("smollm2-135m/retrieval") == folder
    assert "building" not in capsys.readouterr().err  # not rebuilt


def test_several_datastores_draft_from_the_longest_match(tmp_path):
    from specdec.drafters.retrieval import RetrievalSession

    short = build_datastore([[2, 3, 9, 9]], tmp_path / "short", vocab_size=10)  # matches [2, 3] only
    long = build_datastore([[1, 2, 3, 4, 4]], tmp_path / "long", vocab_size=10)  # matches [1, 2, 3]
    tied = build_datastore([[1, 2, 3, 5, 5], [1, 2, 3, 5, 6]], tmp_path / "tied", vocab_size=10)
    context = torch.tensor([7, 1, 2, 3])
    row = RetrievalSession(Retrieval([short, long], context_paths=0))._row(context, 2, 1, 2)
    assert row[0] == [4, 4]  # the longer match drafts; the shorter one's 9s do not
    scores = score_paths([], [[4, 4]], [[5, 5], [5, 6]])
    assert scores[(4,)] == 0.5 and scores[(5,)] == 0.5 and scores[(5, 5)] == 0.25
    tokens, parents, _ = RetrievalSession(Retrieval([long, tied], context_paths=0))._row(context, 2, 2, 4)
    assert sorted(tokens[:2]) == [4, 5] and len(tokens) == 4 and parents[:2] == [-1, -1]
    with pytest.raises(InvalidArgumentError, match="at least one datastore"):
        Retrieval([])
