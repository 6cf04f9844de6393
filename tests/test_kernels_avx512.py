"""The AVX-512 kernels compute the same bits as the eight-lane (AVX2) and the portable builds.

kernels.c's wide path keeps every output's chain of operations (one FMA chain over k per product
element, the same lane tree per attention score) and only chooses which register holds it, so the
three builds must agree element for element on every shape: rows 1..17 and 64 (one block, two
blocks, several groups of panels), odd column counts (a padded last panel), K not a multiple of 16.
The builds are loaded side by side (each is its own shared library) and swapped into
``kernels._library``; the AVX2 one is this machine's native build with ``-mno-avx512f``.
"""

from __future__ import annotations

import pytest
import torch

from specdec.models import kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


@pytest.fixture(scope="module")
def builds():
    """name -> library: the native build and every other one this machine can run."""
    if kernels.available() is not None:
        pytest.skip(kernels.available())
    libraries = {}
    for library in kernels.builds():
        libraries.setdefault(library.sd_vector().decode(), library)
    if "avx512" not in libraries:
        pytest.skip("this machine's native build has no AVX-512 path")
    return libraries


def each_build(builds, monkeypatch, compute, threads=1):
    """compute() under each build: {name: result}."""
    results = {}
    for name, library in builds.items():
        monkeypatch.setattr(kernels, "_library", library)
        library.sd_set_threads(threads)
        saved = library.sd_parallel_threshold()
        library.sd_set_parallel_threshold(1 if threads > 1 else saved)
        try:
            results[name] = compute()
        finally:
            library.sd_set_threads(torch.get_num_threads())
            library.sd_set_parallel_threshold(saved)
    monkeypatch.undo()
    return results


def assert_same(results):
    first, *rest = results
    for name in rest:
        for a, b in zip(results[first], results[name]):
            assert torch.equal(a, b), (first, name)


