"""`specdec bench`: specdec's methods and transformers' own implementations, interleaved in one run.

Every method decodes the same prompts greedily; the bench checks that all outputs are identical and
reports tau, alpha, tokens/s, speedup over specdec's plain decoding and the ratio over the
transformers implementation of the same method. Timings are ratios within one run: the methods
take turns on each prompt (in rotating order), so drifts in machine speed hit all of them alike.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from .decode import GenerationConfig, generate_ids
from .drafters import DraftModel, NoDraft, PromptLookup
from .errors import InvalidArgumentError
from .target import Target

PLAIN, DRAFT_MODEL, PROMPT_LOOKUP = "plain", "draft-model", "prompt-lookup"


@dataclass
class Method:
    family: str                  # plain | draft-model | prompt-lookup
    impl: str                    # specdec | transformers
    k: int | None
    batch_size: int
    run: Callable                # list[list[int]] -> (outputs, Stats | None)
    new_tokens: int = 0
    seconds: float = 0.0
    tau_tokens: int = 0          # tokens committed by verification steps
    tau_steps: int = 0           # verification row-steps
    drafts_accepted: int = 0
    drafts_evaluated: int = 0
    outputs: list = field(default_factory=list)

    @property
    def label(self) -> str:
        k = f" k={self.k}" if self.k else ""
        batch = f" batch={self.batch_size}" if self.batch_size > 1 else ""
        return f"{self.impl} {self.family}{k}{batch}"

    @property
    def tau(self) -> float | None:
        return self.tau_tokens / self.tau_steps if self.tau_steps else None

    @property
    def alpha(self) -> float | None:
        return self.drafts_accepted / self.drafts_evaluated if self.drafts_evaluated else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def specdec_method(target: Target, family: str, drafter, k: int | None, max_new_tokens: int, batch_size: int):
    config = GenerationConfig(num_draft_tokens=k or 1, max_new_tokens=max_new_tokens)

    def run(prompts):
        out = generate_ids(target, prompts, drafter, config)
        return out.token_ids, out.stats
    return Method(family, "specdec", k, batch_size, run)


class ForwardCounter:
    """Counts forward passes of a model (transformers does not report its verification steps)."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


def transformers_method(target: Target, family: str, draft_model, k: int | None, max_new_tokens: int,
                        max_ngram: int, counter: ForwardCounter):
    extra = {}
    if family == DRAFT_MODEL:
        extra = {"assistant_model": draft_model}
    elif family == PROMPT_LOOKUP:
        extra = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": max_ngram}
    eos = list(target.eos_token_ids) or None

    def run(prompts):
        (prompt,) = prompts
        if family == DRAFT_MODEL:
            # transformers reads these from the assistant's config, shared by every k: set them per run.
            # The same drafting rule as specdec's: k drafts every step, no confidence-based early stop.
            draft_model.generation_config.num_assistant_tokens = k
            draft_model.generation_config.num_assistant_tokens_schedule = "constant"
            draft_model.generation_config.assistant_confidence_threshold = 0.0
        ids = torch.tensor([prompt], device=target.device)
        before = counter.count
        with torch.inference_mode():
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=max_new_tokens, pad_token_id=target.pad_token_id,
                                        eos_token_id=eos, **extra)
        tokens = out[0, len(prompt):].tolist()
        if eos is not None:  # transformers pads nothing at batch 1, but cut after EOS to be sure
            for i, token in enumerate(tokens):
                if token in eos:
                    tokens = tokens[: i + 1]
                    break
        return [tokens], counter.count - before
    return Method(family, "transformers", k, 1, run)


