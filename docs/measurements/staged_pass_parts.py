"""Where a staged pass of the shipped Q4_1 file goes: the draft model's layers, its head, the rest of its forward
(bookkeeping in Python) and the staged loop around it (guesses, the pass's outcome, the cache's rollback).

    python docs/measurements/staged_pass_parts.py [PROMPTS [GUESSER]]

PROMPTS held-out prompts of each of sharegpt and humaneval (default 2), 64 new tokens, k = 8, staged on GUESSER
(prompt-lookup, the default, or retrieval) with 3 guesses a pass, bfloat16 target, 2 threads; two rounds, the
second printed: milliseconds per pass.
"""
import sys
import time
from collections import Counter

import torch

import specdec
from specdec.backends.native import NativeCache
from specdec.backends.target import load_target
from specdec.drafters import DraftModel
from specdec.drafters import draft_model
from specdec.models import llama
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


def main(count: int) -> None:
    torch.set_num_threads(2)
    target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
    texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=target.tokenizer)[:count]]
    drafter = DraftModel(zoo_path("smollm2-135m-q4_1"), staged=(sys.argv[2] if len(sys.argv) > 2 else "prompt-lookup"), staged_guesses=3)
    seconds, calls, inside = Counter(), Counter(), [False]

    def timed(owner, name, key):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if not inside[0]:
                return original(*args, **kwargs)
            started = time.perf_counter()
            out = original(*args, **kwargs)
            seconds[key] += time.perf_counter() - started
            calls[key] += 1
            return out

        setattr(owner, name, wrapper)

    timed(llama, "decoder_layers", "layers")
    timed(type(drafter.backend.model), "logits", "head")
    timed(NativeCache, "forward", "forward")
    staged = draft_model.DraftModelSession._propose_staged

    def loop(self, *args, **kwargs):
        inside[0], started = True, time.perf_counter()
        try:
            return staged(self, *args, **kwargs)
        finally:
            seconds["loop"] += time.perf_counter() - started
            inside[0] = False

    draft_model.DraftModelSession._propose_staged = loop
    for _ in range(2):
        seconds.clear(), calls.clear()
        for text in texts:
            specdec.generate(target, [text], drafter=drafter, num_draft_tokens=8, max_new_tokens=64)
    passes = calls["forward"]
    per = {key: 1e3 * seconds[key] / passes for key in ("loop", "forward", "layers", "head")}
    print(f"{passes} passes, ms per pass: all {per['loop']:.2f} = layers {per['layers']:.2f} + head {per['head']:.2f} "
          f"+ the rest of the forward {per['forward'] - per['layers'] - per['head']:.2f} + the staged loop around it "
          f"{per['loop'] - per['forward']:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
