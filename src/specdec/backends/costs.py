"""What a forward pass costs: the timing every cost model here starts from (bench, Medusa's tree choice)."""

from __future__ import annotations

import statistics
import time

import torch


def _passes(backend, context: int, widths, rows: int):
    """(time, the context manager the engine's steps run under): ``time(n, hidden_layers)`` is the seconds of
    one forward pass of a block of n random tokens per row, ``rows`` rows, after ``context`` cached random
    tokens (every token live: the pass itself, with the least bookkeeping a cache does); the block's
    columns are dropped after it, so every pass sees the same cache."""
    from specdec.models import kernels

    generator = torch.Generator().manual_seed(0)
    vocab, device = backend.vocab_size, backend.device
    cache = backend.new_cache(rows, context + max(widths) + 8)
    if context:  # a pass of no tokens is no pass (the native cache refuses an empty block)
        cache.forward(torch.randint(vocab, (rows, context), generator=generator).to(device), None)
    blocks = {n: torch.randint(vocab, (rows, n), generator=generator).to(device) for n in widths}

    def time_pass(n: int, hidden_layers: tuple[int, ...] = ()) -> float:
        start = time.perf_counter()
        cache.forward(blocks[n], None, logits_to_keep=n, hidden_layers=hidden_layers)
        elapsed = time.perf_counter() - start
        cache.truncate(cache.lengths - n)
        return elapsed

    return time_pass, kernels.torch_single_threaded(getattr(backend, "name", None) == "native")


def forward_time(backend, n: int, context: int, repeats: int = 15, hidden_layers: tuple[int, ...] = (),
                 rows: int = 1) -> float:
    """Median seconds of one forward pass of n new tokens per row, ``rows`` rows, after ``context`` cached
    tokens (after 3 passes that warm the shape up)."""
    time_pass, engine_threads = _passes(backend, context, [n], rows)
    with engine_threads:
        times = [time_pass(n, hidden_layers) for _ in range(repeats + 3)]
    return statistics.median(times[3:])


def forward_times(backend, widths, context: int, repeats: int = 3, rows: int = 1) -> dict[int, float]:
    """Seconds of one forward pass of n new tokens per row for each n in ``widths`` (``rows`` rows, after
    ``context`` cached tokens): ``least_times`` of the widths."""
    return least_times(backend, {n: (n, ()) for n in widths}, context, repeats, rows)


def least_times(backend, cases: dict, context: int, repeats: int = 3, rows: int = 1) -> dict:
    """Seconds of one forward pass for each case (name -> (n new tokens per row, hidden layers returned);
    ``rows`` rows after ``context`` cached tokens): the cases timed in turn, round after round (the first
    round only warms each shape up), and each case's least time. A slow spell of the machine (another
    thread, a noisy neighbour) then lands on every case alike instead of on one case's consecutive
    passes, and a timing only ever comes out slow, so the least is the pass's own cost."""
    time_pass, engine_threads = _passes(backend, context, sorted({n for n, _ in cases.values()}), rows)
    best = dict.fromkeys(cases, float("inf"))
    with engine_threads:
        for round_ in range(repeats + 1):
            for name, (n, layers) in cases.items():
                elapsed = time_pass(n, tuple(layers))
                if round_:
                    best[name] = min(best[name], elapsed)
    return best


def read_bandwidth(megabytes: int = 512, repeats: int = 3) -> float:
    """Bytes per second a sum over a buffer far larger than the caches streams from memory (torch's
    threads): what reading every weight once per forward pass can at best run at."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_work(model) -> dict:
    """A native model's matrices: bytes stored, multiply-adds per token in float and in int8, and
    whether float ones are bfloat16."""
    from specdec.models.kernels import QMatrix

    matrices = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.head]
    work = {"bytes": 0, "float_macs": 0, "int8_macs": 0, "bfloat16": False}
    for m in matrices:
        work["bytes"] += m.packed.numel() * m.packed.element_size()
        work["int8_macs" if isinstance(m, QMatrix) else "float_macs"] += m.rows * m.cols
        work["bfloat16"] |= not isinstance(m, QMatrix) and m.packed.dtype == torch.bfloat16
    return work


def machine_limit(backend, sizes, context: int) -> dict:
    """The least a forward pass of n tokens can take here: the weights read once at the measured
    bandwidth, or n tokens' multiply-adds at the vector units' measured peak (float32 FMAs for float
    matrices, bfloat16 pair dot products for bfloat16 ones where the CPU has them, int8 dot products
    for quantized ones), whichever is longer; attention's work over
    ``context`` columns is added to the latter."""
    from specdec.models import kernels

    model = backend.model
    work = weight_work(model)
    bandwidth = read_bandwidth()
    peak_float = kernels.peak_macs(False, bfloat16=work["bfloat16"])  # AVX512-BF16 pair dot products where used
    # bfloat16 products on AMX tiles where they run there (their input sizes multiples of 32); attention stays
    # on the vector units
    tiles = work["bfloat16"] and kernels.amx_pairs(model.hidden_size)
    peak_products = kernels.peak_macs(False, tiles=True) if tiles else peak_float
    peak_int8 = kernels.peak_macs(True) if work["int8_macs"] else 0.0
    attention = 2 * len(model.layers) * model.heads * model.head_dim * context
    per_token = (work["float_macs"] / peak_products + attention / peak_float
                 + (work["int8_macs"] / peak_int8 if peak_int8 else 0.0))
    stream = work["bytes"] / bandwidth
    return {"weight_bytes": work["bytes"], "bandwidth_gb_s": bandwidth / 1e9, "peak_float_gmac_s": peak_float / 1e9,
            "peak_tiles_gmac_s": peak_products / 1e9 if tiles else None,
            "peak_int8_gmac_s": peak_int8 / 1e9, "stream_ms": 1e3 * stream,
            "ms": {str(n): 1e3 * max(stream, n * per_token) for n in sizes}}