def build_methods(target: Target, draft: DraftModel | None, ks: list[int], max_new_tokens: int,
                  batch_sizes: list[int], max_ngram: int, min_ngram: int, with_transformers: bool):
    methods = []
    lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)
    for batch_size in batch_sizes:
        methods.append(specdec_method(target, PLAIN, NoDraft(), None, max_new_tokens, batch_size))
        for k in ks:
            if draft is not None:
                methods.append(specdec_method(target, DRAFT_MODEL, draft, k, max_new_tokens, batch_size))
            methods.append(specdec_method(target, PROMPT_LOOKUP, lookup, k, max_new_tokens, batch_size))
    if with_transformers:
        counter = ForwardCounter(target.model)
        methods.append(transformers_method(target, PLAIN, None, None, max_new_tokens, max_ngram, counter))
        for k in ks:
            if draft is not None:
                methods.append(transformers_method(target, DRAFT_MODEL, draft.model, k, max_new_tokens,
                                                   max_ngram, counter))
            methods.append(transformers_method(target, PROMPT_LOOKUP, None, k, max_new_tokens, max_ngram, counter))
    return methods


def _run_timed(method: Method, prompts: list[list[int]]):
    start = time.perf_counter()
    outputs, info = method.run(prompts)
    elapsed = time.perf_counter() - start
    return outputs, info, elapsed


def run_bench(target: Target, prompts: list[list[int]], draft: DraftModel | None = None, ks=(4,),
              max_new_tokens: int = 64, batch_sizes=(1,), repeats: int = 1, max_ngram: int = 3,
              min_ngram: int = 1, with_transformers: bool = True, progress: bool = True) -> dict:
    """Run every method on every prompt, interleaved; return the table as a dict."""
    if not prompts:
        raise InvalidArgumentError("no prompts to benchmark")
    if any(k < 1 for k in ks):
        raise InvalidArgumentError("every k must be >= 1")
    if any(b < 1 for b in batch_sizes):
        raise InvalidArgumentError("every batch size must be >= 1")
    methods = build_methods(target, draft, list(ks), max_new_tokens, list(batch_sizes), max_ngram, min_ngram,
                            with_transformers)
    for method in methods:  # warm-up, untimed
        method.run(prompts[: method.batch_size][:1] if method.impl == "transformers" else
                   prompts[: method.batch_size])

    reference: list[list[int] | None] = [None] * len(prompts)
    mismatches = []
    jobs = [(m, start) for m in methods for start in range(0, len(prompts), m.batch_size)]
    # Interleave: for each prompt chunk, every method takes a turn, in an order rotated per chunk.
    order = sorted(range(len(jobs)), key=lambda j: (jobs[j][1], (j + jobs[j][1]) % len(methods)))
    bar = tqdm(total=len(jobs) * repeats, desc="bench", unit="run", disable=not progress, file=sys.stderr)
    for _ in range(repeats):
        for j in order:
            method, start = jobs[j]
            chunk = prompts[start: start + method.batch_size]
            outputs, info, elapsed = _run_timed(method, chunk)
            method.seconds += elapsed
            method.new_tokens += sum(len(o) for o in outputs)
            if method.impl == "specdec":
                method.tau_tokens += info.tokens_from_steps
                method.tau_steps += info.verify_steps
                method.drafts_accepted += info.drafts_accepted
                method.drafts_evaluated += info.drafts_evaluated
            else:  # transformers' first pass verifies its first drafts together with the prompt
                (output,) = outputs
                method.tau_tokens += len(output)
                method.tau_steps += info
            for offset, output in enumerate(outputs):
                index = start + offset
                if reference[index] is None:
                    reference[index] = output
                elif output != reference[index]:
                    mismatches.append({"prompt": index, "method": method.label})
            bar.update(1)
    bar.close()
    return _table(methods, mismatches, len(prompts), max_new_tokens, repeats)


