"""Where a serving engine's time goes beside the passes: 2 x ROWS held-out ShareGPT prompts (64 new tokens
each) through one engine of at most ROWS rows, plain decoding or the load-aware policy with the shipped Q4_1
file drafting for the bfloat16 target (k = 4); seconds in prefill (the target reading prompts, the caches
built), drafting (the drafter's passes and upkeep) and verification, and tokens/s over the whole run. The
load-aware policy's start-up profile runs before the clock starts.

    python docs/measurements/serve_upkeep.py ROWS MODE        (MODE: plain or load-aware)
    e.g. PYTHONPATH=OLD/src python docs/measurements/serve_upkeep.py 16 load-aware   (another checkout's code)
"""
from __future__ import annotations

import sys
import time

import torch

import specdec
from specdec.backends.target import load_target
from specdec.drafters.draft_model import DraftModel
from specdec.engine import Engine, Request
from specdec.models import kernels
from specdec.schedule import LoadAware
from specdec.zoo.tasks import load_tasks


def main() -> int:
    rows, mode = int(sys.argv[1]), sys.argv[2]
    target = load_target("smollm2-135m", backend="native", dtype="bfloat16")
    kernels.set_threads(2)
    prompts = [target.encode([p])[0] for p in load_tasks("sharegpt", tokenizer=target.tokenizer)[: 2 * rows]]
    drafter = None if mode == "plain" else DraftModel("smollm2-135m-q4_1", dtype=torch.bfloat16)
    engine = Engine(target, drafter, num_draft_tokens=4, max_batch_size=rows,
                    policy=LoadAware() if mode == "load-aware" else None)
    for prompt in prompts:
        engine.add(Request(prompt=list(prompt), max_new_tokens=64))
    started, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += sum(len(update.tokens) for update in engine.step())
    elapsed = time.perf_counter() - started
    stats = engine.stats
    print(f"{specdec.__file__}\n{kernels.cpu_summary()}, 2 threads, {mode}, {len(prompts)} prompts, at most {rows} rows: "
          f"{tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s; prefill {stats.prefill_time:.2f} s, "
          f"drafting {stats.draft_time:.2f} s, verification {stats.verify_time:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
