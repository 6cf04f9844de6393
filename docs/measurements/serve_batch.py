"""One batch of N requests through the serving engine in this process (no HTTP): plain decoding, DSpark
with a policy that never drafts, or DSpark under a policy text (e.g. ``confidence``), each mode run in
the order given. Prints the wall time, the engine's prefill / verification / drafting seconds and the
steps that drafted; ``MODE+prof`` adds a cProfile of that run.

    python docs/measurements/serve_batch.py 64 plain never confidence plain never confidence

The N prompts cycle through the held-out ShareGPT task set; 64 new tokens each, batches of 16 rows,
bfloat16 on the native kernels (specdec's thread count: SPECDEC_THREADS or the cores)."""
import argparse
import cProfile
import pstats
import sys
import time

from specdec.backends.target import load_target
from specdec.drafters.registry import build
from specdec.engine import Engine, Request
from specdec.schedule import FixedK, parse_policy
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


class Never(FixedK):
    """Speculative mode (the drafter's session, the target's features) whose steps never draft."""

    def draft_tokens(self, engine, group):
        return 0


def engine_for(target, mode: str) -> Engine:
    if mode == "plain":
        return Engine(target, None, max_batch_size=16, stream=True)
    drafter = build("dspark", zoo_path("smollm2-135m/dspark"), argparse.Namespace())
    return Engine(target, drafter, max_batch_size=16, stream=True,
                  policy=Never() if mode == "never" else parse_policy(mode))


def main(count: int, modes: list[str]) -> None:
    target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
    ids = target.encode(load_tasks("sharegpt", tokenizer=target.tokenizer))
    ids = [ids[i % len(ids)] for i in range(count)]
    print(f"{count} prompts, {sum(map(len, ids))} prompt tokens")
    for mode in modes:
        profiled = mode.endswith("+prof")
        mode = mode.removesuffix("+prof")
        engine = engine_for(target, mode)
        drafted = [0]
        choose = engine.policy.draft_tokens

        def counted(engine_, group, choose=choose, drafted=drafted):
            k = choose(engine_, group)
            drafted[0] += bool(k) and mode != "plain"
            return k

        engine.policy.draft_tokens = counted
        requests = [Request(list(p), max_new_tokens=64) for p in ids]
        profile = cProfile.Profile() if profiled else None
        started = time.perf_counter()
        if profile:
            profile.enable()
        engine.run(requests)
        if profile:
            profile.disable()
        stats = engine.stats
        print(f"{mode}: wall {time.perf_counter() - started:.1f} s, prefill {stats.prefill_time:.1f} s, "
              f"verification {stats.verify_time:.1f} s, drafting {stats.draft_time:.1f} s, "
              f"steps that drafted {drafted[0]}", flush=True)
        if profile:
            pstats.Stats(profile).sort_stats("cumulative").print_stats(35)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
