"""The shipped Q4_1 file drafting for its bfloat16 model, alone and staged: the draft model's passes by width.

    python docs/measurements/staged_passes.py PROMPTS K GUESSES

PROMPTS held-out prompts of each of sharegpt and humaneval, 128 new tokens, 2 threads; the Q4_1 file drafts k = K
alone (one token a pass), staged on prompt lookup and staged on retrieval (GUESSES guesses a pass). Two rounds, the
second printed: tokens/s, the drafting and verification seconds, and for each width of the draft model's passes
how many ran and their mean time. Every output is checked against plain decoding.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import torch

import specdec
from specdec.backends.native import NativeCache
from specdec.backends.target import load_target
from specdec.drafters import DraftModel
from specdec.drafters.retrieval import Retrieval
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


def main(count: int, k: int, guesses: int) -> None:
    torch.set_num_threads(2)
    target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
    texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=target.tokenizer)[:count]]
    plain = [specdec.generate(target, [text], max_new_tokens=128).token_ids for text in texts]
    copy = zoo_path("smollm2-135m-q4_1")
    variants = {"alone": DraftModel(copy, staged="none"),
                "staged prompt-lookup": DraftModel(copy, staged="prompt-lookup", staged_guesses=guesses),
                "staged retrieval": DraftModel(copy, staged=Retrieval(zoo_path("smollm2-135m/retrieval")),
                                               staged_guesses=guesses)}
    passes, seconds, current = Counter(), Counter(), [None]
    forward = NativeCache.forward

    def timed(cache, tokens, *args, **kwargs):
        started = time.perf_counter()
        out = forward(cache, tokens, *args, **kwargs)
        if cache.model is not target.backend.model and current[0] is not None:
            passes[current[0], tokens.shape[1]] += 1
            seconds[current[0], tokens.shape[1]] += time.perf_counter() - started
        return out

    NativeCache.forward = timed
    for round_ in range(2):
        passes.clear(), seconds.clear()
        for name, drafter in variants.items():
            current[0] = name
            started, totals = time.perf_counter(), Counter()
            for text, expected in zip(texts, plain):
                out = specdec.generate(target, [text], drafter=drafter, num_draft_tokens=k, max_new_tokens=128)
                assert out.token_ids == expected, name
                totals["draft"] += out.stats.draft_time
                totals["verify"] += out.stats.verify_time
                totals["tokens"] += out.stats.new_tokens
            if round_:
                print(f"{name}: {totals['tokens'] / (time.perf_counter() - started):.1f} tokens/s, drafting "
                      f"{totals['draft']:.2f} s, verifying {totals['verify']:.2f} s")
    for (name, width), n in sorted(passes.items()):
        print(f"  {name}, passes of {width} tokens: {n}, {1e3 * seconds[name, width] / n:.2f} ms each")


if __name__ == "__main__":
    main(*(int(value) for value in sys.argv[1:4]))
