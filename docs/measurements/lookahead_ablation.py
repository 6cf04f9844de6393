"""Lookahead's tau with and without the n-grams its Jacobi window harvests (the pool then fed by the prompt and
the committed text alone), beside prompt lookup, on the same held-out prompts of the real target.

    python docs/measurements/lookahead_ablation.py W N G [PROMPTS_PER_SET] [NEW_TOKENS]
"""

import sys

import torch

import specdec
from specdec.backends.hf import load_tokenizer
from specdec.drafters import Lookahead, PromptLookup
from specdec.drafters.lookahead import LookaheadSession
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


def tau(target, prompts, drafter, k: int, new_tokens: int) -> float:
    steps = tokens = 0
    for prompt in prompts:
        stats = specdec.generate(target, [prompt], drafter=drafter, num_draft_tokens=k, max_new_tokens=new_tokens).stats
        steps, tokens = steps + stats.verify_steps, tokens + stats.tokens_from_steps
    return tokens / steps


def shift_only(session, guesses):
    """The window moves on as it does, but none of its n-grams enters the pool."""
    session.window = torch.cat([session.window, guesses[:, None]], 1)[:, 1:].contiguous()


def main():
    window, ngram, guesses = (int(value) for value in sys.argv[1:4])
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    new_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 96
    torch.set_num_threads(2)
    target = specdec.load_target("smollm2-135m", dtype="float32")
    tokenizer = load_tokenizer(zoo_path("smollm2-135m"))
    prompts = target.encode([p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=tokenizer)[:count]])
    drafter = Lookahead(window, ngram, guesses)
    print(f"lookahead {drafter.setting}: tau {tau(target, prompts, drafter, ngram - 1, new_tokens):.3f}")
    harvest = LookaheadSession._advance
    LookaheadSession._advance = shift_only
    try:
        print(f"without the window's n-grams: tau {tau(target, prompts, drafter, ngram - 1, new_tokens):.3f}")
    finally:
        LookaheadSession._advance = harvest
    print(f"prompt lookup k={ngram - 1}: tau {tau(target, prompts, PromptLookup(), ngram - 1, new_tokens):.3f}")


if __name__ == "__main__":
    main()
