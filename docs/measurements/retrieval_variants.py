"""Retrieval drafting's node cut (min_score 0, 0.1, 0.25) beside prompt lookup, in one interleaved bench run.

python docs/measurements/retrieval_variants.py PROMPTS_PER_SET NEW_TOKENS OUT.json
(the real target in bfloat16, 2 threads, held-out sharegpt and humaneval prompts, chains k = 2 and 4 and
trees 4/2/6 and 5/3/10; every greedy output is checked equal to plain decoding).
"""

import json
import sys

import torch

from specdec.backends.hf import load_tokenizer
from specdec.backends.target import load_target
from specdec.commands.bench import format_table, run_bench
from specdec.drafters.base import TreeConfig
from specdec.drafters.retrieval import Retrieval
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

torch.set_num_threads(2)
per_set, new_tokens, output = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
folder = zoo_path("smollm2-135m")
tokenizer = load_tokenizer(folder)
texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=tokenizer)[:per_set]]
target = load_target(folder, dtype="bfloat16")
store = zoo_path("smollm2-135m/retrieval")
drafters = tuple(("retrieval", Retrieval(store, min_score=cut)) for cut in (0.0, 0.1, 0.25))
result = run_bench(target, target.encode(texts), ks=[2, 4], max_new_tokens=new_tokens, progress=False,
                   drafters=drafters, trees=(TreeConfig(4, 2, 6), TreeConfig(5, 3, 10)), with_transformers=False,
                   reference_families=("prompt-lookup",))
print(format_table(result))
with open(output, "w") as handle:
    json.dump(result, handle, indent=1)
