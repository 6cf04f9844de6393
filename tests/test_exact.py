"""Bit-for-bit invariance of the native forward pass: a row's results never depend on its block.

Plain decoding computes a row alone; verification computes it behind k drafts, under a tree mask
or beside other rows of a ragged batch with holes and compaction. Every comparison here is
``torch.equal`` (no tolerance), in float32 and bfloat16: the same logits, hidden states and cached
keys and values, whatever the block. The reference is always the row fed one token at a time.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.models import kernels
from specdec.backends.native import NativeBackend
from specdec.commands.tiny import save_tiny
from specdec.verify import ancestor_mask

DTYPES = [torch.float32, torch.bfloat16]
ODD = {"hidden_size": 72, "intermediate_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 18}


def randomise(directory, changes=None, bias=False):
    """Edit a tiny model's config, randomise its norms and optionally add biases."""
    config = json.loads((directory / "config.json").read_text())
    config.update(changes or {})
    (directory / "config.json").write_text(json.dumps(config))
    weights = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name, tensor in weights.items():
        if "norm" in name:
            weights[name] = 1 + 0.3 * torch.randn(tensor.shape, generator=generator)
    if bias:
        for name in [n for n in weights if n.endswith("proj.weight")]:
            weights[name.replace("weight", "bias")] = 0.1 * torch.randn(weights[name].shape[0], generator=generator)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def exact_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("exact")
    dirs = {}
    for arch in ("llama", "qwen2", "qwen3", "mistral"):
        dirs[arch] = randomise(save_tiny(root / arch, arch, tokenizer, init_std=0.15), bias=arch == "qwen2")
    dirs["mistral-window"] = randomise(shutil.copytree(dirs["mistral"], root / "mistral-window"),
                                       {"sliding_window": 5})
    # Sizes that are no multiple of the vector width: every tail of every kernel runs.
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=256,
                         initializer_range=0.15, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, attention_bias=True, mlp_bias=True, **ODD)
    LlamaForCausalLM(config).save_pretrained(root / "odd")
    tokenizer.save_pretrained(root / "odd")
    dirs["odd"] = randomise(root / "odd")
    return dirs


@pytest.fixture(scope="module")
def backends(exact_dirs):
    return {(name, dtype): NativeBackend.load(path, dtype=dtype) for name, path in exact_dirs.items()
            for dtype in DTYPES}


def ones(tokens):
    return torch.ones_like(tokens, dtype=torch.bool)


def one_at_a_time(backend, sequence, capacity=64):
    """Logits [n, V], hidden states [n, L + 1, H] and the cache of a row fed one token at a time."""
    cache = backend.new_cache(1, capacity)
    layers = tuple(range(backend.num_layers + 1))
    logits, hidden = [], []
    for token in sequence:
        out, states = cache.forward(torch.tensor([[token]]), torch.ones(1, 1, dtype=torch.bool), 1, layers)
        logits.append(out[0, -1])
        hidden.append(states[0, -1])
    return torch.stack(logits), torch.stack(hidden), cache


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral-window", "odd"])
def test_blocks_of_every_size_equal_the_row_fed_alone(name, dtype, backends):
    backend = backends[name, dtype]
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, backend.vocab_size, (30,), generator=generator).tolist()
    logits, hidden, alone = one_at_a_time(backend, sequence)
    layers = tuple(range(backend.num_layers + 1))
    context = 9
    for n in range(1, 18):
        if context + n > len(sequence):
            break
        cache = backend.new_cache(1, 64)
        cache.forward(torch.tensor([sequence[:context]]), torch.ones(1, context, dtype=torch.bool))  # a prefill block
        block = torch.tensor([sequence[context:context + n]])
        got, states = cache.forward(block, ones(block), 0, layers)
        stop = context + n
        assert torch.equal(got[0], logits[context:stop]), n
        assert torch.equal(states[0], hidden[context:stop]), n
        assert torch.equal(cache.kv[..., :stop, :], alone.kv[..., :stop, :]), n


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "odd"])
def test_tree_nodes_equal_their_path_fed_alone(name, dtype, backends):
    backend = backends[name, dtype]
    parents = [-1, -1, 0, 1, 0, 2, 3, 2, 5]  # siblings interleaved: a node's ancestors are scattered
    n = len(parents)
    ancestor = ancestor_mask(torch.tensor([parents]), torch.tensor([n]))[0]  # [n, n]
    depth = ancestor.sum(1) - 1
    context = [11, 12, 13, 14, 15, 16, 17]
    nodes = torch.tensor([[40 + i for i in range(n)]])
    cache = backend.new_cache(1, 64)
    cache.forward(torch.tensor([context]), ones(torch.tensor([context])))
    got, _ = cache.forward(nodes, ones(nodes), 0, block_mask=ancestor[None], positions=cache.lengths[:, None] + depth)
    for node in range(n):
        path = [int(nodes[0, i]) for i in range(n) if ancestor[node, i]]
        expected, _, _ = one_at_a_time(backend, context + path)
        assert torch.equal(got[0, node], expected[-1]), node
    # Keep the path to node 8 (nodes 0, 2, 5, 8), drop the other branches, and go on from there.
    path = [0, 2, 5, 8]
    keep = torch.zeros(1, n, dtype=torch.bool)
    keep[0, path] = True
    cache.truncate(cache.lengths - n + len(path), keep=keep)
    follow = torch.tensor([[60, 61, 62]])
    got, _ = cache.forward(follow, ones(follow), 0)
    expected, _, _ = one_at_a_time(backend, context + [40 + i for i in path] + [60, 61, 62])
    assert torch.equal(got[0], expected[-3:])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-window", "odd"])
