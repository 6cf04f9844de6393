"""The command line, at the edge: parse arguments, call the library, print results.

User errors end as one line on stderr and exit status 2; nothing is written until a result is
complete (output files are written to a temporary name, then renamed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import warnings

from specdec.commands.clitools import (ArgumentParser, drafter_name, add_generation_arguments, add_model_arguments,
                       add_tree_arguments, check_draft_quantize, check_staged, make_drafter, tree_config)
from specdec.models.files import check_output_path, write_atomic
from specdec.drafters.registry import help_text as registry_help
from specdec.errors import InvalidArgumentError, SpecdecError, SpecdecWarning


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="specdec", description="Lossless speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    gen = commands.add_parser("generate", help="generate text from one prompt or a JSONL file of prompts")
    add_model_arguments(gen)
    gen.add_argument("--drafter", "--speculative-algorithm", dest="drafter", type=drafter_name, default="none",
                     help=registry_help())
    gen.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=None,
                     help="draft tokens per step, the chain length (default 5; DFlash: its block size - 1)")
    gen.add_argument("--block-size", type=int, default=None,
                     help="DFlash: tokens per verified block, the pending one included (default: the drafter's)")
    add_generation_arguments(gen)
    add_tree_arguments(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts", metavar="FILE.jsonl", help="one prompt per line")
    gen.add_argument("--chat", action="store_true",
                     help="each prompt is one user message, rendered by the target's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (outputs and statistics)")
    gen.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE (atomically)")
    gen.set_defaults(func=run_generate)

    from specdec.commands.bench import add_bench_command
    add_bench_command(commands)
    from specdec.commands.demo import add_demo_command
    add_demo_command(commands)
    from specdec.commands.datastore import add_datastore_command
    add_datastore_command(commands)
    from specdec.commands.serve import add_bench_serve_command, add_serve_command
    add_serve_command(commands)
    add_bench_serve_command(commands)
    try:
        from specdec.commands.train import add_commands as add_train_commands
    except ImportError:
        add_train_commands = None
    if add_train_commands is not None:
        add_train_commands(commands)
    return parser


def run_generate(args) -> int:
    from specdec.engine import generate_ids
    from specdec.prompts import read_prompts
    from specdec.sampling import SamplingConfig
    from specdec.decode import DEFAULT_DRAFT_TOKENS, GenerationConfig, default_draft_tokens, default_tree
    from specdec.backends.target import load_target

    # Validate everything cheap before loading any model.
    config = GenerationConfig(num_draft_tokens=DEFAULT_DRAFT_TOKENS if args.k is None else args.k,
                              max_new_tokens=args.max_new_tokens,
                              sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
                              seed=args.seed, draft_schedule=args.draft_schedule, tree=tree_config(args))
    if args.sglang_draft_tokens is not None and config.tree is None:
        config = dataclasses.replace(config, num_draft_tokens=args.sglang_draft_tokens - 1)
    if args.prompt is not None and not args.prompt:
        raise InvalidArgumentError("the prompt is empty")
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    if args.chat:
        if not all(isinstance(p, str) for p in prompts):
            raise InvalidArgumentError("--chat takes text prompts, not token ids")
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    check_output_path(args.output)
    from specdec.drafters.registry import REGISTRY, default_folder, missing_folder
    if not args.draft:  # the drafter trained for this target, where the zoo holds one (a datastore: built once)
        args.draft = default_folder(args.drafter, args.target)
        if REGISTRY[args.drafter].folder and not args.draft:
            raise missing_folder(args.drafter, args.target)
    check_draft_quantize(args, args.drafter)
    check_staged(args, args.drafter)
    target = load_target(args.target, dtype=args.dtype, backend=args.backend, quantize=args.quantize)
    drafter = make_drafter(args.drafter, args)
    if args.k is None and args.sglang_draft_tokens is None:  # the drafter's own k and tree (DFlash: its block - 1)
        config = dataclasses.replace(config, num_draft_tokens=default_draft_tokens(drafter),
                                     tree=default_tree(drafter, None, config.tree))
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


@contextlib.contextmanager
def one_line_warnings():
    """specdec's own warnings as one line on stderr, like its errors; other warnings as Python prints them."""
    with warnings.catch_warnings():
        default = warnings.showwarning

        def show(message, category, *rest, **options):
            if issubclass(category, SpecdecWarning):
                print(f"specdec: warning: {message}", file=sys.stderr)
            else:
                default(message, category, *rest, **options)

        warnings.showwarning = show
        yield


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise InvalidArgumentError(f"--threads must be >= 1, got {args.threads}")
            import torch
            torch.set_num_threads(args.threads)
        with one_line_warnings():
            return int(args.func(args) or 0)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
