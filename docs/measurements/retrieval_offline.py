"""Retrieval datastores compared offline: drafts scored against the target's greedy continuations.

python docs/measurements/retrieval_offline.py PROMPTS NEW_TOKENS OUT.json NAME=STORE[+STORE][@OPTION=VALUE,...] [...]
(PROMPTS: N, the first N of each task set, or A:B, its A-th to B-th; STORE+STORE: one drafter over two
datastores, those with the longest match drafting; @OPTION=VALUE: Retrieval's options, integers)

The real target (bfloat16, 2 threads) continues PROMPTS_PER_SET held-out prompts each of `sharegpt` and
`humaneval` greedily by NEW_TOKENS tokens (once; kept beside OUT.json). Then, for every generated position
and every datastore, the drafter drafts from the context as it would at that step (chains of k = 2 and 4,
the tree 4/2/6) and the drafts are checked against the greedy tokens that follow: the accepted run at
every position, so tau_k = 1 + its mean (the acceptance length a chain of k drafts gets at that position;
a real run visits only the positions its steps land on) and the share accepted at each depth. No timing:
this measures acceptance only, and may run beside other work.
"""

import json
import sys
from pathlib import Path

import torch

from specdec.backends.hf import load_tokenizer
from specdec.backends.target import load_target
from specdec.decode import GenerationConfig
from specdec.drafters import NoDraft
from specdec.drafters.retrieval import Retrieval, RetrievalSession
from specdec.engine import generate_ids
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

torch.set_num_threads(2)
first, _, last = sys.argv[1].rpartition(":")
first, last = int(first or 0), int(last)
per_set = sys.argv[1].replace(":", "-")
new_tokens, output = int(sys.argv[2]), Path(sys.argv[3])
stores = dict(arg.split("=", 1) for arg in sys.argv[4:])
folder = zoo_path("smollm2-135m")
tokenizer = load_tokenizer(folder)
sets = {name: load_tasks(name, tokenizer=tokenizer)[first:last] for name in ("sharegpt", "humaneval")}
kept = output.with_name(f"{output.stem}-greedy-{per_set}-{new_tokens}.pt")
if kept.is_file():
    greedy = torch.load(kept)
else:
    target = load_target(folder, dtype="bfloat16")
    greedy = {}
    for name, texts in sets.items():
        prompts = target.encode(texts)
        out = generate_ids(target, prompts, NoDraft(), GenerationConfig(max_new_tokens=new_tokens))
        greedy[name] = [(prompt, generated) for prompt, generated in zip(prompts, out.token_ids)]
    torch.save(greedy, kept)


def accepted(tokens, parents, truth):
    """The longest run of ``truth`` that a root path of the draft tree (tokens, parents) spells."""
    best, run = 0, {}
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        depth = 0 if parent < 0 else run.get(parent, -1)
        if depth < 0 or depth >= len(truth) or token != truth[depth]:
            continue
        run[node] = depth + 1
        best = max(best, depth + 1)
    return best


shapes = {"k=2": (2, 1, 2), "k=4": (4, 1, 4), "tree 4/2/6": (4, 2, 6)}
result = {"per_set": per_set, "new_tokens": new_tokens, "stores": stores, "rows": []}
for label, store in stores.items():
    store, _, options = store.partition("@")
    options = {key: int(value) for key, value in (item.split("=") for item in options.split(",") if item)}
    session = RetrievalSession(Retrieval(store.split("+"), **options))
    for name, pairs in greedy.items():
        for shape_name, shape in shapes.items():
            runs = []
            for prompt, generated in pairs:
                sequence = list(prompt) + list(generated)
                for i in range(len(generated) - 1):
                    context = torch.tensor(sequence[: len(prompt) + i])
                    tokens, parents, _ = session._row(context, *shape)
                    runs.append(accepted(tokens, parents, generated[i: i + shape[0]]))
            depths = [sum(r >= d for r in runs) / len(runs) for d in range(1, shape[0] + 1)]
            row = {"store": label, "set": name, "shape": shape_name, "tau": 1 + sum(runs) / len(runs),
                   "accepted_at_depth": [round(d, 3) for d in depths], "positions": len(runs)}
            result["rows"].append(row)
            print(f"{label:>12} {name:>9} {shape_name:>10}  tau {row['tau']:.3f}  depth "
                  f"{' / '.join(f'{d:.3f}' for d in depths)}", flush=True)
output.write_text(json.dumps(result, indent=1) + "\n")