def test_ragged_batch_rows_equal_each_row_fed_alone(name, dtype, backends):
    """Left padding, rows accepting different counts (holes), compaction and rows leaving."""
    backend = backends[name, dtype]
    vocab = backend.vocab_size
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in (9, 3, 6)]
    alone = [backend.new_cache(1, 96) for _ in rows]

    def feed_alone(b, tokens):
        """Logits of a row's tokens fed one by one on its own cache (then rolled back)."""
        out = []
        for token in tokens:
            logits, _ = alone[b].forward(torch.tensor([[token]]), torch.ones(1, 1, dtype=torch.bool))
            out.append(logits[0, -1])
        return torch.stack(out)

    width = max(map(len, rows))
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    cache = backend.new_cache(3, 96)
    logits, _ = cache.forward(tokens, valid)
    for b, row in enumerate(rows):
        assert torch.equal(logits[b, -1], feed_alone(b, row)[-1]), b
    live = [0, 1, 2]  # which original row each batch row is
    for step in range(8):
        block = torch.randint(0, vocab, (len(live), 5), generator=generator)
        logits, _ = cache.forward(block, ones(block), logits_to_keep=5)
        keep = torch.randint(1, 6, (len(live),), generator=generator)
        for b, original in enumerate(live):
            expected = feed_alone(original, block[b].tolist())
            assert torch.equal(logits[b], expected), (step, b)
            alone[original].truncate(alone[original].lengths - 5 + keep[b])
            rows[original] += block[b, :keep[b]].tolist()
        cache.truncate(cache.lengths - 5 + keep)
        if step % 3 == 2:
            cache.compact(slack=0.0, minimum=0)
        if step == 4:
            cache.select_rows(torch.tensor([0, 2]))
            live = [0, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_threads_split_work_without_changing_a_bit(dtype, backends):
    backend = backends["odd", dtype]
    sequence = list(range(5, 40))
    cache = backend.new_cache(2, 64)
    single, _ = cache.forward(torch.tensor([sequence, sequence[::-1]]), torch.ones(2, 35, dtype=torch.bool), 0)
    library = kernels.library()
    saved = library.sd_parallel_threshold()
    try:
        kernels.set_threads(2)
        library.sd_set_parallel_threshold(1)  # every product and every attention call in parallel
        cache = backend.new_cache(2, 64)
        split, _ = cache.forward(torch.tensor([sequence, sequence[::-1]]), torch.ones(2, 35, dtype=torch.bool), 0)
    finally:
        library.sd_set_parallel_threshold(saved)
        kernels.set_threads(torch.get_num_threads())
    assert torch.equal(single, split)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=["fp32", "bf16", "fp16"])
