"""The native forward pass equals transformers' logits on every supported architecture and variant.

The reference is always transformers in fp32, no cache, each row alone. The tiny models get random
norm weights and biases (transformers initialises norms to ones, which would hide a norm wrongly
applied or permuted).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from specdec.errors import UnsupportedModelError
from specdec.backends.native import NativeBackend
from specdec.backends.target import Target
from specdec.commands.tiny import save_tiny

ATOL = 5e-5
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
# name -> (architecture, config changes, extras: "bias" adds attention and MLP biases, "tie" ties the head)
VARIANTS = {
    "llama": ("llama", {}, ()),
    "qwen2": ("qwen2", {}, ()),
    "qwen3": ("qwen3", {}, ()),
    "mistral": ("mistral", {}, ()),
    "tied": ("llama", {"tie_word_embeddings": True}, ("tie",)),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}, ()),
    "linear-rope-bias": ("llama", {"rope_parameters": LINEAR_ROPE, "attention_bias": True, "mlp_bias": True},
                         ("bias",)),
    "mistral-window": ("mistral", {"sliding_window": 6}, ()),
}


def make_variant(directory, base, changes, extras):
    """Copy a tiny model, edit its config, randomise its norm weights, add biases or tie the head."""
    shutil.copytree(base, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    weights = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(len(weights))
    for name, tensor in weights.items():
        if "norm" in name:
            weights[name] = 1 + 0.3 * torch.randn(tensor.shape, generator=generator)
    if "bias" in extras:
        for name in [n for n in weights if n.endswith("proj.weight")]:
            size = weights[name].shape[0]
            weights[name.replace("weight", "bias")] = 0.1 * torch.randn(size, generator=generator)
    if "tie" in extras:
        del weights["lm_head.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def native_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("native")
    bases, dirs = {}, {}
    for name, (arch, changes, extras) in VARIANTS.items():
        if arch not in bases:
            bases[arch] = save_tiny(root / f"base-{arch}", arch, tokenizer, init_std=0.15)
        dirs[name] = make_variant(root / name, bases[arch], changes, extras)
    return dirs


@pytest.fixture(scope="module")
def models(native_dirs):
    """name -> (NativeBackend, transformers model)."""
    return {name: (NativeBackend.load(path), AutoModelForCausalLM.from_pretrained(path).eval())
            for name, path in native_dirs.items()}


def reference(hf_model, row, hidden=False):
    with torch.no_grad():
        out = hf_model(torch.tensor([row]), output_hidden_states=hidden)
    return (out.logits[0], out.hidden_states) if hidden else out.logits[0]


def ones(tokens):
    return torch.ones_like(tokens, dtype=torch.bool)


def run(cache, rows, logits_to_keep=1, **options):
    """Forward a block of rows (lists of token ids, all live)."""
    tokens = torch.tensor(rows)
    return cache.forward(tokens, ones(tokens), logits_to_keep, **options)


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_steps_and_blocks_match_transformers(name, models):
    backend, hf_model = models[name]
    sequence = torch.randint(0, backend.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = reference(hf_model, sequence[0].tolist())
    cache = backend.new_cache(1, 32)
    pieces = [(0, 7), (7, 8), (8, 9), (9, 10), (10, 14), (14, 24)]  # prefill, single steps, blocks
    for start, stop in pieces:
        block = sequence[:, start:stop]
        logits, _ = cache.forward(block, ones(block), logits_to_keep=0)
        assert (logits[0] - expected[start:stop]).abs().max() < ATOL, (name, start)
    assert cache.grown == 0 and cache.lengths.tolist() == [24]
    assert cache.memory_bytes == cache.kv.numel() * 4


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral-window"])
def test_ragged_batches_with_holes_rollback_and_compaction(name, models):
    backend, hf_model = models[name]
    vocab = backend.vocab_size
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 4, 6)]
    cache = backend.new_cache(3, 64)
    buffer = cache.kv.data_ptr()
    width = max(map(len, rows))
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    logits, _ = cache.forward(tokens, valid)
    assert torch.isfinite(logits).all() and torch.isfinite(cache.kv[..., :cache.columns, :]).all()  # padding sees nothing: no NaN
    for step in range(9):
        block = torch.randint(0, vocab, (3, 5), generator=generator)
        valid = ones(block)
        if step == 4:
            valid[1] = False  # a row with nothing new: every query of it is a hole
        logits, _ = cache.forward(block, valid, logits_to_keep=5)
        assert torch.isfinite(logits).all()
        for b in range(3):
            if valid[b].any():
                expected = reference(hf_model, rows[b] + block[b].tolist())[-5:]
                assert (logits[b] - expected).abs().max() < ATOL, (step, b)
        keep = torch.randint(1, 6, (3,), generator=generator) * valid.any(1)
        cache.truncate(cache.lengths - valid.sum(1) + keep)
        for b in range(3):
            rows[b] += block[b, : keep[b]].tolist()
        if step % 3 == 2:
            assert cache.compact(slack=0.0, minimum=0)
            assert cache.columns == max(map(len, rows))
        assert cache.lengths.tolist() == [len(r) for r in rows]
    assert cache.kv.data_ptr() == buffer and cache.grown == 0  # written in place, never reallocated
    cache.select_rows(torch.tensor([2, 0]))
    logits, _ = cache.forward(torch.tensor([[5], [6]]), torch.ones(2, 1, dtype=torch.bool))
    for got, row in zip(logits[:, -1], (rows[2] + [5], rows[0] + [6])):
        assert (got - reference(hf_model, row)[-1]).abs().max() < ATOL


def test_rows_leave_and_join_in_place_and_each_row_stays_exact(models):
    """A serving batch: finished rows leave (the rows after them move up in the same buffer), new
    rows join into the freed rows (copied there, nothing reallocated while they fit), one joins with
    more columns than the buffer holds (it grows); every row's logits stay its own, alone."""
    backend, hf_model = models["llama"]
    vocab = backend.vocab_size
    generator = torch.Generator().manual_seed(3)

    def prompts(*lengths):
        return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]

    def prefill(rows, capacity):
        cache = backend.new_cache(len(rows), capacity)
        width = max(map(len, rows))
        tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
        cache.forward(tokens, valid)
        return cache

    def step_and_check(cache, rows):
        block = torch.randint(0, vocab, (len(rows), 2), generator=generator)
        logits, _ = cache.forward(block, ones(block), logits_to_keep=2)
        for b, row in enumerate(rows):
            row += block[b].tolist()
            assert (logits[b] - reference(hf_model, row)[-2:]).abs().max() < ATOL, b

    rows = prompts(7, 3, 5, 9)
    cache = prefill(rows, 40)
    step_and_check(cache, rows)
    store = cache.store.data_ptr()
    cache.select_rows(torch.tensor([0, 2, 3]))  # row 1 leaves: rows 2 and 3 move up
    rows = [rows[0], rows[2], rows[3]]
    assert cache.store.data_ptr() == store and cache.kv.shape[2] == 3
    step_and_check(cache, rows)
    joining = prompts(4)
    cache.extend(prefill(joining, 30))  # into the freed row
    rows += joining
    assert cache.store.data_ptr() == store and cache.kv.shape[2] == 4 and cache.grown == 0
    step_and_check(cache, rows)
    cache.select_rows(torch.tensor([3, 1]))  # out of order: a new buffer of those rows
    rows = [rows[3], rows[1]]
    step_and_check(cache, rows)
    longer = prompts(30)
    cache.extend(prefill(longer, 64))  # more columns than the buffer has: it grows
    rows += longer
    assert cache.capacity >= 64 and cache.kv.shape[2] == 3
    for _ in range(2):
        step_and_check(cache, rows)
    assert torch.isfinite(cache.kv[..., :cache.columns, :]).all()


