"""Self-speculation: early exit (LayerSkip) and MTP modules or heads draft for the target they live in.

Greedy output equals plain decoding token for token (Llama, Qwen2, Qwen3; both backends; float32 and
bfloat16 on native; batch 1 and ragged batches with rows stopping at EOS and at the limit; several
exit layers, depths and k); sampling keeps the target's distribution; the early-exit verification
that reuses the drafted layers computes what a whole pass computes; the native MTP caches draft
what transformers' own modules and specdec's PyTorch heads draft; a DeepSeek-V3 checkpoint with
one MTP layer drafts through the transformers backend; refusals are one line.
"""

from __future__ import annotations

import json

import pytest
import torch

import specdec
from specdec.commands.tiny import save_tiny, save_tiny_deepseek_mtp, save_tiny_mtp
from specdec.drafters import MTP, EarlyExit
from specdec.drafters import mtp as mtp_drafter
from specdec.errors import DrafterMismatchError, InvalidArgumentError, UnsupportedModelError
from specdec.sampling import SamplingConfig

from test_exact_generation import assert_equal_to, bfloat16_with_eos, native_two_token_distribution, sampled_pairs
from test_greedy_parity import MAX_NEW, PROMPTS, reference_with_stop
from test_sampling import P_VALUE, chi_square_p

ARCHS = ("llama", "qwen2", "qwen3")
LAYERS = 4


@pytest.fixture(scope="module")
def deep_dirs(tmp_path_factory, tokenizer):
    """4-layer targets (three exit layers) per architecture."""
    root = tmp_path_factory.mktemp("deep")
    return {arch: save_tiny(root / arch, arch, tokenizer, layers=LAYERS, init_std=0.15) for arch in ARCHS}


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, tokenizer):
    """Targets with random MTP modules (sequential, depth 2) or heads (parallel, depth 3)."""
    root = tmp_path_factory.mktemp("mtp")
    dirs = {}
    for arch in ("llama", "qwen3"):
        dirs[arch, "sequential"] = save_tiny_mtp(root / f"{arch}-seq", arch, "sequential", 2, tokenizer, init_std=0.15)
        dirs[arch, "parallel"] = save_tiny_mtp(root / f"{arch}-par", arch, "parallel", 3, tokenizer, init_std=0.15)
    return dirs


def check_greedy(target, model, drafters, settings):
    prompts = target.encode(PROMPTS)
    eos, reference = reference_with_stop(target, model, prompts)
    assert any(r and r[-1] == eos for r in reference) and any(len(r) == MAX_NEW for r in reference)
    assert_equal_to(target, prompts, reference, [(d, s) for d in drafters for s in settings], MAX_NEW)


# ---------------------------------------------------------------------------------------------
# Early exit.

@pytest.mark.parametrize("arch", ARCHS)
def test_early_exit_matches_transformers_greedy(arch, deep_dirs, backend):
    from specdec.backends import hf

    target = specdec.load_target(deep_dirs[arch], backend=backend)
    drafters = [EarlyExit(e) for e in range(1, LAYERS)] + [EarlyExit(2, reuse_kv=False)]
    check_greedy(target, hf.load_causal_lm(deep_dirs[arch]), drafters, [dict(num_draft_tokens=k) for k in (1, 3, 6)])


@pytest.mark.parametrize("arch", ARCHS)
def test_early_exit_equals_plain_decoding_in_bfloat16(arch, deep_dirs):
    target, prompts, reference = bfloat16_with_eos(deep_dirs[arch])
    for drafter in (EarlyExit(1), EarlyExit(3), EarlyExit(2, reuse_kv=False)):
        for k in (2, 5):
            out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=k, max_new_tokens=40)
            assert out.stats.exact_numerics and out.token_ids == reference, f"E={drafter.exit_layer} k={k}"


