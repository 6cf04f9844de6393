"""`specdec serve` (an OpenAI-compatible server over the continuous-batching engine) and `specdec bench-serve`
(concurrent clients against it, per mode and concurrency).

Both take generate's target and drafter flags, SGLang's ``--speculative-*`` names and vLLM's
``--speculative-config``; without ``--target`` they serve the zoo's target, and a drafter the zoo trains
for it needs no ``--draft``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdec.commands.clitools import (add_model_arguments, add_tree_arguments, check_draft_quantize, check_staged,
                                       drafter_name, policy_text, tree_config)
from specdec.errors import InvalidArgumentError

SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
BENCH_MODES = ("plain", "fixed", "load-aware")


def add_engine_arguments(parser: argparse.ArgumentParser, default_drafter: str = "none") -> None:
    """Target, drafter and engine flags shared by serve and bench-serve."""
    add_model_arguments(parser)
    for action in parser._actions:  # the zoo's target when none is given
        if action.dest == "target":
            action.required, action.help = False, "target model directory (default: the zoo's target)"
    parser.add_argument("--drafter", "--speculative-algorithm", dest="drafter", type=drafter_name,
                        default=default_drafter,
                        help=f"as generate's (default {default_drafter}); SGLang's and vLLM's names accepted")
    parser.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=None,
                        help="draft tokens per step (default: the drafter's own, else 5)")
    parser.add_argument("--block-size", type=int, default=None, help="DFlash: tokens per verified block")
    add_tree_arguments(parser)
    parser.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                        help="vLLM's speculative_config: method, model, num_speculative_tokens, prompt_lookup_max, "
                             "prompt_lookup_min (in place of --drafter, --draft, -k, --max-ngram, --min-ngram)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="rows verified together (default 64)")
    parser.add_argument("--max-kv-tokens", type=int, default=None,
                        help="KV budget in tokens: admission waits while it is reserved (default: no limit)")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503 (default 256)")


def speculative_config(text: str) -> dict:
    """argparse type: vLLM's speculative_config JSON, its keys checked."""
    try:
        config = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(SPECULATIVE_CONFIG_KEYS)}")
    if "method" in config:
        config["method"] = drafter_name(str(config["method"]))
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        if key in config and (not isinstance(config[key], int) or isinstance(config[key], bool)):
            raise argparse.ArgumentTypeError(f"{key} must be an integer, got {config[key]!r}")
    return config