def test_a_cohort_read_in_groups_fills_one_cache(models, monkeypatch):
    """The engine's grouped prefill: each group's prompts read in a cache of just their columns, then placed
    in the cohort's one cache (its capacity, the cohort's row order, holes on the right of narrower rows,
    zeros there); every row then decodes as it does alone. A cache that holds columns refuses."""
    from specdec.engine import prefill

    backend, hf_model = models["llama"]
    target = Target(backend=backend)
    generator = torch.Generator().manual_seed(5)
    lengths = [3, 40, 5, 38, 4]
    rows = [torch.randint(0, backend.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    width = max(lengths)
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    made, new_cache = [], backend.new_cache
    monkeypatch.setattr(backend, "new_cache", lambda batch, capacity=None: made.append((batch, capacity)) or
                        new_cache(batch, capacity))
    cache, logits, _ = prefill(target, tokens, valid, 64, (), [[0, 2, 4], [1, 3]])
    assert made == [(5, 64), (3, 5), (2, 40)]  # one cache of the cohort's capacity; each group's as wide as it reads
    assert cache.capacity == 64 and cache.columns == width and cache.lengths.tolist() == lengths
    for b, row in enumerate(rows):
        assert (logits[b, -1] - reference(hf_model, row)[-1]).abs().max() < ATOL, b
        narrow = max(lengths[i] for i in ([0, 2, 4] if b in (0, 2, 4) else [1, 3]))
        assert not cache.valid[b, narrow:].any() and not cache.kv[:, :, b, :, narrow:width].any()
        assert cache.positions[b, cache.valid[b]].tolist() == list(range(len(row)))
    block = torch.randint(0, backend.vocab_size, (len(rows), 2), generator=generator)
    logits, _ = cache.forward(block, ones(block), logits_to_keep=2)
    for b, row in enumerate(rows):
        assert (logits[b] - reference(hf_model, row + block[b].tolist())[-2:]).abs().max() < ATOL, b
    with pytest.raises(ValueError, match="without columns"):
        cache.place([(torch.tensor([0]), backend.new_cache(1, 4))])


def test_cache_grows_when_a_block_passes_its_capacity(models):
    backend, hf_model = models["llama"]
    sequence = list(range(3, 23))
    with torch.inference_mode():  # a cache made in inference mode still runs outside it
        cache = backend.new_cache(1, 4)
    logits, _ = run(cache, [sequence[:10]], 0)
    logits2, _ = run(cache, [sequence[10:]], 0)
    assert cache.grown == 2 and cache.capacity >= 20
    assert (torch.cat([logits, logits2], 1)[0] - reference(hf_model, sequence)).abs().max() < ATOL


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tree_block_mask_matches_each_path_alone(name, models):
    backend, hf_model = models[name]
    parents = [-1, 0, 0, 1, 1, 2]  # node i hangs below parents[i]; -1: below the context
    n = len(parents)
    ancestor = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestor[node] |= ancestor[parent]
    depth = ancestor.sum(1) - 1
    contexts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    cache = backend.new_cache(2, 16)
    cache.forward(torch.tensor([contexts[0], [0, 0] + contexts[1]]),
                  torch.tensor([[True] * 5, [False, False, True, True, True]]))
    nodes = torch.tensor([[20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]])
    positions = cache.lengths[:, None] + depth
    logits, _ = cache.forward(nodes, ones(nodes), logits_to_keep=0, block_mask=ancestor.expand(2, n, n),
                              positions=positions)
    for b in range(2):
        for node in range(n):
            path = [int(nodes[b, i]) for i in range(n) if ancestor[node, i]]
            expected = reference(hf_model, contexts[b] + path)[-1]
            assert (logits[b, node] - expected).abs().max() < ATOL, (b, node)


def test_layer_range_then_the_rest_of_the_block(models):
    backend, hf_model = models["qwen3"]
    sequence = list(range(40, 52))
    expected, hidden = reference(hf_model, sequence, hidden=True)
    cache = backend.new_cache(1, 16)
    run(cache, [sequence[:6]])
    block = torch.tensor([sequence[6:10]])
    partial = cache.begin(block, stop=1)
    assert partial.layer == 1 and cache.lengths.tolist() == [10]  # bookkeeping done once, at begin
    assert (partial.states[0] - hidden[1][0, 6:10]).abs().max() < ATOL
    early = backend.model.logits(partial.states)  # an early exit at layer 1
    with torch.no_grad():
        early_reference = hf_model.lm_head(hf_model.model.norm(hidden[1][:, 6:10]))
    assert (early - early_reference).abs().max() < ATOL
    cache.advance(partial, 2)
    logits, _ = cache.finish(partial, logits_to_keep=0)
    assert cache.lengths.tolist() == [10]
    assert (logits[0] - expected[6:10]).abs().max() < ATOL
    logits, _ = run(cache, [sequence[10:]], 2)
    assert (logits[0] - expected[10:]).abs().max() < ATOL  # every layer kept its cache entries


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_hidden_layers_use_transformers_indexing(name, models):
    backend, hf_model = models[name]
    sequence = list(range(60, 70))
    _, reference_hidden = reference(hf_model, sequence, hidden=True)
    layers = backend.num_layers
    requested = (0, 1, layers, -1)  # embedding, layer 1, the last (final-normed, as transformers), again
    _, hidden = run(backend.new_cache(1, 16), [sequence], hidden_layers=requested)
    assert hidden.shape == (1, 10, 4, backend.config.hidden_size)
    for slot, index in enumerate(requested):
        assert (hidden[:, :, slot] - reference_hidden[index]).abs().max() < ATOL, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_taps_copied_inside_the_layers_call_are_each_layers_output_bit_for_bit(native_dirs, dtype):
    """Hidden states requested between layers are copied out inside the one kernel call that runs the layers:
    each is, bit for bit, the state of a block run up to that layer and stopped there."""
    model = NativeBackend.load(native_dirs["llama"], dtype=dtype)
    sequence = list(range(60, 70))
    taps = tuple(range(1, model.num_layers))
    assert taps, "the test model needs at least two layers"
    _, hidden = run(model.new_cache(1, 16), [sequence], hidden_layers=taps)
    for slot, index in enumerate(taps):
        block = model.new_cache(1, 16).begin(torch.tensor([sequence]), stop=index)
        assert torch.equal(hidden[0, :, slot], block.states[0]), index


def test_logits_for_chosen_positions(models):
    backend, hf_model = models["mistral"]
    rows = [list(range(80, 88)), list(range(90, 98))]
    expected = torch.stack([reference(hf_model, r) for r in rows])  # [2, 8, V]
    chosen = torch.tensor([[0, 5, 7], [2, 3, 3]])
    cache = backend.new_cache(2, 8)
    logits, _ = run(cache, rows, chosen)
    assert (logits - expected[torch.arange(2)[:, None], chosen]).abs().max() < ATOL
    cache.truncate(torch.tensor([6, 6]))
    logits, _ = run(cache, [r[6:] for r in rows])
    assert logits.shape == (2, 1, backend.vocab_size)
    assert (logits[:, 0] - expected[:, 7]).abs().max() < ATOL


def test_half_precision_runs_close_to_fp32(native_dirs, models):
    backend = NativeBackend.load(native_dirs["qwen3"], dtype=torch.bfloat16)
    sequence = list(range(100, 112))
    logits, _ = run(backend.new_cache(1, 16), [sequence], 0)
    expected = reference(models["qwen3"][1], sequence)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - expected).abs().max() < 0.1 * expected.abs().max()


def test_unsupported_models_are_refused_in_one_line(tmp_path, tokenizer, native_dirs):
    gpt2 = save_tiny(tmp_path / "gpt2", "gpt2", tokenizer)
    gelu = make_variant(tmp_path / "gelu", native_dirs["llama"], {"hidden_act": "gelu"}, ())
    yarn_rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 128}
    yarn = make_variant(tmp_path / "yarn", native_dirs["llama"], {"rope_parameters": yarn_rope}, ())
    pickled = make_variant(tmp_path / "pickled", native_dirs["llama"], {}, ())
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    unknown = make_variant(tmp_path / "unknown", native_dirs["llama"], {"model_type": "no-such-model"}, ())
    for path, why in ((gpt2, "gpt2"), (gelu, "gelu"), (yarn, "yarn"), (unknown, "no-such-model"),
                      (pickled, "safetensors")):
        reason = NativeBackend.supports(path)
        assert reason and why in reason
        if path is not pickled:
            with pytest.raises(UnsupportedModelError) as error:
                NativeBackend.load(path)
            assert "\n" not in str(error.value) and "llama, qwen2, qwen3 or mistral" in str(error.value)
    assert NativeBackend.supports(native_dirs["qwen2"]) is None


