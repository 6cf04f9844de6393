"""The shipped Q4_1 file drafting for its float model, taking the prompt's keys and values from the target's
cache (DraftModel's default for a copy of the target) against reading the prompt itself (reuse_prompt=False),
beside plain decoding: held-out sharegpt and humaneval prompts, batch 1, the three interleaved per prompt,
best of REPEATS runs per prompt; tokens/s over whole generations (prefill included, as bench counts them).

    python docs/measurements/draft_prompt_ab.py DTYPE K MAX_NEW_TOKENS NUM_PROMPTS REPEATS
    e.g. python docs/measurements/draft_prompt_ab.py bfloat16 4 64 4 2
"""
from __future__ import annotations

import sys
import time

from specdec.backends.target import load_target
from specdec.drafters.draft_model import DraftModel
from specdec.engine import generate
from specdec.models import kernels
from specdec.zoo.tasks import load_tasks


def main() -> int:
    dtype, k, new, count, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    target = load_target("smollm2-135m", backend="native", dtype=dtype)
    kernels.set_threads(2)
    prompts = [p for task in ("sharegpt", "humaneval") for p in load_tasks(task, tokenizer=target.tokenizer)[:count]]
    methods = {"plain": None, "prompt from the target": DraftModel("smollm2-135m-q4_1"),
               "reads the prompt": DraftModel("smollm2-135m-q4_1", reuse_prompt=False)}
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    for prompt in prompts:
        ids = target.encode([prompt])
        best, outputs = {}, {}
        for _ in range(repeats):
            for name, drafter in methods.items():
                start = time.perf_counter()
                out = generate(target, ids, drafter, num_draft_tokens=k, max_new_tokens=new)
                elapsed = time.perf_counter() - start
                if elapsed < best.get(name, (float("inf"),))[0]:
                    best[name] = (elapsed, len(out.token_ids[0]))
                outputs[name] = out.token_ids
        assert all(o == outputs["plain"] for o in outputs.values()), "outputs differ from plain decoding"
        for name, (elapsed, n) in best.items():
            seconds[name] += elapsed
            tokens[name] += n
        print(f"prompt of {len(ids[0])} tokens: " + "  ".join(f"{name} {best[name][1] / best[name][0]:.1f} tok/s"
                                                               for name in methods), flush=True)
    plain = tokens["plain"] / seconds["plain"]
    print(f"{kernels.cpu_summary()}, 2 threads, {dtype} target, k={k}, {new} new tokens, {len(prompts)} prompts, "
          f"best of {repeats}; every output equal to plain decoding")
    for name in methods:
        rate = tokens[name] / seconds[name]
        print(f"{name:24s} {rate:7.1f} tokens/s  {rate / plain:.2f}x plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
