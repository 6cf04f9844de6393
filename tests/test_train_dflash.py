"""Training DFlash on the zoo target: anchors as at inference, the loss goes down, resumption is
exact, the offline metric drafts as inference does, the long-context phase continues a drafter,
and the saved folder decodes exactly."""

from dataclasses import replace

import pytest
import torch

import specdec
from specdec.commands.train import main
from specdec.drafters import DFlash
from specdec.train import dflash as td
from specdec.train import loop
from specdec.zoo import zoo_path

QUIET = dict(log=lambda message: None)


def history(ckpt_dir):
    return torch.load(loop.list_checkpoints(ckpt_dir)[-1], weights_only=False)["history"]


def test_anchors_are_generated_positions_with_a_next_token_without_repeats():
    valid = torch.tensor([[True] * 12, [True] * 7 + [False] * 5])
    prompt_len = torch.tensor([4, 3])
    generator = torch.Generator().manual_seed(0)
    anchors, ok = td.sample_anchors(valid, prompt_len, 6, generator)
    for row in range(2):
        picked = anchors[row][ok[row]].tolist()
        assert picked == sorted(set(picked))
        assert all(prompt_len[row] <= a and a + 1 < int(valid[row].sum()) for a in picked)
    assert int(ok[0].sum()) == 6 and int(ok[1].sum()) == 3  # row 1 has only positions 3, 4, 5
    again, _ = td.sample_anchors(valid, prompt_len, 6, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)


def test_slot_weights_favour_early_positions():
    weights = td.slot_weights(5, 7.0)
    assert weights[0] == 0 and weights[1] == 1 and all(weights[i] > weights[i + 1] for i in range(1, 4))
    assert td.slot_weights(4, 0).tolist() == [0, 1, 1, 1]


def test_training_lowers_the_loss_and_saves_a_drafter_that_decodes_exactly(tmp_path, capsys):
    summary = td.train_dflash(td.PRESETS["tiny"], zoo_path("target"), tmp_path / "out", **QUIET)
    losses = [r["loss"] for r in history(tmp_path / "out" / "checkpoints")]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    offline = summary["offline"]
    assert 1.0 <= offline["b2_tau"] <= 2.0 and 1.0 <= offline["b4_tau"] <= 4.0
    assert summary["mask_token_id"] == 1  # the zoo target's pad token, a real embedding row
    drafter = DFlash(tmp_path / "out")
    assert drafter.block_size == 4 and drafter.config.training["offline"]["b4_tau"] == offline["b4_tau"]
    target = specdec.load_target(zoo_path("target"))
    prompts = target.encode(["def f(x):\n    return", "import os\n"])
    plain = specdec.generate(target, prompts, max_new_tokens=12)
    assert specdec.generate(target, prompts, drafter=drafter, max_new_tokens=12).token_ids == plain.token_ids

    # the offline metric of the saved folder, from the command line
    assert main(["train", "evaluate", "--drafter", str(tmp_path / "out"), "--target", str(zoo_path("target")),
                 "--heldout", "4", "--cache-dir", str(tmp_path / "out" / "checkpoints")]) == 0
    import json
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"b2_tau", "b4_tau", "accept_3"} <= set(printed) and printed["b4_tau"] == pytest.approx(offline["b4_tau"], abs=1e-3)

    # the second phase continues this drafter (its shape wins over the preset's), and keeps the draft
    # vocabulary it drafted from (without the file every draft would read the whole head)
    vocab = (tmp_path / "out" / "draft_vocab.json")
    vocab.write_text(json.dumps({"ids": list(range(0, target.vocab_size, 2))}))
    base = td.PRESETS["tiny"]
    config = replace(base, init_from=str(tmp_path / "out"), shape=replace(base.shape, layers=2),
                     optim=replace(base.optim, steps=4, eval_every=100))
    long = td.train_dflash(config, zoo_path("target"), tmp_path / "long", **QUIET)
    assert long["initialised_from"] == str(tmp_path / "out") and DFlash(tmp_path / "long").config.num_hidden_layers == 1
    assert (tmp_path / "long" / "draft_vocab.json").read_text() == vocab.read_text()
    assert DFlash(tmp_path / "long").vocabulary.tolist() == list(range(0, target.vocab_size, 2))


def check_resume_is_exact(train, config, tmp_path):
    """``train(config, target, out, ckpt_dir=, resume=, log=)`` for 8 steps, checkpoints every 4: killed
    after step 4 and resumed, it ends bit for bit where the uninterrupted run ended."""
    config = replace(config, optim=replace(config.optim, steps=8, ckpt_every_steps=4, eval_every=100))
    ckpt = tmp_path / "ckpt"
    train(config, zoo_path("target"), tmp_path / "a", ckpt_dir=ckpt, **QUIET)
    full = torch.load(loop.list_checkpoints(ckpt)[-1], weights_only=False)
    loop.list_checkpoints(ckpt)[-1].unlink()  # as if killed after step 4
    train(config, zoo_path("target"), tmp_path / "b", ckpt_dir=ckpt, resume=True, **QUIET)
    resumed = torch.load(loop.list_checkpoints(ckpt)[-1], weights_only=False)
    assert resumed["step"] == full["step"] == 8
    for name, value in full["model"].items():
        assert torch.equal(value, resumed["model"][name]), name


def test_resume_after_kill_is_exact(tmp_path):
    check_resume_is_exact(td.train_dflash, td.PRESETS["tiny"], tmp_path)


