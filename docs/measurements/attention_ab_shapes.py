"""Attention of the shapes a forward pass of the real target runs, against a build of an earlier kernels.c: 30
layers' calls (9 query heads over 3 key heads, D 64), each layer's cache its own, interleaved, least of ROUNDS, ms.

    python docs/measurements/attention_ab_shapes.py OLD.so [ROUNDS]

Shapes: one decoding row (no mask), a staged draft pass (4 new columns), a verification (9 new columns) and
issue 23's 16-row pass (16 new columns after 200), causal over the new columns; bfloat16 and float32, 2 threads.
"""
import sys
import time

import torch

from specdec.models import kernels

old, new = kernels.load_library(sys.argv[1]), kernels.library()
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
for lib in (old, new):
    lib.sd_set_threads(2)
generator = torch.Generator().manual_seed(0)
print(kernels.cpu_summary(), "2 threads; 30 layers' attention, least of", rounds, "interleaved rounds")
for dtype in (torch.bfloat16, torch.float32):
    for n, columns in ((1, 201), (4, 204), (9, 250), (16, 216)):
        q = torch.randn(1, n, 9, 64, generator=generator).to(dtype)
        caches = [torch.randn(2, 1, 3, columns, 64, generator=generator).to(dtype) for _ in range(30)]
        out = torch.empty(1, n, 9 * 64, dtype=dtype)
        visible = None
        if n > 1:  # causal over the block, every earlier column
            visible = torch.ones(1, n, columns, dtype=torch.bool)
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
        print(f"{str(dtype)[6:]:9s} n={n:3d} T={columns}: old {1e3 * best['old']:.3f} ms, new "
              f"{1e3 * best['new']:.3f} ms ({best['new'] / best['old']:.2f}x); outputs {'identical' if same else 'DIFFER'}",
              flush=True)
kernels._library = new