def test_reused_layers_compute_what_a_whole_pass_computes(deep_dirs):
    """Drafting writes layers [0, E) of the block's columns, verification only [E, L): its logits and
    every layer's keys and values equal one whole pass over the same block on the same cache."""
    from specdec.batch import Sequences
    from specdec.drafters.base import DecodeContext

    target = specdec.load_target(deep_dirs["llama"], backend="native")
    prompts = target.encode(PROMPTS[:3])
    for exit_layer in (1, 3):
        seqs = Sequences(prompts, 128, target.pad_token_id)
        cache = target.new_cache(len(prompts), 128)
        tokens, valid = seqs.window(torch.zeros_like(seqs.lengths), seqs.lengths, target.pad_token_id)
        logits, _ = target.forward(cache, tokens, valid)
        seqs.append(logits[:, -1].argmax(-1)[:, None], torch.ones_like(seqs.lengths))
        context = DecodeContext(target, SamplingConfig(), None, 64, 6)
        session = EarlyExit(exit_layer).start(context, seqs)
        session.share_cache(cache)
        for _ in range(3):
            proposal = session.propose(seqs, 4)
            block = torch.cat([seqs.tokens.gather(1, (seqs.lengths - 1)[:, None]), proposal.tokens], dim=1)
            valid = torch.ones_like(block, dtype=torch.bool)
            valid[1, 3:] = False  # a row whose budget allows fewer drafts
            saved = (cache.valid.clone(), cache.lengths.clone(), cache.positions.clone(), cache.kv.clone())
            reused, _ = session.verify_forward(cache, block, valid, logits_to_keep=5)
            after_kv, columns = cache.kv.clone(), cache.columns
            cache.valid, cache.lengths, cache.positions, cache.kv = saved
            cache.truncate(session.base)
            whole, _ = cache.forward(block, valid, logits_to_keep=5)
            assert torch.equal(reused[valid], whole[valid]), f"E={exit_layer}"
            assert cache.columns == columns
            layers, _, _, heads, _, dim = cache.kv.shape
            live = cache.valid[None, None, :, None, :, None].expand(layers, 2, -1, heads, -1, dim)
            assert torch.equal(after_kv[..., :columns, :][live], cache.kv[..., :columns, :][live])
            # commit the first two drafts of every row and go on
            cache.truncate(session.base + 3)
            seqs.append(block[:, 1:4], torch.full_like(seqs.lengths, 3))
            session.accepted(seqs, torch.full_like(seqs.lengths, 2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 6, None), (1.2, 5, 0.95)])
def test_early_exit_sampling_keeps_the_targets_distribution(temperature, top_k, top_p, deep_dirs):
    config = SamplingConfig(temperature, top_k, top_p)
    target = specdec.load_target(deep_dirs["llama"], dtype=torch.bfloat16, backend="native")
    target.eos_token_ids = ()
    prompt = target.encode(["x = x + 1\nx = x"])[0]
    exact = native_two_token_distribution(target, prompt, config)
    for drafter in (EarlyExit(2), EarlyExit(1, reuse_kv=False)):
        assert chi_square_p(sampled_pairs(target, prompt, drafter, config), exact) > P_VALUE


def test_early_exit_refusals(deep_dirs, tmp_path):
    target = specdec.load_target(deep_dirs["llama"], backend="native")
    for bad in (LAYERS, LAYERS + 3):
        with pytest.raises(InvalidArgumentError, match=rf"exit layer {bad} is outside \[1, {LAYERS}\)"):
            specdec.generate(target, "x = 1", drafter=EarlyExit(bad), max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match="must be >= 1"):
        EarlyExit(0)
    with pytest.raises(UnsupportedModelError, match="chains, not token trees"):
        specdec.generate(target, "x = 1", drafter=EarlyExit(1), max_new_tokens=4, tree=specdec.TreeConfig(2, 2, 4))


