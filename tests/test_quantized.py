"""Quantized weights run as they are (GGUF Q8_0, Q4_0, Q4_1): packing, the integer products' exactness
(a row keeps its bits in any block, with any thread count, in every build), and GGUF files loaded
directly with speculative output equal to plain decoding.

The products are not the float product of the dequantized weights (activations are rounded to int8
per block of 32, as llama.cpp does), so they are compared to it with a tolerance; what must hold
bit for bit is that nothing but the row itself decides its result.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch

from specdec.backends.target import load_target
from specdec.commands.gguf import export
from specdec.commands.tiny import save_tiny
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.drafters.tree import TreeConfig
from specdec.engine import generate
from specdec.errors import ModelLoadError
from specdec.models import kernels
from specdec.models.kernels import QMatrix, quantize_blocks

gguf = pytest.importorskip("gguf")
QTYPES = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(scope="module", autouse=True)
def native():
    if kernels.available() is not None:
        pytest.skip(kernels.available())


@pytest.mark.parametrize("qtype", QTYPES)
def test_packing_keeps_every_value_gguf_reads(qtype):
    torch.manual_seed(0)
    w = torch.randn(37, 96) * torch.rand(37, 1) * 3           # 37 columns: a padded last panel
    raw = quantize_blocks(w, qtype)
    theirs = gguf.quants.dequantize(raw.numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    theirs = torch.from_numpy(np.array(theirs, dtype=np.float32)).reshape(37, 96)
    assert torch.equal(QMatrix.from_gguf(raw, qtype, 96, 37).dequantize(), theirs.t())
    assert (theirs - w).abs().max() < 0.2 * w.abs().max()   # the quantizer is llama.cpp's, not noise


def product_case(qtype, rows, seed=0, k=160, n=53):
    torch.manual_seed(seed)
    w = QMatrix.quantize(torch.randn(n, k), qtype, gain=torch.rand(k) + 0.5)
    return w, torch.randn(rows, k), torch.randn(rows, n), torch.randn(n)


def run(x, w, residual, bias):
    return kernels.linear(x, w, residual=residual, bias=bias, norm_eps=1e-5)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_keeps_its_bits_in_every_block(qtype, threads):
    lib = kernels.library()
    lib.sd_set_threads(threads)
    saved = lib.sd_parallel_threshold()
    lib.sd_set_parallel_threshold(1 if threads > 1 else saved)
    try:
        w, x, residual, bias = product_case(qtype, 64)
        alone = torch.cat([run(x[i:i + 1], w, residual[i:i + 1], bias) for i in range(64)])
        for rows in (2, 3, 4, 5, 6, 7, 16, 17, 33, 64):   # the few-row tiles up to 6, the many-row ones above
            assert torch.equal(run(x[:rows], w, residual[:rows], bias), alone[:rows]), rows
    finally:
        lib.sd_set_threads(torch.get_num_threads())
        lib.sd_set_parallel_threshold(saved)


@pytest.mark.parametrize("qtype", QTYPES)
def test_products_are_close_to_the_dequantized_float_product(qtype):
    w, x, residual, bias = product_case(qtype, 9)
    exact = torch.nn.functional.rms_norm(x, (x.shape[1],), eps=1e-5) * w.gain
    want = exact.double() @ w.dequantize().double() + residual.double() + bias.double()
    got = run(x, w, residual, bias).double()
    scale = (exact.abs().double() @ w.dequantize().abs().double()).max()
    assert (got - want).abs().max() < 0.02 * scale      # int8 activations: a relative error of ~1/254 per input


def test_bfloat16_rows_keep_their_bits():
    w, x, residual, bias = product_case("Q4_1", 17)
    x, residual, bias = x.bfloat16(), residual.bfloat16(), bias.bfloat16()
    alone = torch.cat([run(x[i:i + 1], w, residual[i:i + 1], bias) for i in range(17)])
    assert torch.equal(run(x, w, residual, bias), alone)


@pytest.fixture(scope="module")
def builds():
    """The native build and every other one this machine runs (AVX2 without AVX-512, portable)."""
    libraries = {}
    for library in kernels.builds():
        libraries.setdefault(library.sd_qvector().decode(), library)
    if len(libraries) < 2:
        pytest.skip("only one build of the quantized products runs here")
    return libraries


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [160, 1056])  # 1056: 33 blocks
def test_every_build_computes_the_same_bits(builds, qtype, k, monkeypatch):
    w, x, residual, bias = product_case(qtype, 19, seed=3, k=k)
    x[2] = 0                 # a row of zeros: every scale 0
    x[3, 32:64] = 0          # one block of zeros
    for rows in (1, 6, 19):     # the few-row tiles and the many-row ones
        results = {}
        for name, library in builds.items():
            monkeypatch.setattr(kernels, "_library", library)
            results[name] = run(x[:rows], w, residual[:rows], bias)
        monkeypatch.undo()
        first = next(iter(results.values()))
        assert all(torch.equal(first, other) for other in results.values()), (rows, list(results))


@pytest.mark.parametrize("qtype", QTYPES)
def test_amx_tiles_compute_the_vector_codes_bits(qtype):
    """Where the CPU has AMX-INT8, row blocks of a quantized product take the tile unit from a row
    count on (kernels.c, amx_q_rows): forced on for every block and forced off, every row of every
    block size has the same bits."""
    lib = kernels.library()
    if not kernels.amx_pairs(32):
        pytest.skip("no AMX tiles here")
    code = kernels.QTYPES[qtype]
    w, x, residual, bias = product_case(qtype, 64, seed=4)
    results, saved = {}, lib.sd_set_amx_q_rows(code, 1)
    try:
        for rows_from in (1, 17):
            lib.sd_set_amx_q_rows(code, rows_from)
            results[rows_from] = [run(x[:rows], w, residual[:rows], bias) for rows in [*range(1, 18), 33, 64]]
    finally:
        lib.sd_set_amx_q_rows(code, saved)
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[17]))


def test_an_input_size_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        QMatrix.quantize(torch.randn(8, 40), "Q8_0")


# ---------------------------------------------------------------------------------------------
# GGUF files, loaded directly.

@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tokenizer):
    """A tiny Llama with 32-dimensional heads, so every matrix (o included) stays quantized."""
    return save_tiny(tmp_path_factory.mktemp("wide") / "llama", "llama", tokenizer, hidden=128, init_std=0.15)


@pytest.fixture(scope="module", params=["q8_0", "q4_0", "q4_1"])
def quantized_file(request, wide_model, tmp_path_factory):
    return export(wide_model, tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf", request.param)


def test_a_gguf_file_loads_with_its_weights_quantized(quantized_file):
    target = load_target(quantized_file, backend="native")
    model = target.backend.model
    kind = quantized_file.stem.split("-")[-1].upper()
    matrices = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.head]
    assert all(isinstance(m, QMatrix) and m.qtype == kind for m in matrices)
    hf = load_target(quantized_file, backend="hf")  # transformers on the dequantized tensors
    tokens = torch.tensor([[5, 17, 33, 2, 9, 41, 7]])
    ours = target.forward(target.new_cache(1), tokens, logits_to_keep=7)[0]
    theirs = hf.forward(hf.new_cache(1), tokens, logits_to_keep=7)[0]
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    assert target.fingerprint() == hf.fingerprint()


def test_the_cache_keeps_no_folder_of_a_removed_gguf_file(quantized_file, tmp_path, monkeypatch):
    from specdec.models.gguf import gguf_folder

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "first.gguf", tmp_path / "second.gguf"
    shutil.copy(quantized_file, first)
    shutil.copy(quantized_file, second)
    kept = gguf_folder(first)
    assert gguf_folder(first) == kept and (kept / "config.json").is_file()
    first.unlink()
    other = gguf_folder(second)
    assert not kept.exists() and (other / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == [other.name]


def test_speculation_on_quantized_weights_equals_plain_decoding(quantized_file, model_dirs):
    target = load_target(quantized_file, backend="native")
    draft = load_target(model_dirs["llama-draft"], backend="native")
    from specdec.drafters.draft_model import DraftModel

    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61], [3] * 12]
    plain = generate(target, prompts, max_new_tokens=24).token_ids
    for drafter, k in ((PromptLookup(), 3), (DraftModel(draft), 4)):
        assert generate(target, prompts, drafter=drafter, num_draft_tokens=k, max_new_tokens=24).token_ids == plain


def test_a_damaged_gguf_file_is_one_line(tmp_path, quantized_file):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(quantized_file.read_bytes()[:1000])
    with pytest.raises(ModelLoadError) as error:
        load_target(broken, backend="native")
    assert "\n" not in str(error.value)


def test_feature_drafters_beside_a_quantized_target_run_quantized_and_exact(quantized_file, tmp_path):
    """EAGLE-1/3 and DFlash networks are block-quantized (Q8_0) beside a quantized target, the head they
    share with it is its own packed matrix, and speculation stays equal to plain decoding."""
    from test_dflash import random_dflash
    from test_feature_drafters import random_drafters

    from specdec.drafters import DFlash, Eagle

    target = load_target(quantized_file, backend="native")
    dirs = random_drafters(target, tmp_path)
    drafters = [Eagle(dirs["eagle"], version=1), Eagle(dirs["eagle3"], version=3),
                DFlash(random_dflash(target, tmp_path / "dflash"))]
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61]]
    plain = generate(target, prompts, max_new_tokens=20).token_ids
    for drafter in drafters:
        assert generate(target, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=20).token_ids == plain
        core = drafter.runtime(target).core
        assert isinstance(core.layers[0].gate_up, QMatrix) and isinstance(core.head, QMatrix)
    assert drafters[0].runtime(target).core.head.packed is target.backend.model.head.packed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafter_networks_quantized_at_load_beside_a_float_target_stay_exact(dtype, model_dirs, tmp_path, capsys):
    """quantize=... (--draft-quantize) block-quantizes EAGLE-1/3, DFlash and DSpark networks beside a float
    target: their matrices run quantized, speculation equals plain decoding, bench labels the rows with
    it, and a type the kernels do not run is one line."""
    from test_dflash import random_dflash
    from test_dspark import random_dspark
    from test_feature_drafters import random_drafters

    from specdec.commands.cli import main
    from specdec.drafters import DFlash, DSpark, Eagle
    from specdec.errors import InvalidArgumentError

    target = load_target(model_dirs["llama"], backend="native", dtype=dtype)
    dirs = random_drafters(target, tmp_path)
    dirs["dflash"] = random_dflash(target, tmp_path / "dflash")
    dirs["dspark"] = random_dspark(target, tmp_path / "dspark")
    drafters = [Eagle(dirs["eagle"], version=1, quantize="q8_0"), Eagle(dirs["eagle3"], version=3, quantize="Q4_1"),
                DFlash(dirs["dflash"], quantize="q8_0"), DSpark(dirs["dspark"], quantize="q4_0")]
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61]]
    plain = generate(target, prompts, max_new_tokens=20).token_ids
    for drafter, qtype in zip(drafters, ("Q8_0", "Q4_1", "Q8_0", "Q4_0")):
        assert generate(target, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=20).token_ids == plain
        core = drafter.runtime(target).core
        assert isinstance(core.layers[0].gate_up, QMatrix) and core.layers[0].gate_up.qtype == qtype
    assert not isinstance(Eagle(dirs["eagle3"], version=3).runtime(target).core.layers[0].gate_up, QMatrix)
    for make in (lambda: Eagle(dirs["eagle3"], quantize="q5_k"), lambda: DFlash(dirs["dflash"], quantize="int4")):
        with pytest.raises(InvalidArgumentError, match="q8_0, q4_0, q4_1") as error:
            make()
        assert "\n" not in str(error.value)
    assert main(["bench", "--target", str(model_dirs["llama"]), "--tasks", "code-completion", "--num-prompts", "1",
                 "--max-new-tokens", "8", "--no-transformers", "--drafters", f"dflash={dirs['dflash']}",
                 "--draft-quantize", "q8_0", "--dtype", dtype]) == 0
    table = capsys.readouterr().out
    assert re.search(r"dflash k=\d+ q8_0", table) and "all greedy outputs identical" in table


@pytest.mark.parametrize("quantize", ["q8_0", "q4_0", "q4_1"])
def test_a_float_model_quantized_at_load_runs_exactly(quantize, model_dirs):
    target = load_target(model_dirs["llama"], backend="native", quantize=quantize)
    assert target.backend.quantized_types == (quantize.upper(),)
    draft = load_target(model_dirs["llama"], backend="native")          # the float model drafting for it
    from specdec.drafters.draft_model import DraftModel

    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61], [3] * 12]
    plain = generate(target, prompts, max_new_tokens=24)
    spec = generate(target, prompts, drafter=DraftModel(draft), num_draft_tokens=4, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids and spec.stats.drafts_accepted > 0
    tree = generate(target, prompts, drafter=DraftModel(draft), max_new_tokens=24,
                    tree=TreeConfig(depth=3, topk=2, num_nodes=6))              # a tree over a ragged batch
    assert tree.token_ids == plain.token_ids


def test_a_float_target_drafted_by_its_own_quantized_copy_is_exact(model_dirs):
    """DraftModel(target's folder, quantize=...): the float model's quantized copy drafts for it; the output is
    the float model's own, and the copy agrees with it often enough to matter."""
    from specdec.drafters.draft_model import DraftModel

    target = load_target(model_dirs["llama"], backend="native")
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61], [3] * 12]
    plain = generate(target, prompts, max_new_tokens=24)
    drafter = DraftModel(model_dirs["llama"], quantize="q8_0")
    assert drafter.backend.quantized_types == ("Q8_0",)
    spec = generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=24)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafts_accepted > 0.5 * spec.stats.drafts_proposed
    tree = generate(target, prompts, drafter=drafter, max_new_tokens=24, tree=TreeConfig(depth=3, topk=2, num_nodes=6))
    assert tree.token_ids == plain.token_ids
    from specdec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="already loaded"):
        DraftModel(target, quantize="q8_0")                   # a loaded model is not quantized again


