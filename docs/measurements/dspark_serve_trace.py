"""The DSpark confidence scheduler's steps in a served process: `specdec bench-serve` in process, plain decoding
then `dspark@confidence`, CLIENTS clients of 3 requests of 64 tokens (sharegpt, bfloat16, 2 threads); every
step grouped by (rows, drafts asked, drafts verified) with its mean drafting and step milliseconds, beside
plain decoding's steps by rows; then each mode's seconds in the engine's admissions (prefill, the drafter's
session joined), steps and departures (rows leaving: the caches and the drafter's backlog moved).

    python docs/measurements/dspark_serve_trace.py CLIENTS
"""
from __future__ import annotations

import collections
import sys

import time

from specdec import engine as engine_module, schedule
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
phases = collections.defaultdict(float)
inside: list[float] = []  # seconds of the phases nested in the running one (a step's departures)


def timed(name, method):
    def run(self, *args):
        started = time.perf_counter()
        inside.append(0.0)
        try:
            return method(self, *args)
        finally:
            seconds = time.perf_counter() - started
            nested = inside.pop()
            phases[self.engine.policy.name, name] += seconds - nested
            if inside:
                inside[-1] += seconds
    return run


for name in ("admit", "step", "leave"):
    setattr(engine_module.Group, name, timed(name, getattr(engine_module.Group, name)))
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
for (policy, name), seconds in sorted(phases.items()):
    print(f"{policy}: {name} {seconds:.2f} s")
