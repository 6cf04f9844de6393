"""DSpark: DFlash's block with a Markov head and a confidence head.

Greedy output equals plain decoding token for token (Llama, Qwen3 targets; float32 and bfloat16;
ragged batches with rows stopping at EOS and at the limit; the trained block and smaller ones);
sampling keeps the target's distribution; the kernel runtime drafts what the training network
drafts, left to right through the Markov head; the confidence reads only the drafts before each
slot; training lowers the loss, calibrates and saves the layout serving engines load; refusals.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import specdec
from specdec.drafters import DFlash, DSpark
from specdec.errors import DrafterMismatchError, InvalidArgumentError, ModelLoadError
from specdec.models import dflash, dspark
from specdec.sampling import SamplingConfig
from specdec.train import dspark as training
from specdec.train.dflash import mask_token_for

from test_dflash import random_dflash
from test_exact_generation import bfloat16_with_eos, sampled_pairs, sampling_case
from test_greedy_parity import MAX_NEW, PROMPTS, reference_with_stop
from test_sampling import P_VALUE, chi_square_p

ARCHS = ("llama", "qwen3")
BLOCK = 4


def random_dspark(target, folder, block_size=BLOCK, seed=0, scale=0.3, head="vanilla"):
    """A random DSpark folder for ``target``: weights spread enough to give varied drafts, and a Markov
    term large enough to change them."""
    torch.manual_seed(seed)
    config = dspark.DSparkConfig.for_target(target, 2, block_size, mask_token_for(target), markov_rank=8,
                                            markov_head_type=head, num_target_features=2)
    net = dspark.DSparkNet(config)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                p.normal_(0, scale / p.shape[1] ** 0.5 * 3)
        net.markov_head.markov_w1.weight.normal_(0, 1.0)
        net.markov_head.markov_w2.weight.normal_(0, 1.0)
        net.confidence_head.proj.weight.normal_(0, 0.5)
    return dspark.save(net, folder)


@pytest.fixture(scope="module")
def dspark_dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    dirs = {arch: random_dspark(specdec.load_target(model_dirs[arch], backend="native"), root / arch)
            for arch in ARCHS}
    dirs["gated"] = random_dspark(specdec.load_target(model_dirs["llama"], backend="native"), root / "gated",
                                  head="gated")
    return dirs


SETTINGS = [dict(), dict(num_draft_tokens=1), dict(num_draft_tokens=2), dict(block_size=3)]


def drafter_for(folder, setting):
    setting = dict(setting)
    return DSpark(folder, block_size=setting.pop("block_size", None)), setting


@pytest.mark.parametrize("arch", ARCHS)
def test_dspark_matches_transformers_greedy(arch, targets, hf_models, dspark_dirs):
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    eos, reference = reference_with_stop(target, model, prompts)
    assert any(r and r[-1] == eos for r in reference) and any(len(r) == MAX_NEW for r in reference)
    for setting in SETTINGS:
        drafter, options = drafter_for(dspark_dirs[arch], setting)
        out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW, **options)
        assert out.token_ids == reference, f"{setting} batch"
        alone = specdec.generate(target, [prompts[2]], drafter=drafter, max_new_tokens=MAX_NEW, **options)
        assert alone.token_ids == [reference[2]], f"{setting} alone"
    out = specdec.generate(target, prompts, drafter=DSpark(dspark_dirs[arch]), max_new_tokens=MAX_NEW)
    assert out.stats.mean_k == pytest.approx(BLOCK, abs=1.5)  # every slot drafts: the block, not block - 1


TREES = [(2, 2, 4), (3, 3, 8), (BLOCK, 2, 6)]


@pytest.mark.parametrize("arch", ARCHS)
def test_dspark_trees_match_transformers_greedy(arch, targets, hf_models, dspark_dirs):
    """Dynamic trees (every branch: its slot's head logits plus its own parent's Markov term) keep greedy
    decoding token for token, in a batch and alone, and accept deeper than one draft."""
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    _, reference = reference_with_stop(target, model, prompts)
    for depth, topk, nodes in TREES:
        tree = specdec.TreeConfig(depth, topk, nodes)
        recorder = Recorder(DSpark(dspark_dirs[arch]))
        out = specdec.generate(target, prompts, drafter=recorder, max_new_tokens=MAX_NEW, tree=tree)
        assert out.token_ids == reference, tree
        alone = specdec.generate(target, [prompts[2]], drafter=DSpark(dspark_dirs[arch]), max_new_tokens=MAX_NEW,
                                 tree=tree)
        assert alone.token_ids == [reference[2]], tree
        first = recorder.proposals[0]
        assert first.is_tree and 2 <= int(first.depths().max()) <= depth and first.k == nodes


def test_dspark_tree_branches_read_their_own_parents_markov_term(model_dirs, dspark_dirs, monkeypatch):
    """The children the tree gives each depth-1 node are the top-k of slot 1's head logits plus the Markov
    term of that node's own token, as the runtime computes them for a chain through it."""
    from specdec.drafters.dspark import DSparkSession

    blocks, enter = [], DSparkSession.enter

    def recorded(self, anchors, block):
        blocks.append(enter(self, anchors, block))
        return blocks[-1]
    monkeypatch.setattr(DSparkSession, "enter", recorded)
    target = specdec.load_target(model_dirs["llama"], backend="native")
    drafter = DSpark(dspark_dirs["llama"])
    recorder = Recorder(drafter)
    specdec.generate(target, target.encode(PROMPTS)[:1], drafter=recorder, max_new_tokens=4,
                     tree=specdec.TreeConfig(2, 3, 12))
    proposal = recorder.proposals[0]
    tokens, parents = proposal.tokens[0], proposal.parents[0]
    runtime = drafter.runtime(target)
    head, hidden = runtime.logits(blocks[0]), runtime.normed(blocks[0])
    children_seen = 0
    for node in range(proposal.k):
        if int(parents[node]) != -1:
            continue
        logits, _ = runtime.slot(head[:, 1], hidden[:, 1], tokens[node:node + 1], 1)
        children = {int(tokens[c]) for c in range(proposal.k) if int(parents[c]) == node}
        assert children == set(logits[0].topk(3).indices.tolist())
        children_seen += len(children)
    assert children_seen == 9