def test_kernels_match_their_definition(dtype):
    """Each kernel against a float64 reference of what it computes, and row by row invariant."""
    generator = torch.Generator().manual_seed(4)
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    # 200 inputs: the products walk K in pieces; 61 rows: several passes over the weights
    for M, K, N in ((23, 37, 45), (61, 200, 163)):
        x = torch.randn(2 * M, K, generator=generator).to(dtype)
        w = torch.randn(K, N, generator=generator).to(dtype)
        bias = torch.randn(N, generator=generator).to(dtype)
        matrix = kernels.Matrix.pack(w)
        assert torch.equal(matrix.unpack(), w)
        y = kernels.linear(x, matrix, bias=bias, norm_eps=1e-5)
        x64 = x.double()
        ref = (x64 / x64.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()) @ w.double() + bias.double()
        assert torch.allclose(y.double(), ref, atol=tolerance * 10, rtol=tolerance)
        for rows in range(1, M):
            assert torch.equal(kernels.linear(x[rows - 1:rows + rows - 1], matrix, bias=bias, norm_eps=1e-5),
                               y[rows - 1:rows + rows - 1])
    gate_up = torch.randn(5, 2 * 37, generator=generator).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert torch.allclose(kernels.silu_mul(gate_up).double(), torch.nn.functional.silu(gate) * up,
                          atol=tolerance * 10, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_products_without_a_norm_and_past_the_kept_work_memory_keep_each_rows_bits(dtype):
    """Inputs packed straight from the rows (bfloat16 without a norm, odd K), and a block whose work memory
    is too large to keep between calls (allocated for the call alone): every row as computed alone."""
    generator = torch.Generator().manual_seed(5)
    for M, K, N in ((19, 37, 40), (4000, 601, 18)):  # 4000 x 601: over 8 MiB of packed inputs
        x = torch.randn(M, K, generator=generator).to(dtype)
        w = torch.randn(K, N, generator=generator).to(dtype)
        matrix = kernels.Matrix.pack(w)
        y = kernels.linear(x, matrix)
        assert torch.allclose(y.double(), x.double() @ w.double(), atol=0.5 if dtype == torch.bfloat16 else 1e-3,
                              rtol=5e-2 if dtype == torch.bfloat16 else 1e-4)
        for start, rows in ((0, 1), (3, 2), (M - 17, 17), (M // 2, 16)):
            assert torch.equal(kernels.linear(x[start:start + rows], matrix), y[start:start + rows])
        spaced = torch.zeros(M, K + 5, dtype=dtype)  # rows 5 elements apart
        spaced[:, :K] = x
        assert torch.equal(kernels.linear(spaced[:, :K], matrix), y)


def test_bfloat16_panels_with_interleaved_halves_compute_the_plain_layouts_bits(monkeypatch):
    """The AVX2 builds pack bfloat16 panels with each k-row's halves interleaved (widened by a shift and a
    mask): the same products, bit for bit, as the plain layout, in the native build and the portable one;
    a build that does not read them (AVX-512) refuses them in one line."""
    if kernels.available() is not None:
        pytest.skip(kernels.available())
    portable = kernels.load_library(kernels.build(native=False))
    libraries = [kernels.library(), portable]
    if kernels.library().sd_bf16_halves() < 0:
        libraries = [portable]
        halves = kernels.Matrix.pack(torch.randn(40, 24).bfloat16(), halves=True)
        with pytest.raises(ValueError, match="another build"):
            kernels.linear(torch.randn(3, 40).bfloat16(), halves)
    generator = torch.Generator().manual_seed(7)
    for K, N in ((37, 45), (200, 163)):
        w = torch.randn(K, N, generator=generator).bfloat16()
        halves, plain = kernels.Matrix.pack(w, halves=True), kernels.Matrix.pack(w, halves=False, pairs=False)
        assert halves.layout == kernels.HALVES and plain.layout == 0 and halves.packed.shape == plain.packed.shape
        assert torch.equal(halves.unpack(), w) and not torch.equal(halves.packed, plain.packed)
        bias = torch.randn(N, generator=generator).bfloat16()
        for library in libraries:
            monkeypatch.setattr(kernels, "_library", library)
            for M in (*range(1, 8), 17, 64):
                x = torch.randn(M, K, generator=generator).bfloat16()
                assert torch.equal(kernels.linear(x, halves, bias=bias, norm_eps=1e-5),
                                   kernels.linear(x, plain, bias=bias, norm_eps=1e-5)), (M, library.sd_vector())
            monkeypatch.undo()


def test_bfloat16_panels_as_pairs_compute_the_plain_layouts_bits(monkeypatch):
    """Where bfloat16 products are AVX512-BF16 pair dot products, weights of an even input size are packed as
    pairs (no permute per line): the same bits as the plain panels in the same build, every row count, one thread
    or two; a build that does not read such panels refuses them in one line. (66 and 200 inputs: not multiples
    of 32, so an AMX machine computes both on the vector units too.)"""
    if kernels.available() is not None or not kernels.library().sd_bf16_dot():
        pytest.skip("bfloat16 products are not pair dot products here")
    generator = torch.Generator().manual_seed(8)
    library, saved = kernels.library(), kernels.library().sd_parallel_threshold()
    for K, N in ((66, 45), (200, 163)):
        assert kernels.bf16_pairs(K) and not kernels.bf16_pairs(K + 1)
        w = torch.randn(K, N, generator=generator).bfloat16()
        pairs, plain = kernels.Matrix.pack(w), kernels.Matrix.pack(w, pairs=False)
        assert pairs.layout == kernels.PAIRS and plain.layout == 0 and torch.equal(pairs.unpack(), w)
        bias = torch.randn(N, generator=generator).bfloat16()
        for threads in (1, 2):
            kernels.set_threads(threads)
            library.sd_set_parallel_threshold(1)
            try:
                for M in (1, 2, 5, 8, 16, 17, 33):
                    x = torch.randn(M, K, generator=generator).bfloat16()
                    assert torch.equal(kernels.linear(x, pairs, bias=bias, norm_eps=1e-5),
                                       kernels.linear(x, plain, bias=bias, norm_eps=1e-5)), (K, M, threads)
            finally:
                kernels.set_threads(torch.get_num_threads())
                library.sd_set_parallel_threshold(saved)
    monkeypatch.setattr(kernels, "_library", kernels.load_library(kernels.build(native=False)))
    with pytest.raises(ValueError, match="another build"):
        kernels.linear(torch.randn(3, 200).bfloat16(), pairs)


def test_bfloat16_products_on_amx_tiles_keep_each_rows_bits():
    """Where the CPU has AMX-BF16, bfloat16 products with K a multiple of 32 run on the tile unit
    (weights packed as pairs): every row of blocks of 1-17, 33 and 64 rows, one thread or two, with a
    norm, bias and residual or without, has the bits it has alone, and the products stay within
    bfloat16 rounding of the float64 product."""
    if kernels.available() is not None or not kernels.amx_pairs(64):
        pytest.skip("no AMX-BF16 tiles here")
    assert not kernels.amx_pairs(72)  # other sizes keep the AVX-512 code
    generator = torch.Generator().manual_seed(6)
    for K, N in ((64, 40), (576, 200)):
        w = (0.1 * torch.randn(K, N, generator=generator)).bfloat16()
        matrix = kernels.Matrix.pack(w)
        assert matrix.packed.dim() == 4 and torch.equal(matrix.unpack(), w)
        x = torch.randn(64, K, generator=generator).bfloat16()
        bias = torch.randn(N, generator=generator).bfloat16()
        residual = torch.randn(64, N, generator=generator).bfloat16()
        y = kernels.linear(x, matrix)
        assert torch.allclose(y.double(), x.double() @ w.double(), atol=0.05, rtol=2e-2)
        normed = kernels.linear(x, matrix, bias=bias, residual=residual, norm_eps=1e-5)
        library, saved = kernels.library(), kernels.library().sd_parallel_threshold()
        for threads in (1, 2):
            kernels.set_threads(threads)
            library.sd_set_parallel_threshold(1)  # two threads split even one row's columns
            try:
                for rows in [*range(1, 18), 33, 64]:
                    for start in {0, 64 - rows}:
                        part = slice(start, start + rows)
                        assert torch.equal(kernels.linear(x[part], matrix), y[part]), (K, rows, threads)
                        assert torch.equal(kernels.linear(x[part], matrix, bias=bias, residual=residual[part],
                                                          norm_eps=1e-5), normed[part]), (K, rows, threads)
            finally:
                kernels.set_threads(torch.get_num_threads())
                library.sd_set_parallel_threshold(saved)


def test_products_of_mismatched_shapes_are_refused_before_the_kernel_reads_past_a_tensor():
    matrix = kernels.Matrix.pack(torch.randn(8, 24))
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="input of size 24 for a product over 8 inputs"):
        kernels.linear(torch.randn(3, 24), matrix)
    with pytest.raises(ValueError, match="output"):
        kernels.linear(x, matrix, out=torch.empty(2, 24))
    with pytest.raises(ValueError, match="output"):
        kernels.linear(x, matrix, out=torch.empty(3, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        kernels.linear(x, matrix, bias=torch.randn(8))
    with pytest.raises(ValueError, match="residual"):
        kernels.linear(x, matrix, residual=torch.randn(2, 24))
    assert torch.equal(kernels.linear(x, matrix), kernels.linear(x, matrix, out=torch.empty(3, 24)))


def test_vector_and_portable_builds_compute_the_same_bits(backends, monkeypatch):
    """kernels.c's AVX2 code and its plain-C fallback perform the same operations element by element."""
    portable = kernels.load_library(kernels.build(native=False))
    if portable.sd_vector() == kernels.library().sd_vector():
        pytest.skip("the native build of this machine is the portable code as well")
    generator = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        if dtype == torch.bfloat16 and kernels.library().sd_bf16_dot():
            continue  # AVX512-BF16: bfloat16 products are dot products of pairs, their own bits
        backend = backends["odd", dtype]
        rows = torch.randint(0, backend.vocab_size, (2, 21), generator=generator)
        valid = torch.ones_like(rows, dtype=torch.bool)
        valid[1, :6] = False  # left padding
        outputs = []
        for library in (kernels.library(), portable):
            monkeypatch.setattr(kernels, "_library", library)
            cache = backend.new_cache(2, 64)
            logits, hidden = cache.forward(rows, valid, 0, (1, backend.num_layers))
            outputs.append((logits, hidden, cache.kv[..., :cache.columns, :].clone()))  # the columns written
        monkeypatch.undo()
        for vector, plain in zip(*outputs):
            assert torch.equal(vector, plain), dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_attention_rows_keep_their_bits_in_blocks_of_every_size(dtype, monkeypatch):
    """Head size 64 (the real target's): a query row's output is the same alone (the register tile of 1-3
    rows), in a block of 4 (the 4-row tile) and in blocks of 5-7 (both), in the native build and the
    portable one, and close to the definition."""
    portable = kernels.load_library(kernels.build(native=False))
    generator = torch.Generator().manual_seed(8)
    columns = 201
    q = torch.randn(1, 7, 1, 64, generator=generator).to(dtype)
    kv = torch.randn(2, 1, 1, columns, 64, generator=generator).to(dtype)
    blocks = []
    for library in (kernels.library(), portable):
        monkeypatch.setattr(kernels, "_library", library)
        outs = [kernels.attention(torch.empty(1, n, 1, 64, dtype=dtype).copy_(q[:, :n]), kv[0], kv[1], None,
                                  torch.empty(1, n, 64, dtype=dtype), 0.125) for n in range(1, 8)]
        for n, out in enumerate(outs, 1):
            assert torch.equal(out[0], outs[-1][0, :n]), n
        blocks.append(outs[-1])
    monkeypatch.undo()
    native = blocks[0]
    assert torch.equal(native, blocks[1])
    weights = (q[0, :, 0].double() @ kv[0, 0, 0].double().T * 0.125).softmax(-1)
    assert torch.allclose(native[0].double(), weights @ kv[1, 0, 0].double(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_masked_rows_are_each_row_alone_over_the_columns_it_sees(dtype, monkeypatch):
    """A prompt's causal block and a block with holes (9 query heads over 3 key heads, head size 64): each
    query row's output is the bits of that row alone, without a mask, over exactly the columns it sees, in
    the native build and the portable one. Attention stops at a row's last visible column (a causal row
    reads no later key), so this is what stopping early must keep."""
    portable = kernels.load_library(kernels.build(native=False))
    generator = torch.Generator().manual_seed(9)
    n, columns = 70, 90
    q = torch.randn(1, n, 9, 64, generator=generator).to(dtype)
    kv = torch.randn(2, 1, 3, columns, 64, generator=generator).to(dtype)
    causal = torch.ones(1, n, columns, dtype=torch.bool)
    causal[0, :, columns - n:] = torch.ones(n, n, dtype=torch.bool).tril()
    holes = causal.clone()
    holes[0, :, 5:12] = False   # a row that joined late
    holes[0, :, 40:43] = False
    for library in (kernels.library(), portable):
        monkeypatch.setattr(kernels, "_library", library)
        for visible in (causal, holes):
            block = kernels.attention(q, kv[0], kv[1], visible, torch.empty(1, n, 9 * 64, dtype=dtype), 0.125)
            for i in (0, 1, 7, 8, 9, 33, n - 2, n - 1):
                seen = visible[0, i]
                keys, values = kv[0][:, :, seen].contiguous(), kv[1][:, :, seen].contiguous()
                alone = kernels.attention(torch.empty(1, 1, 9, 64, dtype=dtype).copy_(q[:, i:i + 1]), keys, values, None,
                                          torch.empty(1, 1, 9 * 64, dtype=dtype), 0.125)
                assert torch.equal(block[0, i], alone[0, 0]), (i, library)
    monkeypatch.undo()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_attention_rope_and_head_norm_kernels_match_their_definition(dtype):
    generator = torch.Generator().manual_seed(6)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    batch, n, heads, kv, dim, columns = 2, 3, 4, 2, 16, 7
    q = torch.randn(batch, n, heads, dim, generator=generator).to(dtype)
    cache = torch.randn(2, batch, kv, columns + 3, dim, generator=generator).to(dtype)  # capacity > columns
    keys, values = cache[0, :, :, :columns], cache[1, :, :, :columns]
    visible = torch.rand(batch, n, columns, generator=generator) < 0.6
    visible[0, 0] = False  # a query that sees nothing gets zeros
    visible[1, 2] = True
    out = torch.empty(batch, n, heads * dim, dtype=dtype)
    kernels.attention(q, keys, values, visible, out, dim ** -0.5)
    expected = torch.zeros(batch, n, heads, dim, dtype=torch.float64)
    for h in range(heads):
        scores = torch.einsum("bnd,btd->bnt", q[:, :, h].double(), keys[:, h % kv].double()) * dim ** -0.5
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
        expected[:, :, h] = torch.einsum("bnt,btd->bnd", weights, values[:, h % kv].double())
    assert torch.allclose(out.double(), expected.flatten(2), atol=tolerance * 5, rtol=tolerance)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))

    x = torch.randn(5, 3, 8, generator=generator).to(dtype)
    positions = torch.tensor([0, 3, 9, 2, 40])
    angles = torch.arange(64, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
    table = torch.stack([angles.cos(), angles.sin()], -1).contiguous()
    expected = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2))) *
                                  torch.polar(torch.ones(5, 1, 4, dtype=torch.float64), angles[positions, None].double()))
    kernels.rope(x, table, positions)
    assert torch.allclose(x.double(), expected.flatten(-2), atol=tolerance * 10, rtol=tolerance * 10)

    y = torch.randn(4, 3, 8, generator=generator).to(dtype)
    weight = (1 + torch.randn(8, generator=generator)).to(dtype)
    y64 = y.double()
    expected = y64 / y64.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight.double()
    kernels.head_norm(y, weight, 1e-6)
    assert torch.allclose(y.double(), expected, atol=tolerance * 10, rtol=tolerance * 10)
