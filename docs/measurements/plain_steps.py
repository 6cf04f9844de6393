"""What a drafter costs the steps that do not draft: every step plain (a policy that never drafts,
``static:1=0``), the real target in bfloat16, greedy, 2 threads; tokens/s and the drafter's time per step
(``Stats.draft_time``: its ``observe`` and the features' hand-over), drafters interleaved prompt by prompt.

    python docs/measurements/plain_steps.py DRAFTERS BATCH PROMPTS [ROUNDS]
    e.g. python docs/measurements/plain_steps.py none,eagle,eagle3,mtp,dspark 16 4

DRAFTERS: registry names of the committed smollm2-135m folders (none: no drafter); BATCH: prompts per
generation; PROMPTS: held-out prompts of each of sharegpt and humaneval (generations of BATCH of them,
round-robin); 128 new tokens.
"""
from __future__ import annotations

import argparse
import sys

import torch

import specdec
from specdec.decode import GenerationConfig
from specdec.drafters.registry import build
from specdec.engine import generate_ids
from specdec.models import kernels
from specdec.schedule import StaticTable
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

torch.set_num_threads(2)
names, batch, count = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
target = specdec.load_target("smollm2-135m", dtype=torch.bfloat16)
options = argparse.Namespace(backend="auto", dtype="bfloat16")
drafters = {name: build(name, None if name == "none" else zoo_path(f"smollm2-135m/{name}"), options) for name in names}
prompts = target.encode([p for task in ("sharegpt", "humaneval") for p in load_tasks(task, tokenizer=target.tokenizer)[:count]])
batches = [[prompts[(start + i) % len(prompts)] for i in range(batch)] for start in range(0, len(prompts), batch)]
config = GenerationConfig(max_new_tokens=128, num_draft_tokens=2)
totals = {name: [0, 0.0, 0.0, 0] for name in names}
for _ in range(rounds):
    for chunk in batches:
        for name, drafter in drafters.items():
            stats = generate_ids(target, chunk, drafter, config, policy=StaticTable({1: 0})).stats
            entry = totals[name]
            entry[0] += stats.new_tokens
            entry[1] += stats.total_time
            entry[2] += stats.draft_time
            entry[3] += stats.target_forwards
print(f"{kernels.cpu_summary()}, 2 threads, batch {batch}, {len(batches) * rounds} generations of 128 tokens")
for name, (tokens, seconds, drafting, steps) in totals.items():
    print(f"{name}: {tokens / seconds:.1f} tokens/s, drafter {1e3 * drafting / steps:.3f} ms a step")
