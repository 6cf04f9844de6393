"""Command-line helpers shared by every command (generate, bench, demo, train): one floor below them.

The commands import this module, never each other; ``cli.py`` registers them all.
"""

from __future__ import annotations

import argparse

from specdec.errors import InvalidArgumentError

class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def drafter_name(value: str) -> str:
    from specdec.drafters.registry import argument_type
    return argument_type(value)


def policy_text(text: str) -> str:
    """argparse type: a policy as schedule.parse_policy reads it, checked before any model loads."""
    from specdec.schedule import parse_policy

    try:
        parse_policy(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


BACKENDS = ("auto", "native", "hf")


def add_model_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """The target, drafter and backend options; ``several``: bench's, where --backend and --draft-p-min take
    several values, measured side by side."""
    parser.add_argument("--target", required=True, metavar="DIR", help="target model directory (Hugging Face layout)")
    parser.add_argument("--draft", "--speculative-draft-model-path", dest="draft", metavar="DIR",
                        help="the drafter's folder (draft-model, medusa, eagle, eagle3, dflash)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--quantize", choices=("q8_0", "q4_0", "q4_1"), default=None,
                        help="block-quantize the target's matrices at load and run them with int8 activations "
                             "(native backend; a GGUF file's quantized tensors run as they are without it)")
    parser.add_argument("--draft-quantize", "--speculative-draft-model-quantization", dest="draft_quantize",
                        choices=("q8_0", "q4_0", "q4_1"), default=None,
                        help="draft-model: block-quantize the draft model at load (native backend); with --draft "
                             "naming the target itself, the target's quantized copy drafts for it. eagle, eagle3, "
                             "dflash, dspark: their networks' matrices, run with int8 activations (fewer bytes "
                             "a draft; the output is unchanged)")
    if several:
        parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=["auto"],
                            help="forward pass(es) to measure: native (specdec's own, Llama family), hf "
                                 "(transformers), auto (native where supported; default); several run side by side")
    else:
        parser.add_argument("--backend", choices=BACKENDS, default="auto",
                            help="native (specdec's own forward pass, Llama family), hf (transformers), "
                                 "auto (native where supported; default)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 avoids contention on busy machines)")
    parser.add_argument("--max-ngram", type=int, default=3, help="prompt lookup: longest n-gram tried (default 3)")
    parser.add_argument("--min-ngram", type=int, default=1, help="prompt lookup: shortest n-gram tried (default 1)")
    parser.add_argument("--lookahead-window", type=int, default=None, metavar="W",
                        help="lookahead: columns of the Jacobi window (default 2)")
    parser.add_argument("--lookahead-ngram", type=int, default=None, metavar="N",
                        help="lookahead: n-gram length; drafts are N - 1 tokens deep (default 4)")
    parser.add_argument("--lookahead-guesses", type=int, default=None, metavar="G",
                        help="lookahead: n-grams kept per key token (default 4)")
    parser.add_argument("--exit-layer", type=int, default=None, metavar="E",
                        help="early-exit: layers that draft (default: the one the model's folder records, else L/2)")
    parser.add_argument("--no-kv-reuse", action="store_true",
                        help="early-exit: verify with the whole network instead of reusing the drafted layers")
    parser.add_argument("--mtp-depth", type=int, default=None, metavar="D",
                        help="mtp: use the first D modules or heads (default: all)")
    parser.add_argument("--draft-p-min", type=float, default=None, metavar="P", nargs="+" if several else None,
                        help="draft-model, eagle, eagle3, mtp: stop a row's chain before its first draft whose most "
                             "likely token the drafter gives less than P (llama.cpp's --draft-p-min; default: the one "
                             "the drafter's folder records, else none; 0: none)"
                             + ("; several: each measured, and --record keeps the fastest" if several else ""))
    parser.add_argument("--draft-staged", default=None, metavar="NAME", nargs="+" if several else None,
                        help="draft-model: a drafter without a model that guesses for the draft model, which then "
                             "checks several guesses a pass (greedy chains; the drafts are unchanged): "
                             "prompt-lookup, retrieval[=DIR] or none (default: the draft model's recorded choice)"
                             + ("; several: each measured" if several else ""))
    parser.add_argument("--staged-guesses", type=int, default=None, metavar="G",
                        help="draft-model with --draft-staged: guesses read a pass (default: recorded, else 3)")
    parser.add_argument("--medusa-choices", type=tree_paths, default=None, metavar="JSON",
                        help="Medusa: the candidate tree as index paths, e.g. '[[0], [0, 0], [1]]' "
                             "(default: the folder's medusa_choices, chosen from held-out acceptance)")