def test_offline_metric_is_what_inference_accepts(tmp_path):
    """The metric's block at an anchor is the block inference drafts there: on a held-out greedy
    continuation, decoding with the drafter accepts what the metric's walk predicts."""
    from specdec.train.features import FrozenTarget, heldout_data
    from specdec.zoo import ZooError

    try:
        folder = zoo_path("dflash")  # trained: long accepted runs, where the walk matters
    except ZooError:
        folder = tmp_path / "out"
        td.train_dflash(td.PRESETS["tiny"], zoo_path("target"), folder, **QUIET)
    target = specdec.load_target(zoo_path("target"), backend="native")
    held = heldout_data(zoo_path("target"), target.fingerprint(), tmp_path / "held", 4, 8, 0, lambda m: None)
    drafter = DFlash(folder, block_size=4)
    objective = td.Objective(td.PRESETS["tiny"], FrozenTarget(zoo_path("target")), drafter.config)
    metric = objective.evaluate(drafter.net, held, (4,))
    steps = tokens = 0
    for row in range(held.tokens.shape[0]):
        start, length = int(held.prompt_len[row]), int(held.lengths[row])
        prompt = held.tokens[row, :start].tolist()
        out = specdec.generate(target, [prompt], drafter=drafter, max_new_tokens=length - start)
        assert out.token_ids[0] == held.tokens[row, start:length].tolist()
        steps += out.stats.verify_steps
        tokens += out.stats.tokens_from_steps
    assert tokens / steps == pytest.approx(metric["b4_tau"], rel=0.03)


@pytest.mark.parametrize("method", ["dflash", "dspark", "eagle", "eagle3"])
def test_cli_refuses_init_from_without_a_folder(method, tmp_path, capsys):
    code = main(["train", method, "--target", str(zoo_path("target")), "--out", str(tmp_path / "o"),
                 "--preset", "tiny", "--init-from", str(tmp_path / "nothing")])
    assert code == 2 and f"--init-from needs a trained {method} folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_training_over_a_draft_vocabulary_scores_the_rows_inference_drafts_from(method, tmp_path, capsys):
    """A block drafter continued from a folder with draft_vocab.json is trained and evaluated over those rows
    of the target's head (and of DSpark's Markov term) only, as it then drafts: with every id as the
    vocabulary the loss is the whole head's; with half of them the offline metric is what inference,
    drafting from those rows, accepts, and a continued run says so and keeps the file."""
    import json
    import shutil

    from specdec.drafters import DSpark
    from specdec.drafters.base import DRAFT_VOCAB_FILE
    from specdec.train import dspark as tsp
    from specdec.train.features import FrozenTarget, heldout_data

    trainer, kind = (td, DFlash) if method == "dflash" else (tsp, DSpark)
    folder = tmp_path / "out"
    assert main(["train", method, "--target", str(zoo_path("target")), "--preset", "tiny", "--out", str(folder)]) == 0
    target = specdec.load_target(zoo_path("target"), backend="native")
    held = heldout_data(zoo_path("target"), target.fingerprint(), tmp_path / "held", 4, 8, 0, lambda m: None)
    net = kind(folder).net
    frozen, config, vocab = FrozenTarget(zoo_path("target")), trainer.PRESETS["tiny"], target.vocab_size
    tokens, valid = held.batch(torch.arange(4))
    anchors, ok = td.sample_anchors(valid, held.prompt_len[:4], 4, torch.Generator().manual_seed(0))
    batch = (tokens, valid, anchors, ok)
    whole = trainer.Objective(config, frozen, net.config).loss(net, batch)
    every = trainer.Objective(config, frozen, net.config, torch.arange(vocab)).loss(net, batch)
    assert float(every.detach()) == pytest.approx(float(whole.detach()), rel=1e-4)

    # the zoo's trained DFlash accepts long runs, which half the vocabulary cuts short; the tiny DSpark
    # run accepts little, but its metric still walks the Markov term's rows as inference does
    source = zoo_path("dflash") if method == "dflash" else folder
    half = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[: vocab // 2].sort().values
    vocab_folder = shutil.copytree(source, tmp_path / "vocab")
    (vocab_folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": half.tolist()}))
    drafter = kind(vocab_folder, block_size=4)
    metric = trainer.Objective(config, frozen, drafter.config, half).evaluate(drafter.net, held, (4,))
    if method == "dflash":
        whole_metric = trainer.Objective(config, frozen, drafter.config).evaluate(drafter.net, held, (4,))
        assert metric["b4_tau"] < whole_metric["b4_tau"] - 0.05
    steps = tokens_out = 0
    for row in range(held.tokens.shape[0]):
        start, length = int(held.prompt_len[row]), int(held.lengths[row])
        out = specdec.generate(target, [held.tokens[row, :start].tolist()], drafter=drafter,
                               max_new_tokens=length - start)
        assert out.token_ids[0] == held.tokens[row, start:length].tolist()
        steps += out.stats.verify_steps
        tokens_out += out.stats.tokens_from_steps
    assert tokens_out / steps == pytest.approx(metric["b4_tau"], rel=0.03)

    capsys.readouterr()
    (tmp_path / "more.json").write_text(json.dumps({"optim": {"steps": 2, "eval_every": 100}}))
    assert main(["train", method, "--target", str(zoo_path("target")), "--preset", "tiny", "--config",
                 str(tmp_path / "more.json"), "--init-from", str(vocab_folder), "--out", str(tmp_path / "more")]) == 0
    assert f"drafts scored over the {vocab // 2:,} rows of the draft vocabulary" in capsys.readouterr().out
    assert json.loads((tmp_path / "more" / DRAFT_VOCAB_FILE).read_text())["ids"] == half.tolist()
