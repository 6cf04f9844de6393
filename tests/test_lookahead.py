"""Lookahead decoding: the branch's layout, the n-gram pool, the branch computing what each of its columns
computes alone, and lossless generation (chains, trees, ragged batches, both backends, the command line)."""

from __future__ import annotations

import json

import pytest
import torch

import specdec
from specdec import TreeConfig
from specdec.backends.target import load_target
from specdec.batch import Sequences
from specdec.commands.cli import main
from specdec.commands.tiny import ARCHITECTURES
from specdec.drafters import Lookahead
from specdec.drafters.base import DecodeContext
from specdec.drafters.lookahead import NgramPool, branch_layout
from specdec.errors import InvalidArgumentError
from specdec.models import kernels
from specdec.sampling import SamplingConfig
from test_greedy_parity import MAX_NEW, PROMPTS, reference_with_stop


def test_branch_layout_reads_each_column_as_one_sequence():
    mask, offsets = branch_layout(window=3, levels=2)  # tokens L0[0..2], then L1[0..2]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0],   # L0[0]: itself
                                   [1, 1, 0, 0, 0, 0],   # L0[1]: L0[0..1]
                                   [1, 1, 1, 0, 0, 0],
                                   [1, 0, 0, 1, 0, 0],   # L1[0]: L0[0], itself
                                   [1, 1, 0, 0, 1, 0],   # L1[1]: L0[0..1], itself, not L1[0]
                                   [1, 1, 1, 0, 0, 1]]
    assert offsets.tolist() == [1, 2, 3, 2, 3, 4]       # after the pending token: column + level + 1


def test_pool_keeps_the_newest_values_per_key():
    pool = NgramPool(size=2, capacity=2)
    pool.add_text([5, 1, 2, 5, 3, 4, 5])                 # keys 5, 1, 2, 5, 3 with whole values
    assert pool.get(5) == [(3, 4), (1, 2)] and pool.get(1) == [(2, 5)] and pool.get(4) == []
    pool.add(5, (1, 2))                                 # held already: moves to the front
    assert pool.get(5) == [(1, 2), (3, 4)]
    pool.add(5, (7, 7))                                 # over capacity: the oldest leaves
    assert pool.get(5) == [(7, 7), (1, 2)]
    pool.add_text([9, 9, 8, 6, 6], start=2)             # only keys from index 2 on
    assert pool.get(9) == [] and pool.get(8) == [(6, 6)]


def test_bad_settings_are_refused():
    for settings in ({"window": 0}, {"ngram": 1}, {"guesses": 0}):
        with pytest.raises(InvalidArgumentError, match="lookahead needs"):
            Lookahead(**settings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_branch_computes_each_column_alone_and_leaves_no_trace(model_dirs, dtype):
    """Verification with the branch returns plain verification's logits bit for bit and leaves the cache as
    plain verification does; each column's top-level guess is the argmax of that column's sequence run alone."""
    target = load_target(model_dirs["llama"], dtype=dtype, backend="native")
    context = target.encode([PROMPTS[2]])[0]
    seqs = Sequences([context], len(context) + 16, target.pad_token_id)
    session = Lookahead(window=3, ngram=4, guesses=2).start(
        DecodeContext(target, SamplingConfig(), None, 8, 4), seqs)
    window = session.window.clone()  # [1, 3 levels, 3 columns], tokens of the prompt
    block = torch.tensor([[context[-1], 17, 23]])  # the pending token and two drafts

    def prefilled():
        cache = target.new_cache(1, 128)
        target.forward(cache, torch.tensor([context[:-1]]))
        return cache

    cache, plain_cache = prefilled(), prefilled()
    logits, _ = session.verify_forward(cache, block, None, logits_to_keep=3)
    plain, _ = target.forward(plain_cache, block, None, logits_to_keep=3)
    assert torch.equal(logits, plain)
    assert cache.columns == plain_cache.columns and torch.equal(cache.lengths, plain_cache.lengths)
    assert torch.equal(cache.valid, plain_cache.valid) and torch.equal(cache.positions, plain_cache.positions)

    guesses = session.window[0, -1]
    assert torch.equal(session.window[0, :-1], window[0, 1:])  # the levels moved down by one
    for column in range(3):
        alone = context + window[0, 0, : column + 1].tolist() + window[0, 1:, column].tolist()
        last, _ = target.forward(target.new_cache(1, 128), torch.tensor([alone]))
        assert int(kernels.argmax(last[:, -1])) == int(guesses[column]), f"column {column}"
        gram = window[0, :, column].tolist() + [int(guesses[column])]
        assert tuple(gram[1:]) in session.pools[0].get(gram[0])  # harvested: key L0, value the levels above


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lookahead_matches_transformers_greedy(arch, targets, hf_models, backend):
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    _, reference = reference_with_stop(target, model, prompts)
    runs = [(Lookahead(window=3, ngram=3, guesses=3), 2, None), (Lookahead(window=2, ngram=5, guesses=2), 4, None),
            (Lookahead(window=3, ngram=4, guesses=4), 3, TreeConfig(depth=3, topk=3, num_nodes=7))]
    accepted = 0
    for drafter, k, tree in runs:
        out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=k, max_new_tokens=MAX_NEW,
                               tree=tree)
        assert out.token_ids == reference, f"{drafter.setting} k={k} tree={tree}"
        accepted += out.stats.drafts_accepted
        alone = specdec.generate(target, [prompts[3]], drafter=drafter, num_draft_tokens=k, max_new_tokens=MAX_NEW,
                                 tree=tree)
        assert alone.token_ids == [reference[3]], f"{drafter.setting} k={k} tree={tree} alone"
    assert accepted > 0, "no draft accepted: nothing was verified"


def test_generate_command_with_lookahead(model_dirs, capsys):
    base = ["generate", "--target", str(model_dirs["llama"]), "--prompt", PROMPTS[3], "--max-new-tokens", "24",
            "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "lookahead", "-k", "3", "--lookahead-window", "3", "--lookahead-ngram", "4",
                        "--lookahead-guesses", "2"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["outputs"] == plain["outputs"]
    assert drafted["stats"]["drafts_proposed"] > 0
    assert drafted["stats"]["cache_grown"] == 0  # the capacity counts the window's columns
    assert main(base + ["--drafter", "lookahead", "--lookahead-ngram", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "lookahead needs" in err and len(err.splitlines()) == 1


def test_bench_measures_lookahead_beside_plain(capsys):
    from specdec.zoo import zoo_path

    code = main(["bench", "--target", str(zoo_path("target")), "--tasks", "copy-edit", "--num-prompts", "2", "-k", "2",
                 "--trees", "2/2/4", "--max-new-tokens", "16", "--drafters", "lookahead", "--lookahead-window", "3",
                 "--lookahead-ngram", "3", "--lookahead-guesses", "4", "--no-transformers", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["outputs_identical"]
    rows = {row["method"]: row for row in result["rows"]}
    chain, tree = rows["specdec lookahead k=2 W=3 N=3 G=4"], rows["specdec lookahead tree=2/2/4 W=3 N=3 G=4"]
    assert chain["tau"] >= 1.0 and tree["tau"] >= 1.0
    assert chain["efficiency"] is not None  # its bound counts the window's 6 tokens in every pass
    assert main(["bench", "--target", str(zoo_path("target")), "--tasks", "copy-edit", "--drafters", "lookahead=x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "lookahead takes no folder" in err and len(err.splitlines()) == 1