def bench_mode(text: str):
    """argparse type: a bench-serve mode (serve.bench.parse_mode), checked before any model loads."""
    from specdec.serve.bench import parse_mode

    try:
        return parse_mode(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def batch_size_table(text: str) -> str:
    """argparse type: vLLM-style '1:4,8:2,32:0' (batch size: draft tokens) as the static policy's text."""
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
        if not pairs or any(len(p) != 2 or p[0] < 1 or p[1] < 0 for p in pairs):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch-size:draft-tokens pairs like 1:4,8:2,32:0, got {text!r}")
    return "static:" + ",".join(f"{b}={k}" for b, k in pairs)


def resolve_models(args) -> None:
    """Fill in from --speculative-config and the zoo: args.target, args.draft, args.drafter, args.k, n-grams."""
    from specdec.drafters.registry import REGISTRY, default_folder, missing_folder

    config = args.speculative_config or {}
    if config:
        args.drafter = config.get("method", "draft-model" if "model" in config else args.drafter)
        args.draft = config.get("model", args.draft)
        args.k = config.get("num_speculative_tokens", args.k)
        args.max_ngram = config.get("prompt_lookup_max", args.max_ngram)
        args.min_ngram = config.get("prompt_lookup_min", args.min_ngram)
    entry = REGISTRY[args.drafter]
    zoo_target = args.target is None
    if zoo_target:
        from specdec.zoo import zoo_path
        args.target = str(zoo_path(entry.zoo_variant or "target"))  # a self-drafter drafts for its own variant
    if not args.draft:  # the drafter trained for this target, where the zoo holds one
        args.draft = default_folder(entry.name, args.target)
        if entry.folder and not args.draft:
            raise missing_folder(entry.name, args.target)
    check_draft_quantize(args, entry.name)
    check_staged(args, entry.name)
    for name in ("max_batch_size", "max_queue", "max_kv_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.k is not None and args.k < 1:
        raise InvalidArgumentError(f"-k must be >= 1, got {args.k}")


def engine_options(args) -> dict:
    """Engine keyword arguments from the flags: k and tree (as generate reads them) and the limits."""

    tree = tree_config(args)
    k = args.k
    if args.sglang_draft_tokens is not None and tree is None:
        k = args.sglang_draft_tokens - 1
    return {"num_draft_tokens": k, "tree": tree, "max_batch_size": args.max_batch_size,
            "max_kv_tokens": args.max_kv_tokens, "max_queue": args.max_queue}


# specdec serve --------------------------------------------------------------------------------------
def add_serve_command(commands) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_engine_arguments(serve)
    serve.add_argument("--policy", default="load-aware", type=policy_text,
                       help="draft tokens per step: load-aware (default; profiles the target at start-up), fixed "
                            "(always k), static:1=4,8=2,32=0 (by batch size); with a confidence head (dspark): "
                            "confidence (cut each row's drafts where the expected tokens/s stop rising; profiles "
                            "the target) or conf-min:X (cut at the first draft with confidence below X)")
    serve.add_argument("--num-speculative-tokens-per-batch-size", dest="per_batch_size", type=batch_size_table,
                       metavar="B:K,...", help="vLLM-style table, e.g. 1:4,8:2,32:0 (the static policy)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                                                                  "target folder's name)")
    serve.add_argument("--chat-template", metavar="FILE", default=None,
                       help="a Jinja chat template, in place of the tokenizer's")
    serve.set_defaults(func=run_serve)


def run_serve(args) -> int:
    from specdec.backends.target import load_target
    from specdec.serve import create_app
    from specdec.serve.runner import build_engine
    from specdec.serve.server import listen, url_of, uvicorn_server

    resolve_models(args)
    if not 0 <= args.port <= 65535:
        raise InvalidArgumentError(f"--port must be in [0, 65535], got {args.port}")
    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read --chat-template {args.chat_template}: {exc.strerror}") from None
    policy = args.per_batch_size or args.policy  # both checked by argparse, before any model loads
    sock = listen(args.host, args.port)
    started = time.perf_counter()
    target = load_target(args.target, dtype=args.dtype, backend=args.backend, quantize=args.quantize)
    engine, _ = build_engine(target, args.drafter, args, policy, **engine_options(args))
    app = create_app(engine, target, args.served_model_name or Path(args.target).name, template)
    name = app.state.server.model_name
    k = f" k={engine.config.num_draft_tokens}" if engine.speculates and engine.tree is None else ""
    policy_name = getattr(engine.policy, "name", type(engine.policy).__name__) if engine.speculates else "none"
    import prometheus_client
    prometheus_client.disable_created_metrics()  # vLLM's exposition has no _created series
    print(f"specdec serve: {url_of(sock)}/v1 model {name} drafter {args.drafter}{k} policy {policy_name} "
          f"ready in {time.perf_counter() - started:.1f} s (profiling {engine.profile_seconds:.1f} s)",
          file=sys.stderr, flush=True)
    uvicorn_server(app).run(sockets=[sock])
    return 0


# specdec bench-serve ----------------------------------------------------------------------------------
def add_bench_serve_command(commands) -> None:
    bench = commands.add_parser("bench-serve", help="concurrent streaming clients against `specdec serve`: "
                                                    "throughput, TTFT, ITL per mode and concurrency")
    add_engine_arguments(bench, default_drafter="draft-model")
    bench.add_argument("--url", default=None, help="a running server (default: start one per mode)")
    bench.add_argument("--in-process", action="store_true",
                       help="run each mode's server in this process (default: a process of its own, so the "
                            "clients and the server do not share a core or Python's lock)")
    bench.add_argument("--modes", nargs="+", type=bench_mode, default=list(BENCH_MODES),
                       metavar="MODE",
                       help="plain (no drafter); a policy for --drafter: fixed (fixed k), load-aware, confidence, "
                            "conf-min:X, static:1=4,8=2; or DRAFTER[=DIR]@POLICY for a drafter of its own, e.g. "
                            "plain dflash@fixed dspark=DIR@conf-min:0.5 dspark=DIR@confidence (default: plain "
                            "fixed load-aware); each on a fresh engine")
    bench.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 64])
    bench.add_argument("--requests-per-client", type=int, default=2,
                       help="requests each client sends in turn (a wave is concurrency x this)")
    bench.add_argument("--rounds", type=int, default=1,
                       help="waves of every mode per concurrency, the modes' order reversed every other round; "
                            "with 2 or more, each mode's median and its ratio to the first mode within each round")
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--tasks", default="code-completion",
                       help="the zoo task set the prompts come from; chat sets (humaneval, sharegpt, sharegpt-edit) "
                            "are rendered with the target's chat template (with --url, pass --target to get it)")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--output", metavar="FILE.json", help="also write the JSON result to FILE (atomically)")
    bench.add_argument("--plot", metavar="FILE.png", help="total throughput against concurrency, one line per mode")
    bench.set_defaults(func=run_bench_serve)


def run_bench_serve(args) -> int:
    from specdec.models.files import check_output_path, write_atomic
    from specdec.serve.bench import format_table, parse_mode, plot, resolve_mode, run_bench_serve as bench
    from specdec.zoo.tasks import load_tasks

    check_output_path(args.output)
    check_output_path(args.plot)
    for name in ("requests_per_client", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(c < 1 for c in args.concurrency):
        raise InvalidArgumentError(f"--concurrency values must be >= 1, got {args.concurrency}")
    args.modes = [parse_mode(m) if isinstance(m, str) else m for m in args.modes]  # the default's texts
    labels = [mode.label for mode in args.modes]
    if len(set(labels)) < len(labels):
        raise InvalidArgumentError(f"--modes names a mode twice: {' '.join(labels)}")
    if args.url is None:
        zoo_target = args.target is None
        if all(mode.plain or mode.drafter is not None for mode in args.modes):
            args.drafter = "none"  # every mode names its own drafter: --drafter (and its folder) is not used
        resolve_models(args)
        args.modes = [resolve_mode(mode, args, zoo_target) for mode in args.modes]
    from specdec.backends.hf import load_tokenizer
    prompts = load_tasks(args.tasks, tokenizer=load_tokenizer(args.target) if args.target else None)
    result = bench(args, prompts, engine_options(args))
    if args.output:
        write_atomic(args.output, json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result) if args.json else format_table(result))
    return 0 if not any(w["errors"] for m in result["modes"].values() for w in m["waves"]) else 1