def test_a_gguf_file_drafts_for_its_float_model(quantized_file, wide_model):
    from specdec.drafters.draft_model import DraftModel

    target = load_target(wide_model, backend="native")
    drafter = DraftModel(quantized_file)                     # the file itself, its tensors quantized as stored
    assert drafter.backend.quantized_types
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61]]
    plain = generate(target, prompts, max_new_tokens=20).token_ids
    assert generate(target, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=20).token_ids == plain


def test_a_copy_of_the_target_takes_the_prompt_from_the_targets_cache(quantized_file, wide_model, tokenizer,
                                                                      tmp_path, monkeypatch):
    """A draft model that copies the target (a GGUF file of its weights) does not read the prompt again: its
    cache takes the target's keys and values after the prefill, so its first pass reads the one new token,
    and it agrees with the target as often as when it reads the prompt itself. Outputs stay the target's."""
    from specdec.backends.native import NativeCache
    from specdec.drafters.draft_model import DraftModel

    target = load_target(wide_model, backend="native")
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33, 8, 12], [60, 61, 62, 60, 61], [3, 4] * 7]
    plain = generate(target, prompts, max_new_tokens=20).token_ids
    widths = []
    forward = NativeCache.forward

    def recorded(cache, tokens, *args, **kwargs):
        widths.append((cache.model is drafter.backend.model, tokens.shape[1]))
        return forward(cache, tokens, *args, **kwargs)

    monkeypatch.setattr(NativeCache, "forward", recorded)
    runs = {}
    for reuse in (True, False):
        drafter = DraftModel(quantized_file, reuse_prompt=reuse)
        widths.clear()
        out = generate(target, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=20)
        assert out.token_ids == plain and drafter.copies_target == reuse
        first_draft_pass = next(width for is_draft, width in widths if is_draft)
        assert first_draft_pass == (1 if reuse else max(map(len, prompts)) + 1)
        tree = generate(target, prompts, drafter=drafter, max_new_tokens=20, tree=TreeConfig(depth=3, topk=2, num_nodes=6))
        assert tree.token_ids == plain
        runs[reuse] = out.stats.drafts_accepted / out.stats.drafts_proposed
    assert runs[True] >= runs[False] - 0.05          # measured: Q8_0 1.0 against 0.95, the 4-bit types 0.25 against 0.22
    # The same shape with other weights, or another shape, is not a copy: it reads the prompt itself.
    for i, options in enumerate(({"seed": 11}, {"layers": 1})):
        drafter = DraftModel(save_tiny(tmp_path / f"other-{i}", "llama", tokenizer, hidden=128, init_std=0.15, **options))
        assert generate(target, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=20).token_ids == plain
        assert not drafter.copies_target


