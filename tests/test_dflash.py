"""DFlash: a block of drafts in one pass over the target's fused features.

Greedy output equals plain decoding token for token (Llama, Qwen2, Qwen3 targets; both backends;
float32 and bfloat16 on native; batch 1 and ragged batches with rows stopping at EOS and at the
limit; the drafter's own block and smaller ones); sampling keeps the target's distribution; the
kernel runtime computes what the training pass computes; the block-sparse training attention
equals attention under the dense mask; folders, layouts, transformers' assistant, refusals.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import specdec
from specdec.drafters import DFlash, Eagle
from specdec.errors import DrafterMismatchError, InvalidArgumentError, ModelLoadError
from specdec.models import dflash
from specdec.sampling import SamplingConfig
from specdec.train.dflash import mask_token_for
from specdec.commands.tiny import save_tiny

from test_exact_generation import bfloat16_with_eos, plain, sampled_pairs, sampling_case
from test_greedy_parity import MAX_NEW, PROMPTS, reference_with_stop
from test_sampling import P_VALUE, chi_square_p

ARCHS = ("llama", "qwen2", "qwen3")
BLOCK = 5


def random_dflash(target, folder, layers=2, block_size=BLOCK, seed=0, scale=0.3):
    """A random DFlash folder for ``target``, its weights spread enough to give varied drafts."""
    torch.manual_seed(seed)
    config = dflash.DFlashConfig.for_target(target, layers, block_size, mask_token_for(target), num_target_features=2)
    net = dflash.DFlashNet(config)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                p.normal_(0, scale / p.shape[1] ** 0.5 * 3)
    return dflash.save(net, folder)


@pytest.fixture(scope="module")
def dflash_dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    return {arch: random_dflash(specdec.load_target(model_dirs[arch], backend="native"), root / arch)
            for arch in ARCHS}


SETTINGS = [dict(), dict(num_draft_tokens=1), dict(num_draft_tokens=2), dict(block_size=3)]


def drafter_for(folder, setting):
    setting = dict(setting)
    return DFlash(folder, block_size=setting.pop("block_size", None)), setting


@pytest.mark.parametrize("arch", ARCHS)
def test_dflash_matches_transformers_greedy(arch, targets, hf_models, dflash_dirs, backend):
    target, model = targets[arch], hf_models[arch]
    prompts = target.encode(PROMPTS)
    eos, reference = reference_with_stop(target, model, prompts)
    assert any(r and r[-1] == eos for r in reference) and any(len(r) == MAX_NEW for r in reference)
    for setting in SETTINGS:
        drafter, options = drafter_for(dflash_dirs[arch], setting)
        out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW, **options)
        assert out.token_ids == reference, f"{setting} batch"
        alone = specdec.generate(target, [prompts[2]], drafter=drafter, max_new_tokens=MAX_NEW, **options)
        assert alone.token_ids == [reference[2]], f"{setting} alone"
    out = specdec.generate(target, prompts, drafter=DFlash(dflash_dirs[arch]), max_new_tokens=MAX_NEW)
    assert out.stats.mean_k == pytest.approx(BLOCK - 1, abs=1.5)  # the drafter's own block by default


@pytest.mark.parametrize("arch", ARCHS)
def test_dflash_equals_plain_decoding_in_bfloat16(arch, model_dirs, dflash_dirs):
    target, prompts, reference = bfloat16_with_eos(model_dirs[arch])
    for setting in SETTINGS:
        drafter, options = drafter_for(dflash_dirs[arch], setting)
        out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=40, **options)
        assert out.stats.exact_numerics and out.token_ids == reference, f"{setting}"


@pytest.mark.filterwarnings("error::specdec.errors.TargetMismatchWarning")
def test_trained_zoo_dflash_equals_plain_decoding():
    """Where drafts are mostly accepted: the accepted tokens' context and the block rollback matter."""
    from specdec.zoo import ZooError, zoo_path
    from specdec.zoo.tasks import load_tasks

    try:
        folder = zoo_path("dflash")
    except ZooError:
        pytest.skip("the zoo has no trained DFlash drafter")
    for dtype in (torch.float32, torch.bfloat16):
        target = specdec.load_target(zoo_path("target"), dtype=dtype, backend="native")
        prompts = target.encode(load_tasks("code-completion")[:4])
        reference = plain(target, prompts, 48)
        for block in (None, 4):
            out = specdec.generate(target, prompts, drafter=DFlash(folder, block_size=block), max_new_tokens=48)
            assert out.token_ids == reference, f"block {block} {dtype}"
            assert out.stats.mean_accepted_length > 1.5, "the trained drafter should accept drafts here"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 6, None), (1.2, 5, 0.95)])