def test_the_folders_exit_layer_is_the_default(deep_dirs, tmp_path):
    import shutil

    folder = tmp_path / "variant"
    shutil.copytree(deep_dirs["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["specdec_layerskip"] = {"exit_layer": 3}
    (folder / "config.json").write_text(json.dumps(config))
    assert EarlyExit().exit_for(specdec.load_target(folder)) == 3
    assert EarlyExit().exit_for(specdec.load_target(deep_dirs["llama"])) == LAYERS // 2
    assert EarlyExit(1).exit_for(specdec.load_target(folder)) == 1


# ---------------------------------------------------------------------------------------------
# MTP.

@pytest.mark.parametrize("arch", ("llama", "qwen3"))
@pytest.mark.parametrize("design", ("sequential", "parallel"))
def test_mtp_matches_transformers_greedy(arch, design, mtp_dirs, backend):
    from specdec.backends import hf

    folder = mtp_dirs[arch, design]
    target = specdec.load_target(folder, backend=backend)
    check_greedy(target, hf.load_causal_lm(folder), [MTP(1), MTP()], [dict(num_draft_tokens=k) for k in (1, 2, 5)])


@pytest.mark.parametrize("design", ("sequential", "parallel"))
def test_mtp_equals_plain_decoding_in_bfloat16(design, mtp_dirs):
    target, prompts, reference = bfloat16_with_eos(mtp_dirs["qwen3", design])
    for drafter, k in ((MTP(), 2), (MTP(), 4), (MTP(1), 3)):
        out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=k, max_new_tokens=40)
        assert out.stats.exact_numerics and out.token_ids == reference, f"depth {drafter.depth} k={k}"


def recorded_drafts(monkeypatch, cls):
    drafts = []
    original = cls.propose

    def propose(self, seqs, k):
        proposal = original(self, seqs, k)
        drafts.append((proposal.tokens.tolist(), proposal.lengths.tolist()))
        return proposal
    monkeypatch.setattr(cls, "propose", propose)
    return drafts


@pytest.mark.parametrize("design", ("sequential", "parallel"))
def test_native_mtp_drafts_what_the_reference_modules_draft(design, mtp_dirs, monkeypatch):
    """The native caches (committed slots entered after each step, drafted slots dropped) draft exactly
    what a recompute over the whole context drafts with transformers' MtpModel (sequential) or
    specdec's PyTorch heads (parallel), step for step, in a ragged batch."""
    folder = mtp_dirs["llama", design]
    native_cls = mtp_drafter.NativeSequential if design == "sequential" else mtp_drafter.NativeParallel
    native = recorded_drafts(monkeypatch, native_cls)
    reference = recorded_drafts(monkeypatch, mtp_drafter.RecomputeSession)
    for k in (2, 4):
        native.clear()
        reference.clear()
        for backend, drafts in (("native", native), ("hf", reference)):
            target = specdec.load_target(folder, backend=backend)
            specdec.generate(target, PROMPTS[:3], drafter=MTP(), num_draft_tokens=k, max_new_tokens=24)
        assert native and native == reference, f"k={k}"


def test_training_forward_is_what_transformers_runs(mtp_dirs):
    """specdec's training pass of sequential modules (teacher forcing) equals transformers' MtpModel on
    the same checkpoint: the layout and the [enorm(e); hnorm(h)] order are the ones it reads."""
    from specdec.backends import hf
    from specdec.models.mtp import read_mtp
    from specdec.train.selfspec import SelfSpecModel

    folder = mtp_dirs["llama", "sequential"]
    model = hf.load_causal_lm(folder)
    ours = SelfSpecModel(model, read_mtp(folder)).eval()
    theirs = hf.mtp_model(model)
    tokens = torch.tensor([specdec.load_target(folder).encode(PROMPTS[0])[0]])
    with torch.no_grad():
        states = ours.layer_states(tokens)
        outs = ours.mtp_outputs(tokens, states)
        previous = model.model.norm(states[-1])
        length = tokens.shape[1]
        for k, out in enumerate(outs, 1):
            following = torch.cat([tokens[:, k:], tokens.new_zeros(1, k)], dim=1)
            positions = torch.arange(length)[None] + k
            expected = theirs.forward_layer(k - 1, previous, positions, None, input_ids=following)
            assert torch.allclose(out[:, : length - k], expected[:, : length - k], atol=1e-5), f"module {k}"
            previous = expected


@pytest.mark.parametrize("p_min", (None, 0.25))  # 0.25: about half of these first drafts' tops lie below it
@pytest.mark.parametrize("design", ("sequential", "parallel"))
def test_mtp_sampling_keeps_the_targets_distribution(design, p_min, tokenizer, tmp_path):
    config = SamplingConfig(1.0, 6, None)
    folder = save_tiny_mtp(tmp_path / design, "llama", design, 2, tokenizer, init_std=0.15)
    target = specdec.load_target(folder, dtype=torch.bfloat16, backend="native")
    target.eos_token_ids = ()
    prompt = target.encode(["x = x + 1\nx = x"])[0]
    exact = native_two_token_distribution(target, prompt, config)
    assert chi_square_p(sampled_pairs(target, prompt, MTP(p_min=p_min), config), exact) > P_VALUE


def test_mtp_refusals(deep_dirs, mtp_dirs):
    plain_target = specdec.load_target(deep_dirs["llama"])
    with pytest.raises(DrafterMismatchError, match="has no MTP modules or heads"):
        specdec.generate(plain_target, "x = 1", drafter=MTP(), max_new_tokens=4)
    target = specdec.load_target(mtp_dirs["llama", "sequential"])
    with pytest.raises(DrafterMismatchError, match="has 2 MTP modules, asked for depth 3"):
        specdec.generate(target, "x = 1", drafter=MTP(3), max_new_tokens=4)
    with pytest.raises(DrafterMismatchError, match=">= 1"):
        MTP(0)


def test_deepseek_v3_checkpoint_drafts_with_its_mtp_layer(tokenizer, tmp_path):
    """A DeepSeek-V3 model (MLA attention, a MoE MTP layer) saved as its checkpoints are: specdec's MTP
    drafter runs its module through the transformers backend, its output equals plain greedy decoding
    and transformers' own generate(use_mtp=True), and its first draft is the one transformers' module
    drafts."""
    from specdec.backends import hf

    folder = save_tiny_deepseek_mtp(tmp_path / "dsv3", tokenizer)
    target = specdec.load_target(folder)
    assert target.backend.name == "hf"
    model = hf.load_causal_lm(folder)
    prompts = target.encode(PROMPTS)
    eos, reference = reference_with_stop(target, model, prompts)
    for k in (1, 3):
        out = specdec.generate(target, prompts, drafter=MTP(), num_draft_tokens=k, max_new_tokens=MAX_NEW)
        assert out.token_ids == reference, f"k={k}"
    assert hf.enable_mtp(model) == 1
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                use_mtp=True, eos_token_id=eos, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert theirs == reference[1]
    # the first draft, against transformers' module run on the prompt
    modules = hf.mtp_model(model)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        first = out.logits[0, -1].argmax()
        following = torch.cat([ids[:, 1:], first[None, None]], dim=1)
        drafted, _, _ = modules(input_ids=following, last_hidden_states=out.hidden_states[-1], attention_mask=None,
                                position_ids=torch.arange(1, ids.shape[1] + 1)[None], mtp_cache=None)
    session_drafts = []
    original = mtp_drafter.RecomputeSession.propose

    def spy(self, seqs, k):
        proposal = original(self, seqs, k)
        session_drafts.append(int(proposal.tokens[0, 0]))
        return proposal
    mtp_drafter.RecomputeSession.propose = spy
    try:
        specdec.generate(target, [prompts[1]], drafter=MTP(), num_draft_tokens=1, max_new_tokens=2)
    finally:
        mtp_drafter.RecomputeSession.propose = original
    assert session_drafts[0] == int(drafted[0, 0])


def test_bench_measures_each_variant_beside_its_own_plain_decoding(deep_dirs, mtp_dirs):
    from specdec.commands.bench import run_bench, variant_engine

    target = specdec.load_target(deep_dirs["qwen3"])
    prompts = target.encode(PROMPTS[:2])
    variants = (variant_engine("early-exit", deep_dirs["llama"], exit_layers=[1, 3]),
                variant_engine("mtp", mtp_dirs["llama", "sequential"]))
    result = run_bench(target, prompts, ks=[2], max_new_tokens=12, progress=False, more_engines=variants)
    assert result["outputs_identical"] and not result["implementation_differences"]
    rows = {row["method"]: row for row in result["rows"]}
    for label in ("specdec[llama] plain", "specdec[llama] early-exit k=2 E=1", "specdec[llama] early-exit k=2 E=3",
                  "specdec[llama] early-exit k=2 E=1 recompute", "transformers[llama] plain",
                  "transformers[llama] early-exit k=2 E=3", "specdec[llama-seq] mtp k=2",
                  "transformers[llama-seq] mtp k=2"):
        assert label in rows, sorted(rows)
    own_plain = rows["specdec[llama] plain"]["tokens_per_second"]
    row = rows["specdec[llama] early-exit k=2 E=1"]
    assert row["speedup_vs_plain"] == pytest.approx(row["tokens_per_second"] / own_plain)
    assert row["ratio_vs_transformers"] is not None
    assert rows["transformers[llama] early-exit k=2 E=3"]["tau"] >= 1.0  # counts verification passes only


def test_cli_refuses_bad_self_drafting_options(deep_dirs, capsys):
    from specdec.commands.cli import main

    folder = str(deep_dirs["llama"])
    for argv, text in ((["bench", "--target", folder, "--tasks", "code-completion", "--drafters",
                         f"early-exit={folder}", "--exit-layers", "4"], "exit layer 4 is outside [1, 4)"),
                       (["generate", "--target", folder, "--drafter", "mtp", "--prompt", "x"], "no MTP modules"),
                       (["generate", "--target", folder, "--drafter", "early-exit", "--exit-layer", "0",
                         "--prompt", "x"], "exit layer must be >= 1")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name", ["layerskip", "mtp", "mtp-parallel"])
def test_trained_zoo_variants_equal_plain_decoding(name):
    """Where drafts are mostly accepted: long accepted runs exercise the shared cache's reuse (early
    exit) and the modules' committed slots (MTP)."""
    from specdec.zoo import ZooError, zoo_path
    from specdec.zoo.tasks import load_tasks

    try:
        folder = zoo_path(name)
    except ZooError:
        pytest.skip(f"the zoo has no {name} variant")
    for dtype in (torch.float32, torch.bfloat16):
        target = specdec.load_target(folder, dtype=dtype, backend="native")
        prompts = target.encode(load_tasks("code-completion")[:4])
        reference = [specdec.generate(target, [p], max_new_tokens=48).token_ids[0] for p in prompts]
        drafters = [EarlyExit(), EarlyExit(reuse_kv=False)] if name == "layerskip" else [MTP(), MTP(1)]
        for drafter in drafters:
            out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=48)
            assert out.token_ids == reference, f"{drafter.name} {dtype}"
            floor = 1.2 if name == "mtp-parallel" else 1.4  # heads that skip the tokens between accept less
            assert out.stats.mean_accepted_length > floor, "the trained variant should accept drafts here"


def test_bad_mtp_folders_are_one_line(mtp_dirs, tmp_path, capsys):
    """A variant folder whose modules are missing, whose weights are truncated or whose MTP record is
    malformed: one line on stderr, exit status 2."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.commands.cli import main

    source = mtp_dirs["llama", "sequential"]

    def variant(name, change):
        folder = tmp_path / name
        shutil.copytree(source, folder)
        change(folder)
        return folder

    def drop_module(folder):
        weights = load_file(folder / "model.safetensors")
        save_file({k: v for k, v in weights.items() if ".eh_proj." not in k}, folder / "model.safetensors")

    def truncate(folder):
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])

    def malform(folder):
        config = json.loads((folder / "config.json").read_text())
        config["specdec_mtp"] = {"design": "sequential", "depth": 2, "colour": "blue"}
        (folder / "config.json").write_text(json.dumps(config))

    for name, change, text in (("missing", drop_module, "lacks model.layers"), ("truncated", truncate, "cannot read"),
                               ("malformed", malform, "malformed specdec_mtp")):
        folder = variant(name, change)
        assert main(["generate", "--target", str(folder), "--backend", "native", "--drafter", "mtp",
                     "--prompt", "x = 1", "--max-new-tokens", "4"]) == 2
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("design", ("sequential", "parallel"))
def test_mtp_p_min_cuts_each_rows_chain_and_keeps_the_output(design, mtp_dirs, monkeypatch):
    """llama.cpp's --draft-p-min on MTP: a row stops before its first draft the modules are less sure of than
    p_min (past the last module too), rows of a ragged bfloat16 batch apart; greedy output stays plain
    decoding's; drafts per step fall as p_min rises; the transformers backend's recompute proposes what the
    native caches propose with the same cut."""
    target, prompts, reference = bfloat16_with_eos(mtp_dirs["qwen3", design])
    counts = []
    for p_min in (None, 0.02, 0.05, 0.1, 0.9):
        drafter = MTP(p_min=p_min)
        assert drafter.setting == ("" if p_min is None else f"p>={p_min:g}")
        assert_equal_to(target, prompts, reference, [(drafter, dict(num_draft_tokens=4))], 40)
        stats = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=40).stats
        counts.append(stats.drafts_proposed / stats.target_forwards)
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0]
    assert any(0 < c < counts[0] for c in counts)
    native_cls = mtp_drafter.NativeSequential if design == "sequential" else mtp_drafter.NativeParallel
    native = recorded_drafts(monkeypatch, native_cls)
    reference_drafts = recorded_drafts(monkeypatch, mtp_drafter.RecomputeSession)
    for backend in ("native", "hf"):
        cut = specdec.load_target(mtp_dirs["llama", design], backend=backend)
        specdec.generate(cut, PROMPTS[:3], drafter=MTP(p_min=0.05), num_draft_tokens=4, max_new_tokens=24)
    assert native and native == reference_drafts
    assert any(0 < length < 4 for _, lengths in native for length in lengths)
