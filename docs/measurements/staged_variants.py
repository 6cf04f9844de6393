"""The shipped Q4_1 file drafting staged for its bfloat16 model: guessers, guesses a pass and cuts side by side,
plain decoding beside them, interleaved prompt by prompt (three rounds, the last two printed).

    python docs/measurements/staged_variants.py PROMPTS TOKENS VARIANTS [OLD]

PROMPTS held-out prompts of each of sharegpt and humaneval, TOKENS new tokens, k = 8, 2 threads. VARIANTS,
comma-separated: G<n> (prompt lookup, n guesses a pass), G<n> n>=2 (prompt lookup of 2-grams and longer),
R<n> (retrieval over the target's datastore; R<n> FIELD=VALUE ...: with those of Retrieval's fields, e.g.
R3 min_score=0.3 samples=16), G<n> p<x> (the draft model's chain cut at top probability x);
"old G3" / "old R3": the draft model, prompt lookup and retrieval modules of commit OLD (default HEAD~1),
read with git show. Prints tokens/s (prefill included, as bench counts), the ratio to plain decoding, the
drafting seconds, the draft model's passes and the verification steps; every output is checked against
plain decoding.
"""
import importlib.util
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

import specdec
from specdec.backends.native import NativeCache
from specdec.backends.target import load_target
from specdec.drafters import DraftModel
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.drafters.retrieval import Retrieval
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks


def old_module(commit: str, path: str, name: str):
    """The module at ``path`` as commit ``commit`` had it."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def drafter(variant: str, copy: str, old: str):
    words = variant.split()
    if words[0] == "old":
        model = old_module(old, "src/specdec/drafters/draft_model.py", "old_draft_model").DraftModel
        lookup = old_module(old, "src/specdec/drafters/prompt_lookup.py", "old_prompt_lookup").PromptLookup
        retrieval = old_module(old, "src/specdec/drafters/retrieval.py", "old_retrieval").Retrieval
        words = words[1:]
    else:
        model, lookup, retrieval = DraftModel, PromptLookup, Retrieval
    kind, guesses = words[0][0], int(words[0][1:])
    p_min = float(words[-1][1:]) if len(words) > 1 and words[-1].startswith("p") else None
    fields = {key: float(value) if "." in value else int(value)
              for key, _, value in (word.partition("=") for word in words[1:] if "=" in word and ">" not in word)}
    guesser = (retrieval(zoo_path("smollm2-135m/retrieval"), **fields) if kind == "R"
               else lookup(min_ngram=2) if "n>=2" in words else lookup())
    return model(copy, staged=guesser, staged_guesses=guesses, p_min=p_min)


def main(count: int, tokens: int, names: list[str], old: str) -> None:
    torch.set_num_threads(2)
    target = load_target(zoo_path("smollm2-135m"), dtype="bfloat16")
    texts = [p for name in ("sharegpt", "humaneval") for p in load_tasks(name, tokenizer=target.tokenizer)[:count]]
    copy = zoo_path("smollm2-135m-q4_1")
    variants = {"plain": None, **{name: drafter(name, copy, old) for name in names}}
    passes, current, forward = Counter(), [None], NativeCache.forward

    def counted(cache, *args, **kwargs):
        if current[0] and cache.model is not target.backend.model:
            passes[current[0]] += 1
        return forward(cache, *args, **kwargs)

    NativeCache.forward = counted
    plain = {}
    for round_ in range(3):
        totals = {name: Counter() for name in variants}
        passes.clear()
        order = list(variants) if round_ % 2 == 0 else list(reversed(list(variants)))
        for i, text in enumerate(texts):
            for name in order:
                current[0] = name
                out = specdec.generate(target, [text], drafter=variants[name], num_draft_tokens=8,
                                       max_new_tokens=tokens)
                if name == "plain":
                    plain[i] = out.token_ids
                else:
                    assert out.token_ids == plain[i], name
                stats = out.stats
                for key, value in (("seconds", stats.total_time), ("tokens", stats.new_tokens),
                                   ("draft", stats.draft_time), ("steps", stats.target_forwards)):
                    totals[name][key] += value
        if round_:
            rate = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
            print(f"round {round_}: plain {rate['plain']:.1f} tokens/s", flush=True)
            for name in names:
                t = totals[name]
                print(f"  {name:12s} {rate[name]:6.1f} tokens/s {rate[name] / rate['plain']:.3f}x drafting "
                      f"{t['draft']:.2f} s, {passes[name]} passes, {t['steps']} steps", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4] if len(sys.argv) > 4 else "HEAD~1")
