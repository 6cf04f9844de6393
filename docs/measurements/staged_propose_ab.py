"""Retrieval's guesses for a staged draft model (the demo's leading method), two versions of prompt_lookup.py in one
process: each generation's RetrievalSession.propose calls timed, the versions taking turns, 4 rounds of 2 held-out
prompts each of sharegpt and humaneval, 64 new tokens, k = 8, 3 guesses a pass, bfloat16, 2 threads.

    git show COMMIT:src/specdec/drafters/prompt_lookup.py > /tmp/old_pl.py
    python docs/measurements/staged_propose_ab.py /tmp/old_pl.py
"""
import importlib.util
import sys
import time
from collections import Counter

import torch

import specdec
from specdec.backends.target import load_target
from specdec.drafters import DraftModel, retrieval, prompt_lookup as new_pl
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

spec = importlib.util.spec_from_file_location("old_pl", sys.argv[1])
old_pl = importlib.util.module_from_spec(spec)
sys.modules["old_pl"] = old_pl  # dataclasses look their module up
spec.loader.exec_module(old_pl)
torch.set_num_threads(2)
target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=target.tokenizer)[:2]]
drafter = DraftModel(zoo_path("smollm2-135m-q4_1"), staged="retrieval", staged_guesses=3, dtype=torch.bfloat16)
secs, calls, side = Counter(), Counter(), ["new"]
propose = retrieval.RetrievalSession.propose


def timed(*args, **kwargs):
    started = time.perf_counter()
    out = propose(*args, **kwargs)
    secs[side[0]] += time.perf_counter() - started
    calls[side[0]] += 1
    return out


retrieval.RetrievalSession.propose = timed
outputs = {}
for _ in range(4):
    for name, module in (("old", old_pl), ("new", new_pl)):
        side[0] = name
        retrieval.tree_proposal, retrieval.lookup_many = module.tree_proposal, module.lookup_many
        for text in texts:
            outputs[name, text] = specdec.generate(target, [text], drafter=drafter, num_draft_tokens=8,
                                                   max_new_tokens=64).token_ids
print("ms a propose call:", {k: f"{1e3 * secs[k] / calls[k]:.3f} over {calls[k]}" for k in secs},
      "outputs", "identical" if all(outputs["old", t] == outputs["new", t] for t in texts) else "DIFFER")
