"""Attention against a build of an earlier kernels.c: 30 layers' calls (9 query heads over 3 key heads, D 64), each
layer's cache its own, interleaved, least of ROUNDS, ms; bfloat16 and float32, 2 threads.

    python docs/measurements/attention_reach_ab.py OLD.so [ROUNDS] [SHAPES]

SHAPES "reach" (the default; the thirty-eighth session): a prompt's causal block (n = T), a verification block
(n new columns after T - n), and decoding (one column, no mask), for one row and for a served batch of 16 rows.
SHAPES "pass" (the thirty-ninth session): the blocks a forward pass of the real target runs, one decoding row, a
staged draft pass (4 new columns), a verification (9) and issue 23's 16-row pass, causal over the new columns.
"""
import sys
import time

import torch

from specdec.models import kernels

SHAPES = {  # (label, batch, new columns n, columns T)
    "reach": (("prompt", 1, 166, 166), ("prompt", 1, 500, 500), ("verify", 1, 9, 250), ("decode", 1, 1, 400),
              ("decode", 16, 1, 400)),
    "pass": (("decode", 1, 1, 201), ("draft", 1, 4, 204), ("verify", 1, 9, 250), ("block", 1, 16, 216)),
}
old, new = kernels.load_library(sys.argv[1]), kernels.library()
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
shapes = SHAPES[sys.argv[3] if len(sys.argv) > 3 else "reach"]
for lib in (old, new):
    lib.sd_set_threads(2)
generator = torch.Generator().manual_seed(0)
print(kernels.cpu_summary(), "2 threads; 30 layers' attention, least of", rounds, "interleaved rounds")
for dtype in (torch.bfloat16, torch.float32):
    for label, batch, n, columns in shapes:
        q = torch.randn(batch, n, 9, 64, generator=generator).to(dtype)
        caches = [torch.randn(2, batch, 3, columns, 64, generator=generator).to(dtype) for _ in range(30)]
        out = torch.empty(batch, n, 9 * 64, dtype=dtype)
        visible = None
        if n > 1:  # causal over the block, every earlier column
            visible = torch.ones(batch, n, columns, dtype=torch.bool)
            visible[:, :, columns - n:] = torch.ones(n, n, dtype=torch.bool).tril()
        best, outs = {}, {}
        for round_ in range(rounds):
            for name, lib in (("old", old), ("new", new)) if round_ % 2 else (("new", new), ("old", old)):
                kernels._library = lib
                started = time.perf_counter()
                for kv in caches:
                    kernels.attention(q, kv[0], kv[1], visible, out, 0.125)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
                outs[name] = out.clone()
        same = torch.equal(outs["old"], outs["new"])
        print(f"{str(dtype)[6:]:9s} {label} B={batch:2d} n={n:3d} T={columns}: old {1e3 * best['old']:.3f} ms, new "
              f"{1e3 * best['new']:.3f} ms ({best['new'] / best['old']:.2f}x); outputs {'identical' if same else 'DIFFER'}",
              flush=True)
kernels._library = new