def test_a_recorded_tree_is_dsparks_default(model_dirs, dspark_dirs, tmp_path):
    """``bench --record`` may find a tree fastest: a DSpark folder that records one drafts it when a
    generation asks for neither k nor a tree; one deeper than the block is ignored."""
    from test_exact_generation import plain

    folder = shutil.copytree(dspark_dirs["llama"], tmp_path / "recorded")
    config = json.loads((folder / "config.json").read_text())
    config["specdec"]["defaults"] = {"num_draft_tokens": None, "tree": [3, 2, 5]}
    (folder / "config.json").write_text(json.dumps(config))
    drafter = DSpark(folder)
    assert drafter.default_tree == specdec.TreeConfig(3, 2, 5)
    target = specdec.load_target(model_dirs["llama"], backend="native")
    recorder = Recorder(drafter)
    prompts = target.encode(PROMPTS)
    assert specdec.generate(target, prompts, drafter=recorder, max_new_tokens=16).token_ids == plain(target, prompts, 16)
    assert recorder.proposals and all(p.is_tree for p in recorder.proposals)
    from specdec.engine import Engine
    from specdec.schedule import ConfidenceThreshold

    engine = Engine(target, drafter, policy=ConfidenceThreshold(0.5), stream=False)
    assert engine.tree is None  # a confidence policy cuts chains: the recorded tree gives way
    config["specdec"]["defaults"]["tree"] = [BLOCK + 1, 2, 8]
    (folder / "config.json").write_text(json.dumps(config))
    assert DSpark(folder).default_tree is None


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 6, None), (0.7, None, 0.9)])
def test_dspark_trees_keep_the_targets_distribution(temperature, top_k, top_p, model_dirs, dspark_dirs):
    config = SamplingConfig(temperature, top_k, top_p)
    target, prompt, exact = sampling_case(model_dirs["llama"], config)
    pairs = sampled_pairs(target, prompt, DSpark(dspark_dirs["llama"]), config, tree=specdec.TreeConfig(2, 2, 4))
    assert chi_square_p(pairs, exact) > P_VALUE


@pytest.mark.parametrize("folder", ["llama", "gated"])
def test_dspark_equals_plain_decoding_in_bfloat16(folder, model_dirs, dspark_dirs):
    target, prompts, reference = bfloat16_with_eos(model_dirs["llama"])
    for setting in SETTINGS:
        drafter, options = drafter_for(dspark_dirs[folder], setting)
        out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=40, **options)
        assert out.stats.exact_numerics and out.token_ids == reference, f"{setting}"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 6, None), (0.7, None, 0.9)])