def tree_paths(text: str) -> list[list[int]]:
    """argparse type: a JSON list of index paths."""
    import json

    try:
        paths = json.loads(text)
        if not paths or not all(isinstance(p, list) and p and all(isinstance(i, int) and i >= 0 for i in p)
                                for p in paths):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree is a JSON list of index paths like [[0], [0, 0], [1]], got {text!r}")
    return paths


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """Token-tree flags (SGLang's names too), read back by ``tree_config``."""
    tree = parser.add_argument_group("token trees (instead of chains)")
    tree.add_argument("--tree-depth", "--speculative-num-steps", dest="tree_depth", type=int,
                      help="drafts on the longest root-to-leaf path (SGLang: --speculative-num-steps)")
    tree.add_argument("--tree-topk", "--speculative-eagle-topk", dest="tree_topk", type=int,
                      help="children per expanded node / prompt-lookup matches (SGLang: --speculative-eagle-topk)")
    tree.add_argument("--tree-nodes", dest="tree_nodes", type=int, help="draft nodes verified per step")
    tree.add_argument("--speculative-num-draft-tokens", dest="sglang_draft_tokens", type=int,
                      help="SGLang's count of verified tokens, the pending token included: "
                           "tree nodes (or chain k) = this - 1")


def tree_config(args):
    """The TreeConfig the tree flags ask for (SGLang's names included), or None for chains."""
    from specdec.drafters.base import TreeConfig

    nodes = args.tree_nodes
    if nodes is None and args.sglang_draft_tokens is not None:
        nodes = args.sglang_draft_tokens - 1  # SGLang counts the pending token (the root)
    if args.tree_depth is None and args.tree_topk is None and args.tree_nodes is None:
        if args.sglang_draft_tokens is not None and args.sglang_draft_tokens < 2:
            raise InvalidArgumentError("--speculative-num-draft-tokens counts the pending token: it must be >= 2")
        return None
    defaults = TreeConfig()
    depth = args.tree_depth if args.tree_depth is not None else defaults.depth
    topk = args.tree_topk if args.tree_topk is not None else defaults.topk
    return TreeConfig(depth=depth, topk=topk, num_nodes=nodes if nodes is not None else max(depth, defaults.num_nodes))


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-schedule", choices=("constant", "heuristic"), default="constant",
                        help="heuristic: k += 2 after a fully accepted step, k -= 1 otherwise")


def check_staged(args, drafters: str | list[str]) -> None:
    """--draft-staged and --staged-guesses speed up a draft model (--drafter draft-model, --draft DIR) only."""
    names = [drafters] if isinstance(drafters, str) else list(drafters)
    asked = getattr(args, "draft_staged", None) is not None or getattr(args, "staged_guesses", None) is not None
    if asked and not ("draft-model" in names and getattr(args, "draft", None)):
        raise InvalidArgumentError("--draft-staged and --staged-guesses speed up a draft model "
                                   "(--drafter draft-model and --draft DIR)")


def check_draft_quantize(args, drafters: str | list[str]) -> None:
    """--draft-quantize quantizes a draft model (--draft DIR) or a drafter network (the registry's ``quantize``
    entries: EAGLE-1/3, DFlash, DSpark): with neither among ``drafters`` it would be ignored, so refuse."""
    from specdec.drafters.registry import quantized_networks

    names = [drafters] if isinstance(drafters, str) else list(drafters)
    draft_model = "draft-model" in names and getattr(args, "draft", None)
    if getattr(args, "draft_quantize", None) and not draft_model and not set(names) & set(quantized_networks()):
        raise InvalidArgumentError("--draft-quantize quantizes a draft model (--drafter draft-model and --draft DIR) "
                                   f"or a drafter network ({', '.join(quantized_networks())})")


def make_drafter(name: str, args, backend: str | None = None, folder=None, **overrides):
    """The drafter named on the command line (the registry's name or an alias), loaded; ``overrides``: options
    that differ from ``args`` (bench: one of several --draft-p-min values)."""
    import copy

    from specdec.drafters.registry import build

    options = copy.copy(args)
    vars(options).update(overrides)
    if backend is not None:
        options.backend = backend
    return build(name, folder if folder is not None else getattr(args, "draft", None), options)


