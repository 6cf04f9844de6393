"""The load-aware policy's steps in a served process: `specdec bench-serve` in process with the Q4_1 file
drafting for the bfloat16 target (k = 4; or the drafter options given after CLIENTS), CLIENTS clients (default
1), 3 requests of 64 tokens each, every step of the fixed and load-aware policies logged (rows, drafts per row,
drafting and step milliseconds), then the load-aware policy's profile, acceptance estimates, drafting costs and
rates.

    python docs/measurements/serve_policy_trace.py MODES [CLIENTS [DRAFTER OPTIONS]]
    e.g. python docs/measurements/serve_policy_trace.py plain,fixed,load-aware
         python docs/measurements/serve_policy_trace.py plain,load-aware 4 --drafter eagle3 --draft DIR
"""
from __future__ import annotations

import collections
import gc
import sys

from specdec import schedule
from specdec.commands.cli import main

log = []


def logged(policy, engine, group, width, proposed, accepted, timing):
    log.append((type(policy).__name__, group.size, width, 1e3 * timing["draft"], 1e3 * timing["step"]))


fixed_observe, aware_observe = schedule.FixedK.observe, schedule.LoadAware.observe
schedule.FixedK.observe = lambda self, *args: logged(self, *args) or fixed_observe(self, *args)
schedule.LoadAware.observe = lambda self, *args: logged(self, *args) or aware_observe(self, *args)

clients = sys.argv[2] if len(sys.argv) > 2 else "1"
drafter = sys.argv[3:] or ["--drafter", "draft-model", "--draft", "smollm2-135m-q4_1", "-k", "4"]
main(["bench-serve", "--target", "smollm2-135m", "--dtype", "bfloat16", *drafter, "--modes", *sys.argv[1].split(","),
      "--concurrency", clients, "--requests-per-client", "3", "--max-tokens", "64", "--max-batch-size", "16",
      "--tasks", "sharegpt", "--threads", "2", "--in-process"])
steps = collections.defaultdict(lambda: [0, 0.0, 0.0])
for name, rows, width, draft, step in log:
    entry = steps[name, rows, width]
    entry[0] += 1
    entry[1] += draft
    entry[2] += step
for (name, rows, width), (count, draft, step) in sorted(steps.items()):
    print(f"{name} rows {rows} k {width}: {count} steps, drafting {draft / count:.1f} ms, step {step / count:.1f} ms")
for policy in (o for o in gc.get_objects() if type(o) is schedule.LoadAware):
    print("profile ms", {key: round(v * 1e3, 1) for key, v in policy.table.items() if key[0] <= 2})
    print("acceptance", [round(policy.acceptance(j), 3) for j in range(policy.k_max)])
    print("drafting s (pool: {k: [seconds, steps]})", policy.draft_cost)
    for rows in sorted({rows for _, rows, _, _, _ in log}):
        print(f"rates at {rows} rows, k = 0..", [round(policy.rate(rows, j), 1) for j in range(policy.k_max + 1)])