def _table(methods: list[Method], mismatches: list, num_prompts: int, max_new_tokens: int, repeats: int) -> dict:
    def find(impl, family, k, batch_size):
        for m in methods:
            if (m.impl, m.family, m.k, m.batch_size) == (impl, family, k, batch_size):
                return m
        return None

    rows = []
    for m in methods:
        plain = find("specdec", PLAIN, None, m.batch_size if m.impl == "specdec" else 1)
        peer = find("transformers", m.family, m.k, 1) if m.impl == "specdec" and m.batch_size == 1 else None
        single = find("specdec", m.family, m.k, 1) if m.impl == "specdec" and m.batch_size > 1 else None
        rows.append({
            "method": m.label, "impl": m.impl, "family": m.family, "k": m.k, "batch_size": m.batch_size,
            "tau": m.tau, "alpha": m.alpha, "tokens_per_second": m.tokens_per_second,
            "new_tokens": m.new_tokens, "seconds": m.seconds,
            "speedup_vs_plain": m.tokens_per_second / plain.tokens_per_second if plain and plain.seconds else None,
            "ratio_vs_transformers": (m.tokens_per_second / peer.tokens_per_second
                                      if peer and peer.seconds else None),
            "ratio_vs_batch_1": (m.tokens_per_second / single.tokens_per_second
                                 if single and single.seconds else None),
        })
    return {"prompts": num_prompts, "max_new_tokens": max_new_tokens, "repeats": repeats,
            "outputs_identical": not mismatches, "mismatches": mismatches, "rows": rows}


def format_table(result: dict) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = f"{'method':<40} {'tau':>6} {'alpha':>6} {'tok/s':>8} {'vs plain':>9} {'vs HF':>7} {'vs b=1':>7}"
    lines = [header, "-" * len(header)]
    for row in result["rows"]:
        lines.append(f"{row['method']:<40} {cell(row['tau'], '.2f'):>6} {cell(row['alpha'], '.2f'):>6} "
                     f"{row['tokens_per_second']:>8.1f} {cell(row['speedup_vs_plain'], '.2f'):>9} "
                     f"{cell(row['ratio_vs_transformers'], '.2f'):>7} {cell(row['ratio_vs_batch_1'], '.2f'):>7}")
    verdict = "all greedy outputs identical" if result["outputs_identical"] else (
        f"OUTPUTS DIFFER in {len(result['mismatches'])} runs: " +
        ", ".join(f"prompt {m['prompt']} ({m['method']})" for m in result["mismatches"][:5]))
    lines.append(f"{result['prompts']} prompts x {result['repeats']} repeats, "
                 f"max {result['max_new_tokens']} new tokens; {verdict}")
    return "\n".join(lines)


def add_bench_command(commands) -> None:
    from .clitools import add_model_arguments

    bench = commands.add_parser("bench", help="compare plain, draft-model and prompt-lookup decoding, "
                                              "specdec against transformers, in one run")
    add_model_arguments(bench)
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", metavar="FILE.jsonl")
    source.add_argument("--tasks", metavar="NAME", help="a task set of the zoo (e.g. code-completion)")
    bench.add_argument("-k", nargs="+", type=int, default=[4], help="draft lengths to measure (default 4)")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    bench.add_argument("--batch-sizes", nargs="+", type=int, default=[1],
                       help="batch sizes for specdec's methods (transformers' run at batch 1)")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--no-transformers", action="store_true", help="skip transformers' implementations")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE")
    bench.set_defaults(func=run_bench_command)


def load_bench_prompts(args) -> list:
    from .prompts import read_prompts

    if args.prompts:
        return read_prompts(args.prompts)
    try:
        from .zoo.tasks import load_tasks
    except ImportError:
        raise InvalidArgumentError("task sets need the zoo, which is not installed") from None
    return load_tasks(args.tasks)


def run_bench_command(args) -> int:
    from .clitools import check_output_path, make_drafter, write_atomic
    from .target import load_target

    check_output_path(args.output)

    if args.max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise InvalidArgumentError(f"repeats must be >= 1, got {args.repeats}")
    prompts = load_bench_prompts(args)
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            raise InvalidArgumentError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        prompts = prompts[: args.num_prompts]
    target = load_target(args.target, dtype=args.dtype)
    draft = make_drafter("draft-model", args) if args.draft else None
    if draft is not None:
        draft.check_compatible(target)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    result = run_bench(target, target.encode(prompts), draft=draft, ks=args.k, max_new_tokens=args.max_new_tokens,
                       batch_sizes=args.batch_sizes, repeats=args.repeats, max_ngram=args.max_ngram,
                       min_ngram=args.min_ngram, with_transformers=not args.no_transformers)
    if args.output:
        write_atomic(args.output, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else format_table(result))
    return 0 if result["outputs_identical"] else 1
