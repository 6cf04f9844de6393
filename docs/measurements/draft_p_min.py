"""The drafter's confidence cut (llama.cpp's --draft-p-min) on the real target: settings interleaved prompt by
prompt, every output compared with plain decoding.

    python docs/measurements/draft_p_min.py DRAFTER PROMPTS SETTINGS [OUT.json]
    e.g. python docs/measurements/draft_p_min.py eagle3 10 "2@-,4@0.2,4@0.3,6@0.3"

DRAFTER: eagle, eagle3, draft (the committed smollm2-135m folders) or q4_1 (the shipped Q4_1 file as draft model);
PROMPTS: held-out prompts of each of sharegpt and humaneval; SETTINGS: k@p_min, "-" for no cut. bfloat16
target, 2 threads, 128 new tokens, greedy, batch 1.
"""
from __future__ import annotations

import json
import sys

import torch

import specdec
from specdec.drafters import DraftModel, Eagle
from specdec.models import kernels
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

torch.set_num_threads(2)
name, count = sys.argv[1], int(sys.argv[2])
settings = [(int(k), None if p == "-" else float(p)) for k, p in (s.split("@") for s in sys.argv[3].split(","))]
target = specdec.load_target("smollm2-135m", dtype=torch.bfloat16)


def drafter(p_min):
    if name == "q4_1":
        return DraftModel("smollm2-135m-q4_1", p_min=p_min)
    if name == "draft":  # the distilled draft model, in the target's dtype
        return DraftModel(zoo_path("smollm2-135m/draft"), dtype=torch.bfloat16, p_min=p_min)
    return Eagle(zoo_path(f"smollm2-135m/{name}"), p_min=p_min)


drafters = {p: drafter(p) for p in {p for _, p in settings}}
prompts = [p for task in ("sharegpt", "humaneval") for p in load_tasks(task, tokenizer=target.tokenizer)[:count]]
specdec.generate(target, [prompts[0]], drafters[settings[0][1]], num_draft_tokens=2, max_new_tokens=16)  # warm-up
totals = {s: {"tokens": 0, "seconds": 0.0, "steps": 0, "drafted": 0, "accepted": 0, "draft_seconds": 0.0,
              "identical": 0} for s in [(0, None)] + settings}
for prompt in prompts:
    plain = specdec.generate(target, [prompt], max_new_tokens=128)
    totals[0, None]["tokens"] += plain.stats.new_tokens
    totals[0, None]["seconds"] += plain.stats.total_time
    for k, p_min in settings:
        out = specdec.generate(target, [prompt], drafters[p_min], num_draft_tokens=k, max_new_tokens=128)
        entry, stats = totals[k, p_min], out.stats
        entry["tokens"] += stats.new_tokens
        entry["seconds"] += stats.total_time
        entry["steps"] += stats.target_forwards
        entry["drafted"] += stats.drafts_proposed
        entry["accepted"] += stats.drafts_accepted
        entry["draft_seconds"] += stats.draft_time
        entry["identical"] += out.token_ids == plain.token_ids
plain_speed = totals[0, None]["tokens"] / totals[0, None]["seconds"]
rows = []
print(f"{name}: plain {plain_speed:.1f} tokens/s, {len(prompts)} prompts")
for k, p_min in settings:
    e = totals[k, p_min]
    speed = e["tokens"] / e["seconds"]
    row = {"k": k, "p_min": p_min, "tokens_per_second": speed, "vs_plain": speed / plain_speed,
           "tau": e["tokens"] / e["steps"], "drafts_per_step": e["drafted"] / e["steps"],
           "acceptance_rate": e["accepted"] / max(1, e["drafted"]), "draft_ms_per_step": 1e3 * e["draft_seconds"] / e["steps"],
           "identical": f"{e['identical']}/{len(prompts)}"}
    rows.append(row)
    print(f"k={k} p_min={p_min}: {speed:.1f} tokens/s {row['vs_plain']:.3f}x, tau {row['tau']:.2f}, "
          f"{row['drafts_per_step']:.2f} drafts a step ({row['acceptance_rate']:.2f} accepted), "
          f"drafting {row['draft_ms_per_step']:.2f} ms a step, identical {row['identical']}")
if len(sys.argv) > 4:
    with open(sys.argv[4], "w") as file:
        json.dump({"drafter": name, "prompts": len(prompts), "plain_tokens_per_second": plain_speed, "rows": rows,
                   "cpu": kernels.cpu_summary(), "threads": 2}, file, indent=1)
