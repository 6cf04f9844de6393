"""The shipped Q4_1 file staged on retrieval (G = 3) for its bfloat16 model, as it drafts and with a free tail:
every pass reads its full 3 guesses and the proposal keeps what the last pass confirms past k. Plain decoding
beside them, interleaved prompt by prompt, three rounds, the last two printed; every output checked.

    python docs/measurements/staged_tail_ab.py PROMPTS TOKENS KS      (e.g. 6 64 6,8)
"""
import sys
import torch
from collections import Counter
import specdec
from specdec.backends.target import load_target
from specdec.drafters import DraftModel
from specdec.drafters import draft_model as dm
from specdec.drafters.retrieval import Retrieval
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

def tail_variant():
    """DraftModelSession._propose_staged with two lines changed: every pass reads the full G guesses, and a row
    keeps what a pass confirms even past k (the proposal then holds up to k + G drafts)."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(dm.DraftModelSession._propose_staged))
    changes = {"width = min(self.staged_guesses, int(torch.where(going, k - counts, 0).max()) - 1)":
               "width = self.staged_guesses",
               "new = torch.minimum(kept + 1, k - counts) * going": "new = (kept + 1) * going"}
    for old, new in changes.items():
        assert old in source, old
        source = source.replace(old, new)
    namespace = dict(vars(dm))
    exec(source, namespace)
    return namespace["_propose_staged"]


tail_propose = tail_variant()
original = dm.DraftModelSession._propose_staged
import specdec.engine as eng  # noqa: E402  room in the engine's token buffer for k + G drafts


class Roomy(eng.Sequences):
    def __init__(self, prompts, columns, *args, **kwargs):
        super().__init__(prompts, columns + 8, *args, **kwargs)


eng.Sequences = Roomy
torch.set_num_threads(2)
target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
count, tokens, ks = int(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=target.tokenizer)[:count]]
drafter = DraftModel(zoo_path("smollm2-135m-q4_1"), staged=Retrieval(zoo_path("smollm2-135m/retrieval")), staged_guesses=3)
variants = ["plain"] + [f"{m} k{k}" for k in ks for m in ("base", "tail")]
plain = {}
for round_ in range(3):
    totals = {v: Counter() for v in variants}
    order = variants if round_ % 2 == 0 else variants[::-1]
    for i, text in enumerate(texts):
        for v in order:
            if v == "plain":
                out = specdec.generate(target, [text], max_new_tokens=tokens); plain[i] = out.token_ids
            else:
                mode, k = v.split(); k = int(k[1:])
                dm.DraftModelSession._propose_staged = tail_propose if mode == "tail" else original
                out = specdec.generate(target, [text], drafter=drafter, num_draft_tokens=k, max_new_tokens=tokens)
                assert out.token_ids == plain[i], v
            s = out.stats
            for key, value in (("seconds", s.total_time), ("tokens", s.new_tokens), ("steps", s.target_forwards), ("draft", s.draft_time)):
                totals[v][key] += value
    if round_:
        rate = {v: t["tokens"] / t["seconds"] for v, t in totals.items()}
        print(f"round {round_}: plain {rate['plain']:.1f} tokens/s", flush=True)
        for v in variants[1:]:
            t = totals[v]
            print(f"  {v:10s} {rate[v]:6.1f} tokens/s {rate[v] / rate['plain']:.3f}x steps {t['steps']} drafting {t['draft']:.2f} s", flush=True)
