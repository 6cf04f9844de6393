"""tau and tokens/s of every zoo drafter when sampling (code-completion, 20 prompts, 128 tokens, 1 thread).

usage: python docs/measurements/sampled_tau.py TEMPERATURE > out.json
"""

import json
import sys

import torch

import specdec
from specdec.drafters import DFlash, DraftModel, Eagle, Medusa, NoDraft
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

torch.set_num_threads(1)
temperature = float(sys.argv[1])
target = specdec.load_target(zoo_path("target"), backend="native")
prompts = target.encode(load_tasks("code-completion")[:20])
methods = [("plain", NoDraft(), 1), ("draft-model k=4", DraftModel(zoo_path("draft")), 4),
           ("medusa", Medusa(zoo_path("medusa")), 1), ("eagle k=4", Eagle(zoo_path("eagle")), 4),
           ("eagle3 k=4", Eagle(zoo_path("eagle3")), 4), ("eagle3 k=6", Eagle(zoo_path("eagle3")), 6),
           ("dflash block 4", DFlash(zoo_path("dflash")), 3), ("dflash block 8", DFlash(zoo_path("dflash")), 7)]
rows = {}
for name, drafter, k in methods:
    specdec.generate(target, prompts[:1], drafter=drafter, num_draft_tokens=k, max_new_tokens=16,
                     temperature=temperature)  # warm-up
    tokens = seconds = steps = committed = 0
    for seed, prompt in enumerate(prompts):
        stats = specdec.generate(target, [prompt], drafter=drafter, num_draft_tokens=k, max_new_tokens=128,
                                 temperature=temperature, seed=seed).stats
        tokens, seconds = tokens + stats.new_tokens, seconds + stats.total_time
        steps, committed = steps + stats.verify_steps, committed + stats.tokens_from_steps
    rows[name] = {"tau": committed / steps if steps else None, "tokens_per_second": tokens / seconds}
base = rows["plain"]["tokens_per_second"]
for row in rows.values():
    row["speedup_vs_plain"] = row["tokens_per_second"] / base
print(json.dumps({"temperature": temperature, "prompts": len(prompts), "max_new_tokens": 128, "rows": rows}, indent=1))
