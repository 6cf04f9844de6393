"""Where a block drafter's step goes: per-call medians of its parts over four generations of one chat request (the
real target in bfloat16, 128 new tokens, 2 threads), each part timed by a wrapper around it.
python docs/measurements/drafting_parts.py dflash|dspark K"""
import collections
import sys
import time

import torch

import specdec
import specdec.drafters.dflash as drafter_module
import specdec.models.dflash as network
from specdec.drafters.registry import build
from specdec.models import kernels, llama
from specdec.zoo import zoo_path

torch.set_num_threads(2)
kernels.set_threads(2)
times = collections.defaultdict(list)


def timed(owner, name, label):
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        times[label].append(time.perf_counter() - start)
        return result
    setattr(owner, name, wrapper)


method, k = sys.argv[1], int(sys.argv[2])
parts = [(llama, "decoder_layer_from", "a drafter layer"), (network.ContextCache, "draft", "the cache's block pass"),
         (network.DFlashRuntime, "context", "fused context"), (network.DFlashRuntime, "logits", "head"),
         (drafter_module.DFlashSession, "enter", "enter")]
if method == "dspark":
    import specdec.drafters.dspark as dspark_drafter
    import specdec.models.dspark as dspark_network
    parts += [(dspark_network.DSparkRuntime, "greedy_chain", "Markov chain"),
              (dspark_network.DSparkRuntime, "confidences", "confidences"),
              (dspark_drafter.DSparkSession, "propose", "propose")]
else:
    parts.append((drafter_module.DFlashSession, "propose", "propose"))
for owner, name, label in parts:
    timed(owner, name, label)
target = specdec.load_target("smollm2-135m", dtype="bfloat16", backend="native")
drafter = build(method, zoo_path(f"smollm2-135m/{method}"))
prompt = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, with a "
                                      "docstring and three test cases."}]
for _ in range(4):
    specdec.generate(target, [prompt], drafter, num_draft_tokens=k, max_new_tokens=128)
for label, values in times.items():
    values = sorted(values)
    print(f"{label:24s} calls {len(values):5d}  median {1e3 * values[len(values) // 2]:.3f} ms")
