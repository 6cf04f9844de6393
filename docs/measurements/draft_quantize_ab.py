"""A drafter network in the target's dtype against the same network block-quantized at load (quantize=...), interleaved:
the real target in bfloat16, 8 held-out prompts of each of sharegpt and humaneval, 96 new tokens, 2 threads, two
rounds; tau, drafting ms a step and tokens/s of each.
python docs/measurements/draft_quantize_ab.py METHOD K [QTYPE]   (METHOD: eagle, eagle3, dflash, dspark; QTYPE q8_0)"""
import sys

import torch

import specdec
from specdec.backends.hf import load_tokenizer
from specdec.drafters.registry import build
from specdec.models import kernels
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

torch.set_num_threads(2)
kernels.set_threads(2)
name, k = sys.argv[1], int(sys.argv[2])
qtype = sys.argv[3] if len(sys.argv) > 3 else "q8_0"
target = specdec.load_target("smollm2-135m", dtype="bfloat16", backend="native")
tokenizer = load_tokenizer(zoo_path("smollm2-135m"))
prompts = [target.encode([p])[0] for task in ("sharegpt", "humaneval") for p in load_tasks(task, tokenizer=tokenizer)[:8]]
plain = [specdec.generate(target, [p], max_new_tokens=96).token_ids[0] for p in prompts]
for round_ in range(2):
    for quantize in (None, qtype):
        drafter = build(name, zoo_path(f"smollm2-135m/{name}"), type("Options", (), {"draft_quantize": quantize})())
        steps = committed = 0
        drafting = total = 0.0
        for prompt, expected in zip(prompts, plain):
            out = specdec.generate(target, [prompt], drafter, num_draft_tokens=k, max_new_tokens=96)
            assert out.token_ids[0] == expected  # the drafter's weights never change the output
            stats = out.stats
            steps, committed = steps + stats.verify_steps, committed + stats.tokens_from_steps
            drafting, total = drafting + stats.draft_time, total + stats.total_time
        print(f"round {round_} {name} k={k} {quantize or 'bfloat16'}: tau {committed / steps:.3f}, "
              f"drafting {1e3 * drafting / steps:.3f} ms a step, {sum(map(len, plain)) / total:.1f} tokens/s",
              flush=True)
