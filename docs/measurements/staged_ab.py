"""A staged draft model (the demo's leading method: the Q4_1 file drafting k = 8 staged on retrieval, 3 guesses a
pass, bfloat16, 2 threads) with one of its Python files in two versions in one process, the versions taking turns
generation by generation; 4 rounds (after one that warms up) of 2 held-out prompts each of sharegpt and humaneval, 64 new tokens.

    git show COMMIT:src/specdec/drafters/prompt_lookup.py > /tmp/old_pl.py
    python docs/measurements/staged_ab.py propose /tmp/old_pl.py
    git show COMMIT:src/specdec/drafters/draft_model.py > /tmp/old_draft_model.py
    python docs/measurements/staged_ab.py loop /tmp/old_draft_model.py

propose: OLD is a prompt_lookup.py; retrieval's guesses (RetrievalSession.propose) timed a call, its lookups and
chain proposals from either version. loop: OLD is a draft_model.py; the staged loop's time outside the draft
model's forward passes a staged call, the loop from either version.
"""
import importlib.util
import sys
import time
from collections import Counter

import torch

import specdec
from specdec.backends.native import NativeCache
from specdec.backends.target import load_target
from specdec.drafters import DraftModel, draft_model, prompt_lookup, retrieval
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

mode, path = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("old_version", path)
old = importlib.util.module_from_spec(spec)
sys.modules["old_version"] = old  # dataclasses look their module up
spec.loader.exec_module(old)
torch.set_num_threads(2)
target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=target.tokenizer)[:2]]
drafter = DraftModel(zoo_path("smollm2-135m-q4_1"), staged="retrieval", staged_guesses=3, dtype=torch.bfloat16)
spent, excluded, calls, side, inside = Counter(), Counter(), Counter(), ["new"], [False]


def timed(function):
    """``function`` with its time added under the running version, the forward passes inside it marked."""
    def wrapper(*args, **kwargs):
        inside[0], started = True, time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            inside[0] = False
            spent[side[0]] += time.perf_counter() - started
            calls[side[0]] += 1
    return wrapper


if mode == "propose":
    retrieval.RetrievalSession.propose = timed(retrieval.RetrievalSession.propose)
    versions = {"old": old, "new": prompt_lookup}

    def use(name):
        retrieval.tree_proposal, retrieval.lookup_many = versions[name].tree_proposal, versions[name].lookup_many
else:
    forward = NativeCache.forward

    def timed_forward(*args, **kwargs):  # the draft model's passes inside the loop, taken off its time
        if not inside[0]:
            return forward(*args, **kwargs)
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            excluded[side[0]] += time.perf_counter() - started

    NativeCache.forward = timed_forward
    versions = {"old": timed(old.DraftModelSession._propose_staged),
                "new": timed(draft_model.DraftModelSession._propose_staged)}

    def use(name):
        draft_model.DraftModelSession._propose_staged = versions[name]

outputs = {}
for round_ in range(5):  # the first round only warms up (the datastore's pages, the shapes)
    if round_ == 1:
        spent.clear(), excluded.clear(), calls.clear()
    for name in ("old", "new"):
        side[0] = name
        use(name)
        for text in texts:
            outputs[name, text] = specdec.generate(target, [text], drafter=drafter, num_draft_tokens=8,
                                                   max_new_tokens=64).token_ids
what = "a propose call" if mode == "propose" else "a staged call outside the draft model's passes"
print(f"ms {what}:", {k: f"{1e3 * (spent[k] - excluded[k]) / calls[k]:.3f} over {calls[k]} calls" for k in spent},
      "outputs", "identical" if all(outputs["old", t] == outputs["new", t] for t in texts) else "DIFFER")