def test_sampling_keeps_the_targets_distribution(temperature, top_k, top_p, model_dirs, dflash_dirs):
    config = SamplingConfig(temperature, top_k, top_p)
    target, prompt, exact = sampling_case(model_dirs["llama"], config)
    assert chi_square_p(sampled_pairs(target, prompt, DFlash(dflash_dirs["llama"]), config), exact) > P_VALUE


def test_sampling_with_the_trained_zoo_drafter_keeps_the_targets_distribution():
    """Drafts that are often accepted: the rejection rule's every branch is exercised."""
    from specdec.zoo import ZooError, zoo_path

    try:
        folder = zoo_path("dflash")
    except ZooError:
        pytest.skip("the zoo has no trained DFlash drafter")
    config = SamplingConfig(1.0, 6, None)
    target, prompt, exact = sampling_case(zoo_path("target"), config, "def add(a, b):\n    return a +")
    samples = sampled_pairs(target, prompt, DFlash(folder), config)
    assert chi_square_p(samples, exact) > P_VALUE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_runtime_computes_the_training_pass(dtype, model_dirs):
    """Context entered step by step into the drafter's cache, then a block: the same outputs as the
    one-pass training forward with the block-sparse mask (ragged rows included)."""
    target = specdec.load_target(model_dirs["qwen3"], backend="native")
    torch.manual_seed(3)
    net = dflash.DFlashNet(dflash.DFlashConfig.for_target(target, 2, 6, 1, num_target_features=2)).eval()
    batch, length = 2, 14
    tokens = torch.randint(0, target.vocab_size, (batch, length))
    features = torch.randn(batch, length, net.config.feature_size)
    embed, head = target.input_embeddings().float(), target.output_head().float()
    anchors = torch.tensor([[4, 9], [6, 11]])
    with torch.no_grad():
        reference = net.blocks(features, F.embedding(dflash.block_inputs(tokens, anchors, 6, 1), embed), anchors)
    runtime = dflash.DFlashRuntime(net, embed, head, dtype)
    cache = runtime.new_cache(batch, 8)  # grows on the way
    tolerance = 3e-5 if dtype == torch.float32 else 0.1
    entered = torch.zeros(batch, dtype=torch.long)
    for n in range(2):
        # rows enter different amounts of context: right-aligned, the shorter row padded on the left
        width = int((anchors[:, n] - entered).max())
        index = anchors[:, n:n + 1] - width + torch.arange(width)
        valid = index >= entered[:, None]
        feats = features.gather(1, index.clamp(min=0)[:, :, None].expand(-1, -1, features.shape[2]))
        out = cache.draft(feats, valid, tokens.gather(1, anchors[:, n:n + 1])[:, 0], 6)
        entered = anchors[:, n].clone()
        assert cache.lengths.tolist() == entered.tolist()
        got = net.norm(out.float())
        assert (got - reference[:, n]).abs().max() < tolerance * max(1.0, float(reference.abs().max()))
    logits = runtime.logits(out).float()
    assert (logits - reference[:, 1] @ head.t()).abs().max() < 10 * tolerance * max(1.0, float(logits.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ragged_context_entered_apart_is_each_rows_own_and_zero_in_its_holes(dtype, model_dirs):
    """A backlog of rows that joined at different times, entered on its own: only its valid entries are
    computed (one packed block), yet each row's keys and values are the bits that row gets entered alone,
    and its holes hold zeros (finite, which attention needs)."""
    target = specdec.load_target(model_dirs["qwen3"], backend="native")
    torch.manual_seed(5)
    net = dflash.DFlashNet(dflash.DFlashConfig.for_target(target, 2, 4, 1, num_target_features=2)).eval()
    runtime = dflash.DFlashRuntime(net, target.input_embeddings().float(), target.output_head().float(), dtype)
    m = 24  # >= ContextCache.APART
    features = torch.randn(3, m, net.config.feature_size)
    valid = torch.zeros(3, m, dtype=torch.bool)
    valid[0, 20:] = True  # a row that waited 4 steps
    valid[1, :] = True    # a long prompt
    valid[2, 3:9] = valid[2, 15:] = True  # a prompt that joined, then steps
    ragged = runtime.new_cache(3, 4)  # grows on the way
    ragged.enter_context(features, valid)
    assert ragged.columns == m and ragged.lengths.tolist() == valid.sum(1).tolist()
    for row in range(3):
        alone = runtime.new_cache(1, m)
        alone.enter_context(features[row:row + 1, valid[row]], valid[row:row + 1, valid[row]])
        mine = ragged.kv[:, :, row, :, :m][:, :, :, valid[row]]
        assert mine.abs().sum() > 0 and torch.equal(mine, alone.kv[:, :, 0, :, :int(valid[row].sum())])
        assert torch.equal(ragged.positions[row, valid[row]], torch.arange(int(valid[row].sum())))
        holes = ragged.kv[:, :, row, :, :m][:, :, :, ~valid[row]]
        assert not holes.numel() or not holes.abs().sum()


def test_block_sparse_attention_equals_the_dense_mask():
    torch.manual_seed(0)
    b, h, n, size, t, d = 2, 3, 4, 3, 7, 8
    q, bk, bv = (torch.randn(b, h, n, size, d) for _ in range(3))
    ck, cv = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    anchors = torch.tensor([[0, 2, 3, 6], [1, 1, 4, 7]])
    seen = torch.arange(t)[None, None, :] < anchors[:, :, None]
    out = dflash.block_attention(q, ck, cv, bk, bv, seen)
    mask = dflash.dense_block_mask(seen, size)  # [b, N B, T + N B]
    keys = torch.cat([ck, bk.reshape(b, h, n * size, d)], dim=2)
    values = torch.cat([cv, bv.reshape(b, h, n * size, d)], dim=2)
    dense = F.scaled_dot_product_attention(q.reshape(b, h, n * size, d), keys, values, attn_mask=mask[:, None])
    assert torch.allclose(out.reshape(b, h, n * size, d), dense, atol=1e-5)
    # the mask: a block sees the context strictly before its anchor and its own block, no other block
    assert mask[0, 3].tolist() == [True, True] + [False] * 5 + [False] * 3 + [True] * 3 + [False] * 6
    assert not mask[0, :3, :t].any()  # anchored at position 0: no context at all


def test_layout_serving_engines_load(dflash_dirs):
    from safetensors.torch import load_file

    folder = dflash_dirs["qwen3"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["model_type"] == "qwen3" and config["num_target_layers"] == 2
    ids = config["dflash_config"]["target_layer_ids"]
    assert config["specdec"]["hidden_states_read"] == [i + 1 for i in ids]
    assert 0 <= config["dflash_config"]["mask_token_id"] < config["vocab_size"]
    weights = load_file(folder / "model.safetensors")
    h, heads, kv, d, inner = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                  "head_dim", "intermediate_size"))
    expected = {"fc.weight": (h, len(ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        at = f"layers.{i}."
        expected.update({at + "self_attn.q_proj.weight": (heads * d, h), at + "self_attn.k_proj.weight": (kv * d, h),
                         at + "self_attn.v_proj.weight": (kv * d, h), at + "self_attn.o_proj.weight": (h, heads * d),
                         at + "self_attn.q_norm.weight": (d,), at + "self_attn.k_norm.weight": (d,),
                         at + "mlp.gate_proj.weight": (inner, h), at + "mlp.up_proj.weight": (inner, h),
                         at + "mlp.down_proj.weight": (h, inner), at + "input_layernorm.weight": (h,),
                         at + "post_attention_layernorm.weight": (h,)})
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected  # no embedding, no LM head
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert len(config["specdec"]["target"]["fingerprint"]) == 16


def test_transformers_dflash_runs_the_same_weights(model_dirs, dflash_dirs, hf_models, tmp_path):
    """The exported assistant loads in transformers; its DFlash generate and specdec both give plain greedy."""
    from transformers import AutoModel

    model = hf_models["llama"]
    target = specdec.load_target(model_dirs["llama"], backend="native")
    net = dflash.load_net(dflash_dirs["llama"])
    from specdec.commands.cli import main

    exported = tmp_path / "hf"
    assert main(["train", "export", "--drafter", str(dflash_dirs["llama"]), "--target", str(model_dirs["llama"]),
                 "--out", str(exported)]) == 0
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "muse_glimmer_assistant"
    assert (config["block_size"], config["target_layer_ids"]) == (BLOCK, list(net.config.target_layer_ids))
    assistant = AutoModel.from_pretrained(exported, dtype=torch.float32)
    for prompt in target.encode(PROMPTS[:3]):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            reference = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
            theirs = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                    assistant_model=assistant, speculation_type="dflash")
        assert theirs.tolist() == reference.tolist()
        target.eos_token_ids = ()
        ours = specdec.generate(target, [prompt], drafter=DFlash(dflash_dirs["llama"]), max_new_tokens=20)
        assert ours.token_ids[0] == reference[0, len(prompt):].tolist()
    # the same network in memory, as bench uses it
    in_memory = dflash.hf_assistant(net, model.config)
    for name, value in assistant.state_dict().items():
        assert torch.equal(value, in_memory.state_dict()[name]), name


def test_wrong_method_wrong_target_and_bad_block_are_refused(dflash_dirs, model_dirs, tmp_path, tokenizer):
    folder = dflash_dirs["llama"]
    with pytest.raises(DrafterMismatchError, match="DFlash drafter, not an EAGLE"):
        Eagle(folder)
    eagle_dir = tmp_path / "eagle3"
    from specdec.models import eagle
    target = specdec.load_target(model_dirs["llama"], backend="native")
    eagle.save(eagle.EagleNet(eagle.EagleConfig.for_target(target, 3)), eagle_dir)
    with pytest.raises(DrafterMismatchError, match="EAGLE-3 drafter, not a DFlash"):
        DFlash(eagle_dir)
    with pytest.raises(InvalidArgumentError, match="block size must be in 2..5"):
        DFlash(folder, block_size=9)
    other = specdec.load_target(save_tiny(tmp_path / "wide", "llama", tokenizer, hidden=96), backend="native")
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        specdec.generate(other, [[5, 6, 7]], drafter=DFlash(folder), max_new_tokens=4)
    shallow = specdec.load_target(model_dirs["llama-draft"], backend="native")
    with pytest.raises(DrafterMismatchError):
        specdec.generate(shallow, [[5, 6, 7]], drafter=DFlash(folder), max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match="chains"):
        specdec.generate(target, [[5, 6, 7]], drafter=DFlash(folder), max_new_tokens=4, tree=specdec.TreeConfig(2, 2, 4))


def test_bad_folders_and_cli(dflash_dirs, model_dirs, tmp_path, capsys):
    from specdec.commands.cli import main
    from specdec.drafters.registry import resolve

    assert resolve("DFLASH") == "dflash" == resolve("dflash")
    truncated = tmp_path / "truncated"
    shutil.copytree(dflash_dirs["llama"], truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        DFlash(truncated)
    broken = tmp_path / "broken"
    shutil.copytree(dflash_dirs["llama"], broken)
    config = json.loads((broken / "config.json").read_text())
    del config["dflash_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="malformed"):
        DFlash(broken)
    for folder, extra in ((truncated, []), (broken, []), (tmp_path / "missing", []),
                          (dflash_dirs["llama"], ["--block-size", "40"])):
        code = main(["generate", "--target", str(model_dirs["llama"]), "--drafter", "dflash", "--draft", str(folder),
                     "--prompt", "x = 1", "--max-new-tokens", "4", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("specdec: error:"), err
    code = main(["generate", "--target", str(model_dirs["llama"]), "--speculative-algorithm", "DFLASH",
                 "--draft", str(dflash_dirs["llama"]), "--prompt", "x = 1", "--max-new-tokens", "12", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["stats"]["drafter"] == "dflash" and len(result["outputs"][0]["token_ids"]) == 12
    assert result["stats"]["mean_k"] > 1  # the block's drafts, not k = 1


def test_bench_measures_dflash_beside_transformers_dflash(model_dirs, dflash_dirs, tmp_path):
    from specdec.commands.bench import format_table, run_bench

    target = specdec.load_target(model_dirs["llama"], backend="native")
    target.eos_token_ids = ()
    prompts = target.encode(PROMPTS[:2])
    second = shutil.copytree(dflash_dirs["llama"], tmp_path / "other")
    drafters = (("dflash", DFlash(dflash_dirs["llama"])), ("dflash", DFlash(second)))
    result = run_bench(target, prompts, ks=[2], max_new_tokens=10, progress=False, drafters=drafters,
                       block_sizes=(3, 5))
    assert result["outputs_identical"], result["mismatches"]
    rows = {row["method"]: row for row in result["rows"]}
    for k in (2, 4):  # blocks 3 and 5, for each folder; transformers' DFlash on the first one's weights
        mine = rows[f"specdec dflash k={k} (llama)"]
        assert mine["ratio_vs_transformers"] is not None and mine["draft_ms_per_step"] > 0
        assert rows[f"specdec dflash k={k} (other)"]["ratio_vs_transformers"] is None
        assert rows[f"transformers dflash k={k} (llama)"]["tau"] >= 1.0
    assert "block drafting per step" in format_table(result)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q and k norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_keys_and_values_alone_are_those_the_whole_layer_writes(arch, dtype, model_dirs):
    """DFlash's context columns run only their keys and values (llama.layer_keys_values): the same bits
    in the cache as the whole layer writes, for every row of a ragged block."""
    from specdec.models import llama

    target = specdec.load_target(model_dirs[arch], dtype=dtype, backend="native")
    model = target.backend.model
    model.reserve(16)
    batch, n, hidden = 2, 5, int(target.config.hidden_size)
    torch.manual_seed(0)
    x = torch.randn(batch * n, hidden).to(dtype)
    positions = (torch.arange(n).repeat(batch) + torch.tensor([0, 3]).repeat_interleave(n)).contiguous()
    caches = []
    for whole in (True, False):
        kv = llama.new_kv(model, batch, 16)
        work = llama.scratch(model, batch, n)  # alive while the kernels write to it
        params = llama.block_params(model, kv, 0, positions, work)
        for index in range(len(model.layers)):
            if whole:
                llama.decoder_layer_from(model, index, x, 1e-6, x, params, kv, None)
            else:
                llama.layer_keys_values(model, index, x, 1e-6, params, kv)
        caches.append(kv[..., :n, :])  # the columns written (a new cache is uninitialised past them)
    assert caches[0].abs().sum() > 0 and torch.equal(caches[0], caches[1])


def test_context_apart_or_with_the_block_drafts_the_same(monkeypatch):
    """New context columns entered with the block (whole layers) or apart (keys and values only): the same
    drafts, bit for bit, for the trained zoo drafter whose drafts are mostly accepted."""
    from specdec.engine import generate_ids
    from specdec.decode import GenerationConfig
    from specdec.zoo import ZooError, zoo_path
    from specdec.zoo.tasks import load_tasks

    try:
        folder = zoo_path("dflash")
    except ZooError:
        pytest.skip("the zoo has no trained DFlash drafter")
    target = specdec.load_target(zoo_path("target"), dtype=torch.bfloat16, backend="native")
    prompts = target.encode(load_tasks("code-completion")[:3])
    runs = []
    for apart in (1, 10 ** 6):  # every context apart; none (the prompts too go through whole layers)
        monkeypatch.setattr(dflash.ContextCache, "APART", apart)
        drafter, drafted = DFlash(folder), []

        class Spy:
            name, features, block_size = drafter.name, drafter.features, drafter.block_size

            def start(self, context, seqs):
                session = drafter.start(context, seqs)
                propose = session.propose
                session.propose = lambda s, k: _record(propose, s, k, drafted)
                return session

        out = generate_ids(target, prompts, Spy(), GenerationConfig(num_draft_tokens=drafter.block_size - 1,
                                                                    max_new_tokens=32))
        runs.append((out.token_ids, drafted))
    assert runs[0][0] == runs[1][0] and runs[0][0] == plain(target, prompts, 32)
    assert len(runs[0][1]) == len(runs[1][1]) and all(torch.equal(a, b) for a, b in zip(*(r[1] for r in runs)))


def _record(propose, seqs, k, drafted):
    proposal = propose(seqs, k)
    drafted.append(proposal.tokens.clone())
    return proposal