def test_a_quantized_draft_model_drafts_over_a_draft_vocabulary(quantized_file, wide_model, tmp_path):
    """A draft vocabulary keeps a quantized draft model's head quantized: Q8_0 blocks of its rows, which for
    a Q8_0 head are its own blocks, so the kept rows' logits are the whole head's bit for bit."""
    import json

    from specdec.drafters.draft_model import DraftModel
    from specdec.errors import DrafterMismatchError

    target = load_target(wide_model, backend="native")
    ids = list(range(0, target.vocab_size, 3))
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": ids}))
    whole, drafter = DraftModel(quantized_file), DraftModel(quantized_file, draft_vocab=tmp_path / "draft_vocab.json")
    assert drafter.vocabulary.tolist() == ids and whole.vocabulary is None
    prompts = [[5, 17, 33, 2, 9, 41, 7, 5, 17, 33], [60, 61, 62, 60, 61]]
    plain = generate(target, prompts, max_new_tokens=20).token_ids
    alone = generate(target, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=20)
    assert alone.token_ids == plain
    # staged on prompt lookup, the guesses checked against the draft vocabulary's argmax: the same drafts
    staged = DraftModel(quantized_file, draft_vocab=tmp_path / "draft_vocab.json", staged="prompt-lookup")
    staged = generate(target, prompts, drafter=staged, num_draft_tokens=3, max_new_tokens=20)
    assert staged.token_ids == plain and staged.stats.accepted_at == alone.stats.accepted_at
    assert isinstance(drafter.head, QMatrix) and drafter.head.qtype == "Q8_0" and drafter.head.cols == len(ids)
    if whole.backend.model.head.qtype == "Q8_0":
        states = torch.randn(3, int(whole.backend.config.hidden_size))
        full = kernels.linear(states, whole.backend.model.head, norm_eps=whole.backend.model.eps)
        kept = kernels.linear(states, drafter.head, norm_eps=whole.backend.model.eps)
        assert torch.equal(kept, full[:, ids])
    with pytest.raises(DrafterMismatchError, match="no draft vocabulary"):
        DraftModel(quantized_file, draft_vocab=tmp_path / "missing.json")
    (tmp_path / "cut.json").write_text('{"ids": [0, 3, 6')                 # truncated
    (tmp_path / "wide.json").write_text(json.dumps({"ids": [0, target.vocab_size]}))  # another target's ids
    for bad, words in (("cut.json", "not a draft vocabulary"), ("wide.json", "within the target's vocabulary")):
        with pytest.raises(DrafterMismatchError, match=words) as error:
            DraftModel(quantized_file, draft_vocab=tmp_path / bad)
        assert "\n" not in str(error.value)


