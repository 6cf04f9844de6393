"""Medusa, EAGLE-1 and EAGLE-3: drafters that read the target's features.

Greedy output equals plain decoding token for token (chains, dynamic and static trees, several
architectures, both backends, float32 and bfloat16, batch 1 and ragged batches with rows stopping
at EOS and at the limit); sampling keeps the target's distribution; the kernel runtime computes
what the PyTorch network computes; folders, layouts and refusals.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import specdec
from specdec import TreeConfig
from specdec.decode import committed_features
from specdec.drafters import Eagle, Medusa
from specdec.drafters.base import DRAFT_VOCAB_FILE
from specdec.errors import DrafterMismatchError, ModelLoadError, TargetMismatchWarning
from specdec.models import eagle, medusa
from specdec.sampling import SamplingConfig
from specdec.commands.tiny import save_tiny

from test_exact_generation import assert_equal_to, bfloat16_with_eos, plain, sampled_pairs, sampling_case
from test_greedy_parity import MAX_NEW, PROMPTS, reference_with_stop
from test_sampling import P_VALUE, chi_square_p

ARCHS = ("llama", "qwen2", "qwen3")
TREE = TreeConfig(depth=3, topk=2, num_nodes=6)


def random_drafters(target, root, seed=0):
    """A random EAGLE-1, EAGLE-3 (reduced draft vocabulary) and Medusa folder for ``target``, and a Medusa
    whose heads end in the target's own LM head."""
    torch.manual_seed(seed)
    dirs = {}
    for version in (1, 3):
        config = eagle.EagleConfig.for_target(target, version, draft_vocab_size=target.vocab_size // 2)
        net = eagle.EagleNet(config)
        if version == 3:
            net.set_draft_vocab(torch.randperm(target.vocab_size)[: target.vocab_size // 2].sort().values)
        dirs[config.name] = eagle.save(net, root / config.name)
    # EAGLE-1 drafting from half the target's head (specdec train draft-vocab writes such a file)
    dirs["eagle-vocab"] = eagle.save(eagle.load_net(dirs["eagle"]), root / "eagle-vocab")
    half = torch.randperm(target.vocab_size)[: target.vocab_size // 2].sort().values
    (root / "eagle-vocab" / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": half.tolist()}))
    record = eagle.TargetRecord.of(target)
    heads = medusa.MedusaHeads(medusa.MedusaConfig(3, 1, int(target.config.hidden_size), target.vocab_size,
                                                   ((0,), (1,), (0, 0), (0, 1), (0, 0, 0)), record))
    heads.init_from_head(target.output_head().float())
    with torch.no_grad():
        for module in heads.heads:
            module[0].linear.weight.normal_(0, 0.3)
    dirs["medusa"] = medusa.save(heads, root / "medusa")
    shared = medusa.MedusaHeads(medusa.MedusaConfig(2, 1, int(target.config.hidden_size), target.vocab_size,
                                                    ((0,), (1,), (0, 0), (2,)), record, original_lm_head=True))
    with torch.no_grad():
        for module in shared.heads:
            module[0].linear.weight.normal_(0, 0.3)
    dirs["medusa-shared"] = medusa.save(shared, root / "medusa-shared")
    dirs["medusa-vocab"] = medusa.save(shared, root / "medusa-vocab")  # the same heads, half the target's head
    (root / "medusa-vocab" / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": half.tolist()}))
    return dirs


@pytest.fixture(scope="module")
def drafter_dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("feature-drafters")
    out = {}
    for arch in ARCHS:
        target = specdec.load_target(model_dirs[arch], backend="native")
        out[arch] = random_drafters(target, root / arch)
    return out


def all_drafters(dirs):
    return [Eagle(dirs["eagle"]), Eagle(dirs["eagle3"]), Eagle(dirs["eagle-vocab"]), Medusa(dirs["medusa"]),
            Medusa(dirs["medusa-shared"]), Medusa(dirs["medusa-vocab"])]


def settings_for(drafter, supports_trees=True):
    if isinstance(drafter, Medusa):
        return [{}]
    settings = [dict(num_draft_tokens=1), dict(num_draft_tokens=4)]
    return settings + ([dict(tree=TREE)] if supports_trees else [])


@pytest.mark.parametrize("arch", ARCHS)
def test_feature_drafters_match_transformers_greedy(arch, targets, hf_models, drafter_dirs, backend):
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    eos, reference = reference_with_stop(target, model, prompts)
    assert any(r and r[-1] == eos for r in reference) and any(len(r) == MAX_NEW for r in reference)
    runs = [(drafter, setting) for drafter in all_drafters(drafter_dirs[arch])
            if not (isinstance(drafter, Medusa) and not target.backend.supports_trees)
            for setting in settings_for(drafter, target.backend.supports_trees)]
    assert_equal_to(target, prompts, reference, runs, MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_feature_drafters_equal_plain_decoding_in_bfloat16(arch, model_dirs, drafter_dirs):
    target, prompts, reference = bfloat16_with_eos(model_dirs[arch])
    for drafter in all_drafters(drafter_dirs[arch]):
        for setting in settings_for(drafter):
            out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=40, **setting)
            assert out.stats.exact_numerics and out.token_ids == reference, f"{drafter.name} {setting}"


def test_p_min_cuts_each_rows_chain_and_keeps_the_output(model_dirs, drafter_dirs):
    """llama.cpp's --draft-p-min: a row stops before its first draft the drafter is less sure of than p_min
    (rows of one batch stop apart; a step where no row is sure drafts nothing), and greedy output stays
    plain decoding's, in a ragged batch and alone."""
    target, prompts, reference = bfloat16_with_eos(model_dirs["llama"])
    for name in ("eagle", "eagle3", "eagle-vocab"):
        full = specdec.generate(target, prompts, drafter=Eagle(drafter_dirs["llama"][name]), num_draft_tokens=4,
                                max_new_tokens=40).stats
        counts = []
        for p_min in (0.02, 0.1, 0.3, 0.9):
            drafter = Eagle(drafter_dirs["llama"][name], p_min=p_min)
            assert_equal_to(target, prompts, reference, [(drafter, dict(num_draft_tokens=4))], 40)
            stats = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=40).stats
            counts.append(stats.drafts_proposed / stats.target_forwards)
        assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0], (name, counts)
        assert any(0 < c < full.drafts_proposed / full.target_forwards for c in counts), (name, counts)


def test_p_min_is_a_probability_or_the_folders_recorded_one(drafter_dirs, model_dirs, tmp_path):
    """p_min in (0, 1); 0: no cut; None: what the folder records beside its fastest k (bench --record), which
    the next --record keeps when its fastest row ran with it."""
    import shutil

    from specdec.commands.bench import record_fastest
    from specdec.drafters import DraftModel
    from specdec.errors import InvalidArgumentError

    for bad in (1.0, -0.5, 2.0):
        with pytest.raises(InvalidArgumentError, match="p_min must be in"):
            Eagle(drafter_dirs["llama"]["eagle"], p_min=bad)
        with pytest.raises(InvalidArgumentError, match="p_min must be in"):
            DraftModel(model_dirs["llama-draft"], p_min=bad)
    folder = tmp_path / "eagle"
    shutil.copytree(drafter_dirs["llama"]["eagle"], folder)
    assert Eagle(folder).p_min is None and Eagle(folder, p_min=0.25).setting == "p>=0.25"
    row = {"impl": "specdec", "family": "eagle", "batch_size": 1, "method": "specdec eagle k=4 p>=0.3", "k": 4,
           "tree": None, "tau": 1.5, "speedup_vs_plain": 1.05, "p_min": 0.3}
    record_fastest({"rows": [row, {**row, "k": 2, "p_min": None, "speedup_vs_plain": 1.0}]}, "eagle", str(folder), "test")
    assert Eagle(folder).p_min == 0.3 and Eagle(folder).default_draft_tokens == 4
    assert Eagle(folder, p_min=0).p_min is None and Eagle(folder, p_min=0.5).p_min == 0.5
    record_fastest({"rows": [{**row, "p_min": None}]}, "eagle", str(folder), "test")  # fastest without a cut
    assert Eagle(folder).p_min is None


@pytest.mark.filterwarnings("error::specdec.errors.TargetMismatchWarning")
def test_trained_zoo_drafters_equal_plain_decoding():
    """Where drafts are mostly accepted: accepted paths, their features and the rollback all matter."""
    from specdec.zoo import ZooError, zoo_path
    from specdec.zoo.tasks import load_tasks

    try:
        dirs = {name: zoo_path(name) for name in ("medusa", "eagle", "eagle3")}
    except ZooError:
        pytest.skip("the zoo has no trained feature drafters")
    for dtype in (torch.float32, torch.bfloat16):
        target = specdec.load_target(zoo_path("target"), dtype=dtype, backend="native")
        prompts = target.encode(load_tasks("code-completion")[:4])
        reference = plain(target, prompts, 48)
        for drafter in (Eagle(dirs["eagle"]), Eagle(dirs["eagle3"]), Medusa(dirs["medusa"])):
            for setting in settings_for(drafter)[1:] or [{}]:
                out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=48, **setting)
                assert out.token_ids == reference, f"{drafter.name} {setting} {dtype}"
                assert out.stats.mean_accepted_length > 1.5, f"{drafter.name} should accept drafts here"
        for name in ("eagle", "eagle3"):  # chains cut by the drafter's confidence: the same output, fewer drafts,
            full, cut = (specdec.generate(target, prompts, drafter=Eagle(dirs[name], p_min=p_min), num_draft_tokens=6,
                                          max_new_tokens=48) for p_min in (None, 0.5))
            assert cut.token_ids == reference, f"{name} p_min {dtype}"
            proposed = cut.stats.drafts_proposed / cut.stats.target_forwards
            assert 0 < proposed < 6, (name, proposed, dtype)
            # and the drafts kept are the likelier ones: a trained drafter's confidence tells
            assert cut.stats.acceptance_rate > full.stats.acceptance_rate, (name, dtype)


@pytest.mark.parametrize("kind,temperature,top_k,top_p", [
    ("eagle3", 1.0, 6, None),
    ("eagle", 1.2, 5, 0.95),
    ("eagle-vocab", 1.2, 5, 0.95),
    ("eagle-pmin", 1.2, 5, 0.95),
    ("eagle3-tree", 1.0, 6, None),
    ("medusa", 1.0, 6, None),
    ("medusa-shared", 1.0, 6, None),
    ("medusa-vocab", 1.0, 6, None),
])
def test_sampling_keeps_the_targets_distribution(kind, temperature, top_k, top_p, model_dirs, drafter_dirs):
    config = SamplingConfig(temperature, top_k, top_p)
    target, prompt, exact = sampling_case(model_dirs["llama"], config)
    name = kind.removesuffix("-tree").removesuffix("-pmin")
    p_min = 0.22 if kind.endswith("-pmin") else None  # cuts about a third of these drafts (their top: 0.2-0.3)
    drafter = Medusa(drafter_dirs["llama"][name]) if name.startswith("medusa") else Eagle(drafter_dirs["llama"][name],
                                                                                          p_min=p_min)
    tree = TreeConfig(depth=2, topk=3, num_nodes=6) if kind.endswith("-tree") else None
    assert chi_square_p(sampled_pairs(target, prompt, drafter, config, tree), exact) > P_VALUE


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_runtime_computes_the_networks_rollout(version, dtype, model_dirs):
    """The drafter's cache at inference: committed pairs, then a drafting step fed its own output,
    equals the PyTorch rollout that training and the offline metric use."""
    target = specdec.load_target(model_dirs["llama"], backend="native")
    torch.manual_seed(1)
    net = eagle.EagleNet(eagle.EagleConfig.for_target(target, version)).eval()
    batch, length = 2, 9
    tokens = torch.randint(0, target.vocab_size, (batch, length + 2))
    features = torch.randn(batch, length, net.config.feature_size)
    embed, head = target.input_embeddings().float(), target.output_head().float()
    embeds = [torch.nn.functional.embedding(tokens[:, 1 + i: 1 + i + length], embed) for i in range(2)]
    with torch.no_grad():
        step0, step1 = net.rollout(embeds, features, 2)
    runtime = eagle.EagleRuntime(net, embed, head if version == 1 else None, dtype)
    cache = runtime.new_cache(batch, 64)
    out = cache.run(tokens[:, 1:1 + length], features)
    tolerance = 2e-5 if dtype == torch.float32 else 0.1
    assert (out.float() - step0).abs().max() < tolerance * max(1.0, float(step0.abs().max()))
    # one drafting step from the last anchor: token x_{t+2} with the drafter's own output at t
    t = length - 2
    cache.truncate(torch.full((batch,), t + 1))
    nxt = cache.run(tokens[:, t + 2: t + 3], out[:, t: t + 1], fused=False)
    assert (nxt[:, 0].float() - step1[:, t]).abs().max() < tolerance * max(1.0, float(step1.abs().max()))
    logits = runtime.logits(out).float()
    assert (logits - net.logits(step0, head)).abs().max() < 10 * tolerance * max(1.0, float(logits.abs().max()))


def test_committed_features_are_the_accepted_path_right_aligned():
    hidden = torch.arange(2 * 5, dtype=torch.float32).view(2, 5, 1, 1)  # value = 5 * row + column
    chain = committed_features(hidden, None, torch.tensor([3, 1]))
    assert chain.valid.tolist() == [[True, True, True], [False, False, True]]
    assert chain.states[0, :, 0, 0].tolist() == [0, 1, 2] and chain.states[1, -1, 0, 0] == 5
    keep = torch.tensor([[True, False, True, False, True], [True, True, False, False, False]])
    tree = committed_features(hidden, keep, torch.tensor([3, 2]))
    assert tree.states[0, :, 0, 0].tolist() == [0, 2, 4]
    assert tree.valid[1].tolist() == [False, True, True] and tree.states[1, 1:, 0, 0].tolist() == [5, 6]


def test_layouts_serving_engines_load(drafter_dirs):
    dirs = drafter_dirs["llama"]
    config = json.loads((dirs["eagle3"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] < config["vocab_size"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        i - 1 for i in config["specdec"]["hidden_states_read"]]
    from safetensors.torch import load_file

    weights = load_file(dirs["eagle3"] / "model.safetensors")
    h, heads, kv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    layers = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    expected = {"fc.weight": (h, layers * h), "norm.weight": (h,), "lm_head.weight": (config["draft_vocab_size"], h),
                "d2t": (config["draft_vocab_size"],), "t2d": (config["vocab_size"],),
                "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
                "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": (h, heads * d),
                "midlayer.mlp.gate_proj.weight": (config["intermediate_size"], h),
                "midlayer.mlp.up_proj.weight": (config["intermediate_size"], h),
                "midlayer.mlp.down_proj.weight": (h, config["intermediate_size"]),
                "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
                "midlayer.post_attention_layernorm.weight": (h,)}
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    assert weights["t2d"].dtype == torch.bool and weights["d2t"].dtype == torch.int64
    ids = torch.arange(config["draft_vocab_size"]) + weights["d2t"]  # offsets: target = draft + d2t[draft]
    assert weights["t2d"][ids].all() and int(weights["t2d"].sum()) == config["draft_vocab_size"]

    config1 = json.loads((dirs["eagle"] / "config.json").read_text())
    assert config1["architectures"] == ["LlamaForCausalLMEagle"]
    names1 = set(load_file(dirs["eagle"] / "model.safetensors"))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.post_attention_layernorm.weight",
            "layers.0.mlp.down_proj.weight"} <= names1
    assert not any("input_layernorm" in n or "lm_head" in n or "embed" in n for n in names1)

    mconfig = json.loads((dirs["medusa"] / "config.json").read_text())
    assert mconfig["medusa_num_heads"] == 3 and mconfig["medusa_num_layers"] == 1
    assert mconfig["medusa_choices"][0] == [0]
    mweights = load_file(dirs["medusa"] / "medusa_lm_head.safetensors")
    assert set(mweights) == {f"{i}.{n}" for i in range(3) for n in ("0.linear.weight", "0.linear.bias", "1.weight")}
    assert tuple(mweights["0.1.weight"].shape) == (mconfig["vocab_size"], mconfig["hidden_size"])
    assert mconfig["original_lm_head"] is False
    shared = json.loads((dirs["medusa-shared"] / "config.json").read_text())
    assert shared["original_lm_head"] is True and shared["medusa_num_heads"] == 2
    names = set(load_file(dirs["medusa-shared"] / "medusa_lm_head.safetensors"))
    assert names == {f"{i}.0.linear.{n}" for i in range(2) for n in ("weight", "bias")}  # the head is the target's
    for name in ("eagle", "eagle3", "medusa"):
        record = json.loads((dirs[name] / "config.json").read_text())["specdec"]["target"]
        assert record["num_hidden_layers"] == 2 and len(record["fingerprint"]) == 16


def test_wrong_method_and_wrong_target_are_refused(drafter_dirs, model_dirs, tmp_path, tokenizer):
    dirs = drafter_dirs["llama"]
    with pytest.raises(DrafterMismatchError, match="EAGLE-1 drafter, not EAGLE-3"):
        Eagle(dirs["eagle"], version=3)
    with pytest.raises(DrafterMismatchError, match="EAGLE-3 drafter, not EAGLE-1"):
        Eagle(dirs["eagle3"], version=1)
    with pytest.raises(DrafterMismatchError, match="Medusa drafter, not an EAGLE"):
        Eagle(dirs["medusa"])
    with pytest.raises(DrafterMismatchError, match="EAGLE-3 drafter, not a Medusa"):
        Medusa(dirs["eagle3"])
    # shapes that do not fit: a target of another hidden size, or of fewer layers
    other = specdec.load_target(save_tiny(tmp_path / "wide", "llama", tokenizer, hidden=96), backend="native")
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        specdec.generate(other, [[5, 6, 7]], drafter=Eagle(dirs["eagle3"]), max_new_tokens=4)
    shallow = specdec.load_target(model_dirs["llama-draft"], backend="native")
    for drafter in all_drafters(dirs):
        with pytest.raises(DrafterMismatchError):
            specdec.generate(shallow, [[5, 6, 7]], drafter=drafter, max_new_tokens=4)
    # the same shapes, other weights: runs, with one warning
    twin = specdec.load_target(save_tiny(tmp_path / "twin", "llama", tokenizer, seed=5, init_std=0.15),
                               backend="native")
    drafter = Eagle(dirs["eagle3"])
    with pytest.warns(TargetMismatchWarning, match="another target of the same shapes"):
        specdec.generate(twin, [[5, 6, 7]], drafter=drafter, max_new_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specdec.generate(twin, [[5, 6, 7]], drafter=drafter, max_new_tokens=4)  # said once


def test_bad_drafter_folders_are_one_line_errors(drafter_dirs, tmp_path, capsys, model_dirs):
    import shutil

    from specdec.commands.cli import main

    with pytest.raises(ModelLoadError, match="does not exist"):
        Eagle(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        Medusa(tmp_path / "empty")
    broken = tmp_path / "broken"
    shutil.copytree(drafter_dirs["llama"]["eagle3"], broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="malformed"):
        Eagle(broken)
    truncated = tmp_path / "truncated"
    shutil.copytree(drafter_dirs["llama"]["eagle3"], truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        Eagle(truncated)
    for folder, name in ((truncated, "eagle3"), (drafter_dirs["llama"]["eagle"], "EAGLE3"),
                         (drafter_dirs["llama"]["medusa"], "eagle")):
        code = main(["generate", "--target", str(model_dirs["llama"]), "--drafter", name, "--draft", str(folder),
                     "--prompt", "x = 1", "--max-new-tokens", "4"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("specdec: error:"), err


def test_registry_names_and_cli(model_dirs, drafter_dirs, capsys):
    from specdec.commands.cli import main
    from specdec.drafters.registry import REGISTRY, resolve

    assert resolve("EAGLE3") == "eagle3" and resolve("EAGLE") == "eagle" and resolve("MEDUSA") == "medusa"
    assert resolve("STANDALONE") == "draft-model" and resolve("ngram") == "prompt-lookup"
    assert {"medusa", "eagle", "eagle3"} <= set(REGISTRY)
    code = main(["generate", "--target", str(model_dirs["llama"]), "--speculative-algorithm", "EAGLE3",
                 "--draft", str(drafter_dirs["llama"]["eagle3"]), "--prompt", "x = 1", "--max-new-tokens", "6",
                 "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["stats"]["drafter"] == "eagle3" and len(result["outputs"][0]["token_ids"]) == 6
    code = main(["generate", "--target", str(model_dirs["llama"]), "--drafter", "eagle3", "--prompt", "x"])
    assert code == 2 and "needs --draft" in capsys.readouterr().err


def test_eagle3_with_one_fused_layer_still_projects_the_targets_features(model_dirs):
    """A one-layer target gives EAGLE-3 features as wide as its own outputs: fc must still apply to them."""
    target = specdec.load_target(model_dirs["llama-draft"], backend="native")
    torch.manual_seed(2)
    net = eagle.EagleNet(eagle.EagleConfig.for_target(target, 3)).eval()
    assert net.config.feature_size == net.config.hidden_size
    tokens = torch.randint(0, target.vocab_size, (1, 8))
    features = torch.randn(1, 7, net.config.feature_size)
    embed = target.input_embeddings().float()
    with torch.no_grad():
        (reference,) = net.rollout([torch.nn.functional.embedding(tokens[:, 1:], embed)], features, 1)
    out = eagle.EagleRuntime(net, embed, None, torch.float32).new_cache(1, 32).run(tokens[:, 1:], features)
    assert (out - reference).abs().max() < 2e-5 * max(1.0, float(reference.abs().max()))
    prompts = target.encode(PROMPTS[:2])
    drafter_dir = eagle.save(net, model_dirs["llama-draft"].parent / "one-layer-eagle3")
    assert specdec.generate(target, prompts, drafter=Eagle(drafter_dir), max_new_tokens=12).token_ids == \
        plain(target, prompts, 12)


def test_head_readers_draft_from_their_draft_vocabulary_only(drafter_dirs, model_dirs, tmp_path):
    """An EAGLE-1 folder with draft_vocab.json computes only those rows of the target's head, drafts only
    those tokens (checked above: still exact, and so are Medusa heads ending in the target's head), ignores
    the file when asked, and refuses a damaged one."""
    import shutil
    import types

    from specdec.decode import GenerationConfig
    from specdec.engine import generate_ids

    target = specdec.load_target(model_dirs["llama"], backend="native")
    folder = drafter_dirs["llama"]["eagle-vocab"]
    ids = torch.tensor(json.loads((folder / DRAFT_VOCAB_FILE).read_text())["ids"])
    drafter = Eagle(folder)
    runtime = drafter.runtime(target)
    assert torch.equal(runtime.draft_ids, ids) and runtime.logits(torch.zeros(1, int(target.config.hidden_size))).shape[-1] == len(ids)
    assert Eagle(folder, draft_vocab=False).runtime(target).draft_ids is None

    proposed = []

    class Spy:
        name, features = drafter.name, drafter.features

        def start(self, context, seqs):
            session = drafter.start(context, seqs)
            propose = session.propose
            session.propose = lambda s, k: proposed.append(propose(s, k)) or proposed[-1]
            return session

    generate_ids(target, target.encode(PROMPTS[:2]), Spy(), GenerationConfig(num_draft_tokens=3, max_new_tokens=12))
    drafted = torch.cat([p.tokens.flatten() for p in proposed])
    assert drafted.numel() and bool(torch.isin(drafted, ids).all())

    heads = Medusa(drafter_dirs["llama"]["medusa-vocab"])
    heads.start(types.SimpleNamespace(target=target, tree=None), None)
    assert torch.equal(heads._runtime[1].draft_ids, ids)

    damaged = shutil.copytree(folder, tmp_path / "damaged")
    for text in ("{\"ids\": [3, 2]}", "{\"ids\": [1, 100000]}", "not json"):
        (damaged / DRAFT_VOCAB_FILE).write_text(text)
        with pytest.raises(DrafterMismatchError, match="draft"):
            Eagle(damaged)


def test_steps_that_do_not_draft_defer_the_drafters_run_and_change_no_draft(model_dirs, drafter_dirs, tokenizer,
                                                                         tmp_path, monkeypatch):
    """EAGLE's layer and MTP's modules run over the committed tokens only when the next step drafts: a
    policy that drafts every third step, in a batch of two where rows leave and join (continuous
    batching), proposes exactly the drafts a session that enters every step's features at once
    proposes (chains and an EAGLE-2 tree, float32 and bfloat16), and the output stays plain decoding's."""
    from specdec.commands.tiny import save_tiny_mtp
    from specdec.drafters import MTP
    from specdec.drafters import base, mtp as mtp_drafter
    from specdec.drafters.eagle import EagleSession
    from specdec.engine import Engine, Request
    from specdec.schedule import FixedK

    class EveryThird(FixedK):
        def __init__(self):
            self.steps = 0

        def draft_tokens(self, engine, group):
            self.steps += 1
            return engine.config.num_draft_tokens if self.steps % 3 == 0 else 0

    proposals = []
    for cls in (EagleSession, mtp_drafter.NativeSequential):
        original = cls.propose

        def propose(self, seqs, k, original=original):
            proposal = original(self, seqs, k)
            proposals.append((proposal.tokens.tolist(), proposal.lengths.tolist(), seqs.lengths.tolist()))
            return proposal
        monkeypatch.setattr(cls, "propose", propose)
    deferred = base.DeferredObserve.observe

    def eager(self, seqs, features):  # every step's features entered at once, as before the deferral
        deferred(self, seqs, features)
        self.enter()

    mtp_folder = save_tiny_mtp(tmp_path / "mtp", "llama", "sequential", 2, tokenizer, init_std=0.15)
    cases = [(model_dirs["llama"], Eagle(drafter_dirs["llama"][name]), tree) for name in ("eagle", "eagle3")
             for tree in (None, TREE)] + [(mtp_folder, MTP(), None)]
    budgets = (20, 9, 14, 5, 17)
    for folder, drafter, tree in cases:
        for dtype in (torch.float32, torch.bfloat16):
            target = specdec.load_target(folder, dtype=dtype, backend="native")
            prompts = target.encode(PROMPTS[:5])
            reference = [plain(target, [p], n)[0] for p, n in zip(prompts, budgets)]
            runs = []
            for mode in ("deferred", "eager"):
                if mode == "eager":
                    monkeypatch.setattr(base.DeferredObserve, "observe", eager)
                proposals.clear()
                engine = Engine(target, drafter, num_draft_tokens=3, tree=tree, max_batch_size=2, policy=EveryThird(),
                                stream=False)
                states = engine.run([Request(p, n) for p, n in zip(prompts, budgets)])
                assert [s.tokens for s in states] == reference, (mode, drafter.name, tree, dtype)
                runs.append(list(proposals))
                monkeypatch.setattr(base.DeferredObserve, "observe", deferred)
            assert runs[0] and runs[0] == runs[1], (drafter.name, tree, dtype)


def test_a_named_method_takes_the_drafter_trained_for_its_target(model_dirs, capsys):
    """Without --draft, generate, serve, bench and bench-serve take the zoo's drafter trained for the
    target they run (a real model by its name, its Q4_1 file, the zoo's own target), and none trained for
    another model: any other target is one line asking for --draft (nothing fetched or built here)."""
    from specdec.commands.cli import main
    from specdec.drafters.registry import default_folder
    from specdec.zoo import data_dir

    real = data_dir() / "smollm2-135m"
    for target in ("smollm2-135m", "smollm2-135m-q4_1"):
        assert default_folder("EAGLE3", target) == str(real / "eagle3")
        assert default_folder("dspark", target) == str(real / "dspark")
        assert default_folder("draft-model", target) == str(real / "draft")
        assert default_folder("mtp", target) == str(real / "mtp")  # modules trained beside its frozen trunk
        assert default_folder("prompt-lookup", target) is None and default_folder("early-exit", target) is None
    zoo_target = data_dir() / "target"
    assert default_folder("eagle3", zoo_target) == str(data_dir() / "eagle3")
    assert default_folder("eagle3", str(zoo_target) + "/") == str(data_dir() / "eagle3")
    assert default_folder("dspark", zoo_target) is None and default_folder("mtp", zoo_target) is None
    for method in ("eagle3", "medusa", "draft-model", "mtp"):
        assert default_folder(method, model_dirs["llama"]) is None
    code = main(["generate", "--target", str(model_dirs["llama"]), "--drafter", "medusa", "--prompt", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs --draft DIR: the zoo holds no medusa trained for" in err[0]


def test_drafter_classes_take_a_real_models_drafter_by_name():
    """Eagle("smollm2-135m/eagle3") and its siblings load the committed folder, as load_target("smollm2-135m")
    loads the model by name (nothing fetched: the folders are in the package)."""
    from specdec.drafters import DFlash, DSpark, Eagle, Medusa, MTP
    from specdec.zoo import ZooError, data_dir

    real = data_dir() / "smollm2-135m"
    assert Eagle("smollm2-135m/eagle3").path == str(real / "eagle3")
    assert Eagle("smollm2-135m-q4_1/eagle").path == str(real / "eagle")
    assert DFlash("smollm2-135m/dflash").path == str(real / "dflash")
    assert DSpark("smollm2-135m/dspark").path == str(real / "dspark")
    assert Medusa("smollm2-135m/medusa").path == str(real / "medusa")
    assert MTP(modules="smollm2-135m/mtp").modules == str(real / "mtp")
    with pytest.raises(ZooError, match="no drafter 'nothing' is trained for smollm2-135m; trained: dflash"):
        Eagle("smollm2-135m/nothing")
