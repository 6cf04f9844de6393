"""A forward pass with the model's layers in one kernel call (sd_decoder_layers) against one call per layer
(the cache's class given a ``_layer`` of its own, as drafter caches have), interleaved, least of 100, after 200 cached tokens.

    python layers_one_call.py MODEL DTYPE THREADS
"""
import sys, time, torch
from specdec.models import kernels
from specdec.backends.target import load_target
from specdec.backends.native import NativeCache
th = int(sys.argv[3]); torch.set_num_threads(th); kernels.set_threads(th)
b = load_target(sys.argv[1], dtype=sys.argv[2], backend="native").backend
g = torch.Generator().manual_seed(0)
cache = b.new_cache(1, 300)
cache.forward(torch.randint(b.vocab_size, (1, 200), generator=g), None)
classes = {True: type(cache), False: type("LayerByLayer", (type(cache),), {"_layer": lambda self, i, block: NativeCache._layer(self, i, block)})}
for n in (1, 4, 8):
    block = torch.randint(b.vocab_size, (1, n), generator=g)
    best = {True: 1e9, False: 1e9}
    with kernels.torch_single_threaded():
        for _ in range(100):
            for one in (True, False):
                cache.__class__ = classes[one]
                s = time.perf_counter(); cache.forward(block, None, logits_to_keep=n); best[one] = min(best[one], time.perf_counter() - s)
                cache.truncate(cache.lengths - n)
    print(f"n={n}: one call {1e3*best[True]:.3f} ms, a call per layer {1e3*best[False]:.3f} ms, ratio {best[True]/best[False]:.3f}", flush=True)