def test_sampling_keeps_the_targets_distribution(temperature, top_k, top_p, model_dirs, dspark_dirs):
    config = SamplingConfig(temperature, top_k, top_p)
    target, prompt, exact = sampling_case(model_dirs["llama"], config)
    assert chi_square_p(sampled_pairs(target, prompt, DSpark(dspark_dirs["llama"]), config), exact) > P_VALUE


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_drafters_draft_from_their_draft_vocabulary_only(method, model_dirs, dspark_dirs, tmp_path):
    """A DFlash or DSpark folder with draft_vocab.json (half the vocabulary) computes only those rows of the
    target's head (and of the Markov head's W2), drafts only those tokens, equals plain decoding, keeps the
    target's distribution when sampling, and ignores the file when asked."""
    from specdec.drafters.base import DRAFT_VOCAB_FILE

    from test_exact_generation import plain

    target = specdec.load_target(model_dirs["llama"], backend="native")
    source = random_dflash(target, tmp_path / "dflash") if method == "dflash" else dspark_dirs["llama"]
    folder = shutil.copytree(source, tmp_path / "vocab")
    generator = torch.Generator().manual_seed(5)
    ids = torch.randperm(target.vocab_size, generator=generator)[: target.vocab_size // 2].sort().values
    (folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": ids.tolist()}))
    kind = DFlash if method == "dflash" else DSpark
    drafter = kind(folder)
    runtime = drafter.runtime(target)
    assert torch.equal(runtime.rows, ids)
    assert runtime.logits(torch.zeros(1, int(target.config.hidden_size))).shape[-1] == ids.numel()
    assert kind(folder, draft_vocab=False).runtime(target).rows is None
    prompts = target.encode(PROMPTS)
    recorder = Recorder(drafter)
    out = specdec.generate(target, prompts, drafter=recorder, max_new_tokens=24)
    assert out.token_ids == plain(target, prompts, 24)
    drafted = torch.cat([p.tokens.flatten() for p in recorder.proposals])
    assert drafted.numel() and bool(torch.isin(drafted, ids).all())
    config = SamplingConfig(1.0, 6, None)
    small, prompt, exact = sampling_case(model_dirs["llama"], config)
    assert chi_square_p(sampled_pairs(small, prompt, kind(folder), config), exact) > P_VALUE


class Recorder:
    """Wraps a session: keeps every proposal."""

    def __init__(self, drafter):
        self.drafter, self.proposals = drafter, []
        self.name, self.features = drafter.name, drafter.features

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def start(self, context, seqs):
        session = self.drafter.start(context, seqs)
        propose = session.propose

        def recorded(seqs, k):
            proposal = propose(seqs, k)
            self.proposals.append(proposal)
            return proposal
        session.propose = recorded
        return session


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_runtime_drafts_what_the_network_drafts(dtype, model_dirs, dspark_dirs):
    """The first step's drafts and confidences equal the PyTorch network's left-to-right decoding of
    the same block (its head logits, the Markov term of each previous draft, the confidence head)."""
    target = specdec.load_target(model_dirs["llama"], dtype=dtype, backend="native")
    target.eos_token_ids = ()
    folder = dspark_dirs["llama"]
    net = dspark.load_net(folder)
    prompt = target.encode([PROMPTS[1]])[0]
    recorder = Recorder(DSpark(folder))
    specdec.generate(target, [prompt], drafter=recorder, max_new_tokens=2)
    first = recorder.proposals[0]
    plain = specdec.generate(target, [prompt], max_new_tokens=1).token_ids[0]
    tokens = torch.tensor([prompt + plain])
    layers = net.config.hidden_layers()
    from specdec.train.distill import load_frozen_target

    model = load_frozen_target(model_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in layers], -1)[:, :len(prompt)]
    embed, head = target.input_embeddings().float(), target.output_head().float()
    anchors = torch.tensor([[len(prompt)]])
    with torch.no_grad():
        out = net.blocks(features, F.embedding(dflash.block_inputs(tokens, anchors, BLOCK, net.config.mask_token_id),
                                               embed), anchors)[0, 0]
        previous, drafts, confidences = tokens[:, -1], [], []
        for j in range(BLOCK):
            term, code = net.markov(out[j:j + 1], previous)
            logits = out[j:j + 1] @ head.t() + term
            confidences.append(float(torch.sigmoid(net.confidence_logit(out[j:j + 1], code))))
            previous = logits.argmax(-1)
            drafts.append(int(previous))
    if dtype == torch.float32:
        assert first.tokens[0].tolist() == drafts
    else:  # bfloat16 rounding may flip a near tie of this random network's later slots
        assert first.tokens[0, :2].tolist() == drafts[:2]
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert first.confidence[0].tolist() == pytest.approx(confidences, abs=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocabulary", [False, True], ids=["whole", "draft-vocab"])
def test_the_greedy_chain_in_one_kernel_call_drafts_the_loops_bits(dtype, vocabulary, model_dirs, dspark_dirs):
    """``greedy_chain`` (the Markov term and the argmax of every slot in one kernel call) gives the drafts
    and codes of the slot-by-slot loop bit for bit, for several rows at once and with a draft vocabulary;
    a gated head, which the kernel does not compute, falls back to the loop."""
    from specdec.drafters.base import draft_from

    target = specdec.load_target(model_dirs["llama"], dtype=dtype, backend="native")
    runtime = DSpark(dspark_dirs["llama"]).runtime(target)
    vocab = target.vocab_size
    if vocabulary:
        runtime = dspark.DSparkRuntime(dspark.load_net(dspark_dirs["llama"]), target.input_embeddings(), target,
                                       dtype, rows=torch.arange(0, vocab, 3))
    generator = torch.Generator().manual_seed(3)
    width = vocab if runtime.rows is None else runtime.rows.numel()
    head = (torch.randn(5, 6, width, generator=generator) * 2).to(dtype)
    hidden = torch.randn(5, 6, int(target.config.hidden_size), generator=generator).to(dtype)
    anchors = torch.randint(0, vocab, (5,), generator=generator)
    with torch.inference_mode():
        drafts, codes = runtime.greedy_chain(head, anchors)
        previous, expected, expected_codes = anchors, [], []
        for j in range(head.shape[1]):
            logits, code = runtime.markov(head[:, j], hidden[:, j], previous)
            previous, _ = draft_from(logits, runtime.rows, vocab, SamplingConfig(), None)
            expected.append(previous)
            expected_codes.append(code)
    assert torch.equal(drafts, torch.stack(expected, 1)) and torch.equal(codes, torch.stack(expected_codes, 1))
    assert len(set(drafts.flatten().tolist())) > 5  # the Markov term and the head's logits both matter
    assert DSpark(dspark_dirs["gated"]).runtime(target).greedy_chain(head, anchors) is None


def test_confidence_reads_only_the_drafts_before_each_slot(model_dirs, dspark_dirs):
    """Changing the Markov head's row of a token changes the drafts after it and the confidence of the
    slot after it, never the confidence of the slot that drafted it."""
    target = specdec.load_target(model_dirs["llama"], backend="native")
    runtime = DSpark(dspark_dirs["llama"]).runtime(target)
    torch.manual_seed(0)
    logits, hidden = torch.randn(3, target.vocab_size), torch.randn(3, runtime.config.hidden_size)
    previous = torch.tensor([5, 9, 11])
    _, before = runtime.slot(logits, hidden, previous, 0)
    other = previous.clone()
    other[1] = 12
    _, after = runtime.slot(logits, hidden, other, 0)
    assert before[0] == after[0] and before[2] == after[2] and before[1] != after[1]
    # the confidence of slot j is computed before draft j exists: the slot's inputs are the hidden
    # state and the previous draft, and the same inputs give the same value at every call
    assert torch.equal(runtime.slot(logits, hidden, previous, 0)[1], before)


def test_layout_serving_engines_load(dspark_dirs):
    folder = dspark_dirs["qwen3"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    extra = config["dflash_config"]
    assert extra["projector_type"] == "dspark" and extra["markov_rank"] == 8
    assert extra["markov_head_type"] == "vanilla" and extra["enable_confidence_head"] is True
    assert "confidence_head_alpha" in extra and config["specdec"]["method"] == "dspark"
    weights = load_file(folder / "model.safetensors")
    h, v = config["hidden_size"], config["vocab_size"]
    assert tuple(weights["markov_head.markov_w1.weight"].shape) == (v, 8)
    assert tuple(weights["markov_head.markov_w2.weight"].shape) == (v, 8)
    assert tuple(weights["confidence_head.proj.weight"].shape) == (1, h + 8)
    assert tuple(weights["confidence_head.proj.bias"].shape) == (1,)
    dflash_names = set(dflash.DFlashNet(dspark.load_config(folder)).state_dict())
    assert dflash_names <= set(weights)  # DFlash's tensors, under DFlash's names
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    gated = load_file(dspark_dirs["gated"] / "model.safetensors")
    assert tuple(gated["markov_head.gate.weight"].shape) == (1, h + 8)


def test_wrong_method_bad_block_and_bad_folders_are_refused(dspark_dirs, model_dirs, tmp_path, capsys):
    from specdec.commands.cli import main
    from specdec.drafters.registry import resolve

    assert resolve("DSPARK") == "dspark" == resolve("dspark")
    target = specdec.load_target(model_dirs["llama"], backend="native")
    dflash_dir = random_dflash(target, tmp_path / "dflash")
    with pytest.raises(DrafterMismatchError, match="DFlash drafter, not a DSpark"):
        DSpark(dflash_dir)
    with pytest.raises(DrafterMismatchError, match="DSpark drafter, not a DFlash"):
        DFlash(dspark_dirs["llama"])  # it would run without its Markov head
    with pytest.raises(InvalidArgumentError, match="block size must be in 1..4"):
        DSpark(dspark_dirs["llama"], block_size=9)
    with pytest.raises(InvalidArgumentError, match="chains"):
        specdec.generate(target, [[5, 6, 7]], drafter=DFlash(dflash_dir), max_new_tokens=4,
                         tree=specdec.TreeConfig(2, 2, 4))
    with pytest.raises(InvalidArgumentError, match="at most as deep as its block"):
        specdec.generate(target, [[5, 6, 7]], drafter=DSpark(dspark_dirs["llama"]), max_new_tokens=4,
                         tree=specdec.TreeConfig(BLOCK + 1, 2, 8))
    truncated = shutil.copytree(dspark_dirs["llama"], tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        DSpark(truncated)
    broken = shutil.copytree(dspark_dirs["llama"], tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config["dflash_config"]["markov_head_type"] = "rnn"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="markov_head_type 'rnn'"):
        DSpark(broken)
    for folder, extra in ((truncated, []), (broken, []), (dflash_dir, []), (tmp_path / "missing", []),
                          (dspark_dirs["llama"], ["--block-size", "40"])):
        code = main(["generate", "--target", str(model_dirs["llama"]), "--drafter", "dspark", "--draft", str(folder),
                     "--prompt", "x = 1", "--max-new-tokens", "4", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("specdec: error:"), err
    code = main(["generate", "--target", str(model_dirs["llama"]), "--speculative-algorithm", "DSPARK",
                 "--draft", str(dspark_dirs["llama"]), "--prompt", "x = 1", "--max-new-tokens", "12", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["stats"]["drafter"] == "dspark" and len(result["outputs"][0]["token_ids"]) == 12
    assert result["stats"]["mean_k"] > 2  # the block's drafts


def test_calibration_metrics_on_known_cases():
    prob = torch.tensor([0.9, 0.8, 0.3, 0.2])
    label = torch.tensor([True, True, False, False])
    assert training.auroc(prob, label) == 1.0
    assert training.auroc(prob, ~label) == 0.0
    assert training.auroc(torch.tensor([0.5, 0.5]), torch.tensor([True, False])) == 0.5  # a tie counts half
    assert training.auroc(prob, torch.ones(4, dtype=torch.bool)) is None
    assert training.expected_calibration_error(torch.tensor([0.75] * 4), torch.tensor([1, 1, 1, 0]).bool()) == 0.0
    assert training.expected_calibration_error(torch.tensor([1.0, 1.0]), torch.tensor([False, False])) == 1.0
    # survival labels: accepted counts 0, 2, 3 of 3 drafts
    labels = training.survival_labels(torch.tensor([0, 2, 3]), 3)
    assert labels.tolist() == [[False, False, False], [True, True, False], [True, True, True]]
    # over-confident logits: the fitted temperatures lower the survival's ECE
    torch.manual_seed(0)
    true_logit = torch.randn(4000, 3)
    labels = torch.rand(4000, 3) < torch.sigmoid(true_logit)
    labels = labels.long().cumprod(-1).bool()
    real = torch.ones(4000, 3, dtype=torch.bool)
    logits = true_logit * 4
    temps = training.fit_temperatures(logits, labels, real, training.DSparkTrainConfig().temperature_grid)
    before = training.survival_metrics(training.cumulative_survival(logits, [1.0] * 3), labels, real)
    after = training.survival_metrics(training.cumulative_survival(logits, temps), labels, real)
    assert after["ece"] < before["ece"] and temps[0] > 2
    assert after["auroc"] == pytest.approx(before["auroc"], abs=0.02)


def test_training_lowers_the_loss_calibrates_and_decodes_exactly(tmp_path):
    from specdec.commands.train import main
    from specdec.train import loop
    from specdec.zoo import zoo_path

    out = tmp_path / "out"
    assert main(["train", "dspark", "--target", str(zoo_path("target")), "--preset", "tiny", "--out", str(out)]) == 0
    history = torch.load(loop.list_checkpoints(out / "checkpoints")[-1], weights_only=False)["history"]
    losses = [r["loss"] for r in history]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["kind"] == "dspark" and "b4_tau" in summary["offline"] and "tau_k4" in summary["offline"]
    calibration = summary["calibration"]
    assert len(calibration["temperatures"]) == 4
    assert {"ece", "auroc", "brier", "per_slot"} <= set(calibration["before"]) == set(calibration["after"])
    assert isinstance(summary["low_acceptance_warning"], bool)
    drafter = DSpark(out)
    assert drafter.config.confidence_temperatures == tuple(calibration["temperatures"])
    assert drafter.config.training["offline"]["b4_tau"] == summary["offline"]["b4_tau"]
    target = specdec.load_target(zoo_path("target"))
    prompts = target.encode(["def f(x):\n    return", "import os\n"])
    plain = specdec.generate(target, prompts, max_new_tokens=12)
    assert specdec.generate(target, prompts, drafter=drafter, max_new_tokens=12).token_ids == plain.token_ids
    # the offline metric of the folder from the command line
    assert main(["train", "evaluate", "--drafter", str(out), "--target", str(zoo_path("target")),
                 "--heldout", "4", "--cache-dir", str(out / "checkpoints")]) == 0
    # continued from the folder (new data): at a learning rate of 0 every weight, the Markov and confidence
    # heads included, leaves as it came
    (tmp_path / "frozen.json").write_text(json.dumps({"optim": {"lr": 0.0, "steps": 2, "eval_every": 100}}))
    assert main(["train", "dspark", "--target", str(zoo_path("target")), "--preset", "tiny", "--out",
                 str(tmp_path / "again"), "--config", str(tmp_path / "frozen.json"), "--init-from", str(out)]) == 0
    before, after = (load_file(str(folder / "model.safetensors")) for folder in (out, tmp_path / "again"))
    assert set(before) == set(after) and any(name.startswith("markov_head.") for name in before)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert json.loads((tmp_path / "again" / "training_summary.json").read_text())["initialised_from"] == str(out)


def test_bench_measures_dspark_beside_dflash_greedy_and_sampled(model_dirs, dspark_dirs, tmp_path):
    from specdec.commands.bench import format_table, run_bench

    target = specdec.load_target(model_dirs["llama"], backend="native")
    target.eos_token_ids = ()
    prompts = target.encode(PROMPTS[:2])
    drafters = (("dflash", DFlash(random_dflash(target, tmp_path / "dflash"))), ("dspark", DSpark(dspark_dirs["llama"])))
    result = run_bench(target, prompts, ks=[2], max_new_tokens=10, progress=False, drafters=drafters,
                       block_sizes=(3, 4), with_transformers=False)
    ks = {(row["family"], row["k"]) for row in result["rows"] if row["family"] in ("dflash", "dspark")}
    assert ks == {("dflash", 2), ("dflash", 3), ("dspark", 3), ("dspark", 4)}  # DSpark's block of B drafts B
    assert result["outputs_identical"] is True
    assert "block drafting per step" in format_table(result)
    sampled = run_bench(target, prompts, ks=[2], max_new_tokens=10, progress=False, drafters=drafters,
                        sampling=SamplingConfig(0.7), policies=("conf-min:0.3",))
    assert sampled["outputs_identical"] is None and sampled["sampling"]["temperature"] == 0.7
    assert not any(row["impl"] == "transformers" for row in sampled["rows"])
    assert any(row["family"] == "dspark" and "conf-min:0.3" in row["method"] for row in sampled["rows"])
    assert all(row["tau"] >= 1 for row in sampled["rows"] if row["tau"] is not None)
    assert "sampled at temperature 0.7" in format_table(sampled)


def test_bench_serve_modes_find_the_drafters_committed_for_the_real_target():
    import argparse

    from specdec.serve.bench import parse_mode, resolve_mode

    args = argparse.Namespace(target="smollm2-135m", drafter="dspark", draft=None)
    for name in ("dflash", "dspark"):
        mode = resolve_mode(parse_mode(f"{name}@fixed"), args, False)
        assert mode.folder.endswith(f"smollm2-135m/{name}") and (json.loads(
            open(f"{mode.folder}/config.json").read())["specdec"]["method"] == name)
