"""The real target's 30 layers over a 5-token block after 200 cached tokens (bfloat16, 2 threads), three ways: one kernel
call copying out the hidden states after layers 2, 15 and 27 inside it (how taps run now), one call with no taps,
and four calls split at the taps (how they ran before); least of 300 interleaved runs each, ms.

    python docs/measurements/taps_one_call.py
"""
import time, torch
from specdec.models import kernels, llama
from specdec.backends.target import load_target
from specdec.zoo import zoo_path
torch.set_num_threads(2); kernels.set_threads(2)
b = load_target(zoo_path("smollm2-135m"), dtype="bfloat16", backend="native").backend
g = torch.Generator().manual_seed(0)
cache = b.new_cache(1, 300)
cache.forward(torch.randint(b.vocab_size, (1, 200), generator=g), None)
blk = torch.randint(b.vocab_size, (1, 5), generator=g)
model = b.model
best = {"one": 1, "segments": 1, "none": 1}
with kernels.torch_single_threaded():
    for r in range(300):
        for name in best:
            block = cache.begin(blk, torch.ones_like(blk, dtype=torch.bool), stop=0)
            s = time.perf_counter()
            if name == "one":
                taps = {t: torch.empty_like(block.hidden) for t in (2, 15, 27)}
                llama.decoder_layers(model, 0, 30, block.hidden, block.params, cache.kv, block.masks, taps)
            elif name == "none":
                llama.decoder_layers(model, 0, 30, block.hidden, block.params, cache.kv, block.masks)
            else:
                h = block.hidden
                for a, e in ((0, 2), (2, 15), (15, 27), (27, 30)):
                    h = llama.decoder_layers(model, a, e, h, block.params, cache.kv, block.masks)
            t = time.perf_counter() - s
            cache.truncate(cache.lengths - 5)
            best[name] = min(best[name], t)
print({k: round(v * 1e3, 3) for k, v in best.items()})
