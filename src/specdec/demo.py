"""`specdec demo`: every method on a few prompts, outputs checked identical, one table."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from .errors import SpecdecError

DEMO_PROMPTS = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]


def _models(workdir: Path):
    """(target dir, draft dir, prompts, description): the zoo and held-out task prompts when the zoo
    is installed, else tiny random models built on the spot."""
    try:
        from .zoo import zoo_path
        from .zoo.tasks import load_tasks
        prompts = load_tasks("code-completion")[:2] + load_tasks("copy-edit")[:1]
        return zoo_path("target"), zoo_path("draft"), prompts, "the zoo's trained target and distilled draft"
    except SpecdecError:
        pass
    from .tiny import build_tokenizer, save_tiny

    tokenizer = build_tokenizer()
    target = save_tiny(workdir / "target", "llama", tokenizer, layers=4, hidden=128, init_std=0.1)
    draft = save_tiny(workdir / "draft", "llama", tokenizer, layers=1, hidden=128, init_std=0.1, seed=1)
    return target, draft, DEMO_PROMPTS, "tiny random-weight models built for this demo (no zoo installed)"


def run_demo(args) -> int:
    from transformers.utils import logging as hf_logging

    from .bench import format_table, run_bench
    from .decode import GenerationConfig, generate_ids
    from .drafters import DraftModel
    from .target import load_target

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as workdir:
        target_dir, draft_dir, texts, description = _models(Path(workdir))
        print(f"specdec demo: {description}", file=sys.stderr)
        target = load_target(target_dir)
        draft = DraftModel(draft_dir)
        prompts = target.encode(texts)
        sample = generate_ids(target, prompts[:1], draft, GenerationConfig(num_draft_tokens=4,
                                                                            max_new_tokens=args.max_new_tokens))
        print(f"--- prompt (held out)\n{texts[0]}\n--- continuation (draft model, k=4)\n{sample.texts[0]}\n---")
        result = run_bench(target, prompts, draft=draft, ks=[4], max_new_tokens=args.max_new_tokens,
                           progress=False)
    print(format_table(result))
    return 0 if result["outputs_identical"] else 1


def add_demo_command(commands) -> None:
    demo = commands.add_parser("demo", help="run every method on a few prompts and compare them")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(func=run_demo)
