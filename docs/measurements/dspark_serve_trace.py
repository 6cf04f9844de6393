"""The DSpark confidence scheduler's steps in a served process: `specdec bench-serve` in process, plain decoding
then `dspark@confidence`, CLIENTS clients of 3 requests of 64 tokens (sharegpt, bfloat16, 2 threads); every
step grouped by (rows, drafts asked, drafts verified) with its mean drafting and step milliseconds, beside
plain decoding's steps by rows.

    python docs/measurements/dspark_serve_trace.py CLIENTS
"""
from __future__ import annotations

import collections
import sys

from specdec import schedule
from specdec.commands.cli import main

steps, plain_steps = [], []
scheduler_observe = schedule.ConfidenceScheduler.observe


def observe(self, engine, group, width, proposed, accepted, timing):
    steps.append((group.size, self.last_choice, width, 1e3 * timing["draft"], 1e3 * timing["step"],
                  sum(accepted or [0])))
    return scheduler_observe(self, engine, group, width, proposed, accepted, timing)


schedule.ConfidenceScheduler.observe = observe
schedule.FixedK.observe = lambda self, engine, group, width, proposed, accepted, timing: plain_steps.append(
    (group.size, 1e3 * timing["step"]))
main(["bench-serve", "--target", "smollm2-135m", "--dtype", "bfloat16", "--drafter", "dspark", "--modes", "plain",
      "dspark@confidence", "--concurrency", sys.argv[1], "--requests-per-client", "3", "--max-tokens", "64",
      "--max-batch-size", "16", "--tasks", "sharegpt", "--threads", "2", "--in-process"])
groups = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
for rows, asked, width, draft, step, accepted in steps:
    entry = groups[rows, asked, width]
    entry[0] += 1
    entry[1] += draft
    entry[2] += step
    entry[3] += accepted
for (rows, asked, width), (count, draft, step, accepted) in sorted(groups.items()):
    print(f"scheduler rows {rows} asked {asked} verified {width}: {count} steps, drafting {draft / count:.1f} ms, "
          f"step {step / count:.1f} ms, {accepted} drafts accepted")
plain = collections.defaultdict(lambda: [0, 0.0])
for rows, step in plain_steps:
    plain[rows][0] += 1
    plain[rows][1] += step
for rows, (count, step) in sorted(plain.items()):
    print(f"plain rows {rows}: {count} steps, step {step / count:.1f} ms")
