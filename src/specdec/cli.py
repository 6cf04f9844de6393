"""The command line, at the edge: parse arguments, call the library, print results.

User errors end as one line on stderr and exit status 2; nothing is written until a result is
complete (output files are written to a temporary name, then renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from .errors import InvalidArgumentError, SpecdecError

DRAFTERS = ("none", "draft-model", "prompt-lookup")
# SGLang's names for the same methods, accepted by --speculative-algorithm.
SGLANG_ALGORITHMS = {"STANDALONE": "draft-model", "NGRAM": "prompt-lookup", "NONE": "none"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _drafter_name(value: str) -> str:
    name = SGLANG_ALGORITHMS.get(value.upper(), value)
    if name not in DRAFTERS:
        raise argparse.ArgumentTypeError(
            f"unknown drafter {value!r}; choose from {', '.join(DRAFTERS)} "
            f"(or SGLang's {', '.join(SGLANG_ALGORITHMS)})")
    return name


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="DIR", help="target model directory (Hugging Face layout)")
    parser.add_argument("--draft", "--speculative-draft-model-path", dest="draft", metavar="DIR",
                        help="draft model directory (for --drafter draft-model)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 avoids contention on busy machines)")
    parser.add_argument("--max-ngram", type=int, default=3, help="prompt lookup: longest n-gram tried (default 3)")
    parser.add_argument("--min-ngram", type=int, default=1, help="prompt lookup: shortest n-gram tried (default 1)")


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-schedule", choices=("constant", "heuristic"), default="constant",
                        help="heuristic: k += 2 after a fully accepted step, k -= 1 otherwise")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="specdec", description="Lossless speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    gen = commands.add_parser("generate", help="generate text from one prompt or a JSONL file of prompts")
    add_model_arguments(gen)
    gen.add_argument("--drafter", "--speculative-algorithm", dest="drafter", type=_drafter_name, default="none",
                     help="none | draft-model | prompt-lookup (SGLang's STANDALONE / NGRAM accepted)")
    gen.add_argument("-k", "--num-draft-tokens", "--speculative-num-draft-tokens", dest="k", type=int, default=5,
                     help="draft tokens per step (default 5)")
    add_generation_arguments(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts", metavar="FILE.jsonl", help="one prompt per line")
    gen.add_argument("--json", action="store_true", help="print one JSON object (outputs and statistics)")
    gen.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE (atomically)")
    gen.set_defaults(func=run_generate)

    from .bench import add_bench_command
    add_bench_command(commands)
    from .demo import add_demo_command
    add_demo_command(commands)
    try:
        from .train.commands import add_commands as add_train_commands
    except ImportError:
        add_train_commands = None
    if add_train_commands is not None:
        add_train_commands(commands)
    return parser


def make_drafter(name: str, args):
    """The drafter named on the command line, loaded."""
    from . import drafters
    from .target import parse_dtype

    if name == "draft-model":  # callers check that --draft was given before loading anything
        return drafters.DraftModel(args.draft, dtype=parse_dtype(args.dtype))
    if name == "prompt-lookup":
        return drafters.PromptLookup(max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    return drafters.NoDraft()


def run_generate(args) -> int:
    from .decode import GenerationConfig, generate_ids
    from .prompts import read_prompts
    from .sampling import SamplingConfig
    from .target import load_target

    # Validate everything cheap before loading any model.
    config = GenerationConfig(num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens,
                              sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
                              seed=args.seed, draft_schedule=args.draft_schedule)
    if args.prompt is not None and not args.prompt:
        raise InvalidArgumentError("the prompt is empty")
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    if args.drafter == "draft-model" and not args.draft:
        raise InvalidArgumentError("--drafter draft-model needs --draft DIR")
    check_output_path(args.output)
    target = load_target(args.target, dtype=args.dtype)
    drafter = make_drafter(args.drafter, args)
    out = generate_ids(target, target.encode(prompts), drafter, config)

    result = {"outputs": [{"index": i, "text": None if out.texts is None else out.texts[i], "token_ids": ids}
                          for i, ids in enumerate(out.token_ids)],
              "stats": out.stats.as_dict()}
    if args.output:
        write_atomic(args.output, json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        for i, ids in enumerate(out.token_ids):
            if len(out.token_ids) > 1:
                print(f"--- prompt {i}")
            print(out.texts[i] if out.texts is not None else " ".join(map(str, ids)))
        print(out.stats.summary(), file=sys.stderr)
    return 0


def check_output_path(path: str | os.PathLike | None) -> None:
    """Fail before any work when an output file could not be written."""
    if path is not None and not Path(path).parent.is_dir():
        raise InvalidArgumentError(f"output folder does not exist: {Path(path).parent}")


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to path via a temporary file in the same folder, so readers never see half a file."""
    check_output_path(path)
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise InvalidArgumentError(f"--threads must be >= 1, got {args.threads}")
            import torch
            torch.set_num_threads(args.threads)
        return int(args.func(args) or 0)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
