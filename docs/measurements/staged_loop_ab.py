"""A staged draft model's loop (the demo's leading method) in two versions of draft_model.py in one process: per
staged call, the time outside the draft model's forward passes (the guesses, the pass's outcome, the bookkeeping),
the versions taking turns generation by generation; 4 rounds of 2 held-out prompts each of sharegpt and humaneval,
64 new tokens, k = 8, staged on retrieval with 3 guesses a pass, bfloat16, 2 threads.

    git show COMMIT:src/specdec/drafters/draft_model.py > /tmp/old_draft_model.py
    python docs/measurements/staged_loop_ab.py /tmp/old_draft_model.py
"""
import importlib.util
import sys
import time
from collections import Counter

import torch

import specdec
from specdec.backends.native import NativeCache
from specdec.backends.target import load_target
from specdec.drafters import DraftModel, draft_model
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

spec = importlib.util.spec_from_file_location("old_draft_model", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules["old_draft_model"] = old  # dataclasses look their module up
spec.loader.exec_module(old)
torch.set_num_threads(2)
target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=target.tokenizer)[:2]]
drafter = DraftModel(zoo_path("smollm2-135m-q4_1"), staged="retrieval", staged_guesses=3, dtype=torch.bfloat16)
loops, passes, calls = Counter(), Counter(), Counter()
versions = {"old": old.DraftModelSession._propose_staged, "new": draft_model.DraftModelSession._propose_staged}
side, inside, forward = ["new"], [False], NativeCache.forward


def timed_forward(*args, **kwargs):
    if not inside[0]:
        return forward(*args, **kwargs)
    started = time.perf_counter()
    try:
        return forward(*args, **kwargs)
    finally:
        passes[side[0]] += time.perf_counter() - started


def timed_loop(*args, **kwargs):
    inside[0], started = True, time.perf_counter()
    try:
        return versions[side[0]](*args, **kwargs)
    finally:
        inside[0] = False
        loops[side[0]] += time.perf_counter() - started
        calls[side[0]] += 1


NativeCache.forward = timed_forward
draft_model.DraftModelSession._propose_staged = timed_loop
outputs = {}
for _ in range(4):
    for name in ("old", "new"):
        side[0] = name
        for text in texts:
            outputs[name, text] = specdec.generate(target, [text], drafter=drafter, num_draft_tokens=8,
                                                   max_new_tokens=64).token_ids
print("ms a staged call outside the draft model's passes:",
      {k: f"{1e3 * (loops[k] - passes[k]) / calls[k]:.3f} over {calls[k]} calls" for k in loops},
      "outputs", "identical" if all(outputs["old", t] == outputs["new", t] for t in texts) else "DIFFER")