def test_sharded_weights(tmp_path, models):
    backend, hf_model = models["qwen2"]
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sequence = list(range(120, 130))
    logits, _ = run(NativeBackend.load(tmp_path).new_cache(1, 16), [sequence], 0)
    assert (logits[0] - reference(hf_model, sequence)).abs().max() < ATOL


def test_backend_describes_itself(models):
    backend, _ = models["tied"]
    assert backend.name == "native" and backend.description == "native/llama"
    assert (backend.num_layers, backend.dtype, backend.device.type) == (2, torch.float32, "cpu")
    assert backend.vocab_size == backend.config.vocab_size


def test_lower_triangle_is_tril():
    from specdec.backends.cache import lower_triangle

    for n in (1, 2, 5, 17):
        assert torch.equal(lower_triangle(n), torch.ones(n, n, dtype=torch.bool).tril())


def test_torch_single_threaded_restores_the_thread_count():
    from specdec.models import kernels

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with kernels.torch_single_threaded():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with kernels.torch_single_threaded(active=False):
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            with kernels.torch_single_threaded():
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["tied", "llama"])
def test_weights_moved_to_huge_pages_give_the_same_bits_and_a_shared_tensor_moves_once(native_dirs, name,
                                                                                         monkeypatch):
    """A model large enough to stream its weights has them copied into one mapping that asks for huge pages
    (kernels.move_to_huge_pages); the tiny model here is moved by lowering the size it takes. The same values
    at other addresses: every logit the same bits as the model left where it was packed."""
    from specdec.models import kernels

    kept = NativeBackend.load(native_dirs[name])
    monkeypatch.setattr(kernels, "HUGE_PAGES_FROM", 0)
    moved = NativeBackend.load(native_dirs[name])
    matrices = [m for layer in moved.model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if kernels.huge_page_arena(1) is not None:  # Linux: every packed weight in the one mapping
        bases = {m.packed.untyped_storage().data_ptr() for m in matrices + [moved.model.head]}
        assert len(bases) == 1
    rows = [[5, 9, 2, 7, 7, 3], [1, 4, 4, 8, 2, 6]]
    assert torch.equal(run(moved.new_cache(2, 16), rows, 6)[0], run(kept.new_cache(2, 16), rows, 6)[0])
    shared = kernels.Matrix.pack(torch.randn(64, 32))
    twin = kernels.Matrix(shared.packed, shared.rows, shared.cols)
    other = kernels.Matrix.pack(torch.randn(64, 32))
    if kernels.move_to_huge_pages([shared, twin, other]):
        assert shared.packed is twin.packed and other.packed.data_ptr() != shared.packed.data_ptr()
    monkeypatch.setattr(kernels, "HUGE_PAGES_FROM", 1 << 40)
    before = other.packed
    assert not kernels.move_to_huge_pages([other]) and other.packed is before  # below the size: left where it is
