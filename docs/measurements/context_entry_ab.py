"""A drafter's waiting context entered on its own: every (row, column) of the ragged backlog through the products
(the thirty-seventh session's code) against the valid entries only, as one packed block (``ContextCache.enter_context``).

    python docs/measurements/context_entry_ab.py [ROUNDS]

The committed DSpark folder of the real target, bfloat16, 2 threads; backlogs shaped as the scheduler's probes
met them serving 64 clients (11 rows x 401 columns holding 733 tokens; 3 x 702 holding 802) and one of a single
row (no holes). Interleaved round by round, least of ROUNDS (default 15) per case, milliseconds.
"""
import sys
import time

import torch

from specdec.backends.target import load_target
from specdec.drafters.dspark import DSpark
from specdec.models import kernels, llama
from specdec.zoo import zoo_path

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 15
torch.set_num_threads(2)
kernels.set_threads(2)
target = load_target("smollm2-135m", dtype="bfloat16")
drafter = DSpark(zoo_path("smollm2-135m/dspark"))
runtime = drafter.runtime(target)
generator = torch.Generator().manual_seed(0)


def backlog(rows: int, columns: int, tokens: int):
    """Features [rows, columns, F] and a right-aligned valid mask of ``tokens`` entries: the first row as long
    as the backlog (it set the width), the others sharing the rest."""
    lengths = torch.full((rows,), columns)
    if rows > 1:
        rest = tokens - columns
        lengths[1:] = rest // (rows - 1)
        lengths[1:1 + rest % (rows - 1)] += 1
    valid = torch.arange(columns)[None, :] >= columns - lengths[:, None]
    features = torch.randn(rows, columns, drafter.config.feature_size, generator=generator).to(torch.bfloat16)
    return features, valid


def every_entry(features, valid):
    """The previous code's work: the fused context and each layer's keys and values of every entry."""
    batch, m = valid.shape
    model = runtime.core
    ctx = runtime.context(features.flatten(0, 1))
    kv = llama.new_kv(model, batch, m)
    positions = (valid.cumsum(1) - 1).clamp(min=0).reshape(-1).contiguous()
    work = llama.scratch(model, batch, m)
    params = llama.block_params(model, kv, 0, positions, work)
    for index in range(len(model.layers)):
        llama.layer_keys_values(model, index, ctx, None, params, kv)


def valid_only(features, valid):
    cache = runtime.new_cache(valid.shape[0], valid.shape[1])
    cache.enter_context(features, valid)


cases = {"11 x 401, 733 tokens": backlog(11, 401, 733), "3 x 702, 802 tokens": backlog(3, 702, 802),
         "1 x 400, 400 tokens": backlog(1, 400, 400)}
runtime.core.reserve(1024)
best = {(name, way): float("inf") for name in cases for way in ("every entry", "valid only")}
with kernels.torch_single_threaded(True):
    for _ in range(ROUNDS + 1):
        for name, (features, valid) in cases.items():
            for way, run in (("every entry", every_entry), ("valid only", valid_only)):
                started = time.perf_counter()
                run(features, valid)
                best[name, way] = min(best[name, way], time.perf_counter() - started)
print(f"{kernels.cpu_summary()}; 2 threads; least of {ROUNDS} interleaved rounds")
for name in cases:
    old, new = best[name, "every entry"], best[name, "valid only"]
    print(f"{name}: every entry {1e3 * old:.1f} ms, valid only {1e3 * new:.1f} ms ({new / old:.2f}x)")