def same_arithmetic(builds, dtype):
    """The builds whose products of this dtype are the native build's operations: bfloat16 products
    are dot products of pairs where the CPU has AVX512-BF16 (its own bits), FMA chains elsewhere."""
    if dtype != torch.bfloat16:
        return builds
    native = kernels.library().sd_bf16_dot()
    return {name: lib for name, lib in builds.items() if lib.sd_bf16_dot() == native}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_products_match_across_builds(builds, monkeypatch, dtype):
    if dtype == torch.float16 and not all(lib.sd_has_half() for lib in builds.values()):
        pytest.skip("a build without float16")
    builds = same_arithmetic(builds, dtype)
    if len(builds) < 2:
        pytest.skip("no other build computes this dtype's products the same way (AVX512-BF16 pairs)")
    generator = torch.Generator().manual_seed(11)
    cases = [(k, n) for k in (37, 200) for n in (45, 163)] + [(1000, 325)]  # 1000: groups of 8 panels
    for K, N in cases:
        w = kernels.Matrix.pack(torch.randn(K, N, generator=generator).to(dtype))
        bias = torch.randn(N, generator=generator).to(dtype)
        for M in [*range(1, 18), 64]:
            if K == 1000 and M not in (1, 5, 16, 17, 64):
                continue
            x = torch.randn(M, K, generator=generator).to(dtype)
            residual = torch.randn(M, N, generator=generator).to(dtype)

            def compute():
                return (kernels.linear(x, w), kernels.linear(x, w, bias=bias, residual=residual, norm_eps=1e-5))

            assert_same(each_build(builds, monkeypatch, compute))
            if M in (5, 17, 64):  # panels split between two threads
                assert_same(each_build(builds, monkeypatch, compute, threads=2))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_matches_across_builds(builds, monkeypatch, dtype):
    if dtype == torch.float16 and not all(lib.sd_has_half() for lib in builds.values()):
        pytest.skip("a build without float16")
    generator = torch.Generator().manual_seed(12)
    for dim in (64, 48, 40, 20):  # wide tiles of 4 and 1 registers, eight lanes only, a lane tail
        for n, heads, kv, columns in ((1, 3, 1, 13), (5, 4, 2, 29), (7, 6, 2, 40)):
            q = torch.randn(2, n, heads, dim, generator=generator).to(dtype)
            cache = torch.randn(2, 2, kv, columns + 3, dim, generator=generator).to(dtype)
            keys, values = cache[0, :, :, :columns], cache[1, :, :, :columns]
            visible = torch.rand(2, n, columns, generator=generator) < 0.7
            visible[:, :, 0] = True

            def compute():
                out = torch.empty(2, n, heads * dim, dtype=dtype)
                return (kernels.attention(q, keys, values, visible, out, dim ** -0.5),)

            assert_same(each_build(builds, monkeypatch, compute))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul_matches_across_builds(builds, monkeypatch, dtype):
    if dtype == torch.float16 and not all(lib.sd_has_half() for lib in builds.values()):
        pytest.skip("a build without float16")
    generator = torch.Generator().manual_seed(13)
    for rows, inner in ((1, 8), (3, 37), (16, 96)):  # vector steps of eight and a scalar tail
        gate_up = (torch.randn(rows, 2 * inner, generator=generator) * 6).to(dtype)
        assert_same(each_build(builds, monkeypatch, lambda: (kernels.silu_mul(gate_up),)))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rope_matches_across_builds_and_its_definition(builds, monkeypatch, dtype):
    """Pairs (2i, 2i + 1) rotated as a c - b s and a s + b c, products rounded before the sum: the
    vector loops (eight pairs, four pairs) and the scalar tail alike."""
    if dtype == torch.float16 and not all(lib.sd_has_half() for lib in builds.values()):
        pytest.skip("a build without float16")
    generator = torch.Generator().manual_seed(14)
    for dim in (8, 16, 24, 64, 96):  # vector steps of eight and four pairs and a scalar tail
        x = torch.randn(5, 3, dim, generator=generator).to(dtype)
        table = torch.randn(40, dim // 2, 2, generator=generator)
        positions = torch.tensor([0, 7, 3, 39, 12])

        def compute():
            y = x.clone()
            kernels.rope(y, table, positions)
            return (y,)

        outs = each_build(builds, monkeypatch, compute)
        assert_same(outs)
        pairs, angle = x.float().view(5, 3, dim // 2, 2), table[positions][:, None]
        a, b, c, s = pairs[..., 0], pairs[..., 1], angle[..., 0], angle[..., 1]
        expected = torch.stack([a * c - b * s, a * s + b * c], dim=-1).view(5, 3, dim).to(dtype)
        for name, (rotated,) in outs.items():
            assert torch.equal(rotated, expected), name


def test_bfloat16_pair_products_follow_their_definition():
    """AVX512-BF16's products: column chains over input pairs (0, 1), (2, 3), ... in order, odd K's
    last input alone. On values whose sums are exact in float32 every order agrees, so this pins the
    pairing, the interleaving of the weights and the packing of the inputs, bit for bit."""
    if kernels.available() is not None or not kernels.library().sd_bf16_dot():
        pytest.skip("bfloat16 products are FMA chains on this machine (no AVX512-BF16)")
    generator = torch.Generator().manual_seed(12)
    for K, N in ((1, 17), (2, 16), (37, 45), (200, 163), (1000, 33)):
        w = (torch.randint(-8, 9, (K, N), generator=generator) / 8).bfloat16()
        matrix = kernels.Matrix.pack(w)
        for M in (1, 2, 5, 16, 17, 33):
            x = (torch.randint(-8, 9, (M, K), generator=generator) / 4).bfloat16()
            exact = x.double() @ w.double()  # multiples of 1/32 below 2^15: exact in float32 too
            assert torch.equal(kernels.linear(x, matrix), exact.bfloat16()), (K, N, M)
            for rows in (1, M // 2 + 1):
                assert torch.equal(kernels.linear(x[:rows], matrix), kernels.linear(x, matrix)[:rows])