def test_draft_quantize_on_the_command_line(model_dirs, capsys):
    import json

    from specdec.commands.cli import main

    base = ["generate", "--target", str(model_dirs["llama"]), "--prompt", "x = 1\nx = 1\n", "--backend", "native",
            "--max-new-tokens", "12", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(model_dirs["llama"]), "--speculative-draft-model-quantization", "q4_0",
                        "--drafter", "draft-model", "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["stats"]["drafter"] == "draft-model" and spec["stats"]["drafts_accepted"] > 0
    assert spec["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    with pytest.raises(SystemExit) as refused:
        main(base + ["--draft", str(model_dirs["llama"]), "--draft-quantize", "q5_k"])
    assert refused.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    for lone in (["--draft-quantize", "q8_0"], ["--draft-quantize", "q8_0", "--draft", str(model_dirs["llama"])]):
        assert main(base + lone) == 2  # nothing to quantize: no draft model drafts (the default drafter is none)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--drafter draft-model and --draft" in err[0]
    assert main(["bench", "--target", str(model_dirs["llama"]), "--tasks", "code-completion", "--draft-quantize",
                 "q4_1"]) == 2                                 # bench's draft model is --draft: none given
    assert "--draft DIR" in capsys.readouterr().err
    on_hf = ["generate", "--target", str(model_dirs["llama"]), "--prompt", "x = 1", "--backend", "hf", "--draft",
             str(model_dirs["llama"]), "--draft-quantize", "q8_0", "--drafter", "draft-model"]
    assert main(on_hf) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "native backend" in err[0]


def test_quantize_is_refused_where_it_cannot_run(model_dirs):
    from specdec.errors import InvalidArgumentError, UnsupportedModelError

    with pytest.raises(InvalidArgumentError, match="native backend"):
        load_target(model_dirs["llama"], backend="hf", quantize="q8_0")
    with pytest.raises(UnsupportedModelError, match="unknown quantization"):
        load_target(model_dirs["llama"], backend="native", quantize="q5_k")


def test_cost_curve_states_the_machines_limit(model_dirs):
    from specdec.commands.bench import COST_SIZES, cost_curve

    target = load_target(model_dirs["llama"], backend="native", quantize="q8_0")
    curve = cost_curve(target.backend, context=16)
    limit = curve["limit"]
    assert curve["weights"] == "Q8_0" and set(limit["ms"]) == {str(n) for n in COST_SIZES}
    assert limit["weight_bytes"] > 0 and limit["bandwidth_gb_s"] > 0 and limit["peak_int8_gmac_s"] > 0
    assert all(limit["ms"][str(a)] <= limit["ms"][str(b)] for a, b in zip(COST_SIZES, COST_SIZES[1:]))


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_float_gguf_files_load_directly(kind, wide_model, tmp_path):
    """F32, F16 and BF16 tensors are read as float32 (an F32 file runs exactly as its folder does)."""
    target = load_target(export(wide_model, tmp_path / f"t-{kind}.gguf", kind), backend="native")
    folder = load_target(wide_model, backend="native")
    assert target.backend.quantized_types == ()
    tokens = torch.tensor([[5, 17, 33, 2, 9]])
    ours = target.forward(target.new_cache(1), tokens, logits_to_keep=5)[0]
    theirs = folder.forward(folder.new_cache(1), tokens, logits_to_keep=5)[0]
    if kind == "f32":
        assert torch.equal(ours, theirs)
    else:
        assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_the_native_build_compiles_its_vector_paths():
    """A native build that fails to compile falls back to the portable one: slow, never wrong. On a CPU with
    AVX2 that fallback would be a bug, so say so here."""
    from pathlib import Path

    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx2" not in flags:
        pytest.skip("no AVX2 here")
    library = kernels.library()
    assert library.sd_vector().decode() != "portable" and library.sd_qvector().decode() != "portable"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        assert library.sd_qvector().decode() == "avx512-vnni"
