"""Count how often speculative decoding's greedy output differs from plain decoding of the same model.

Greedy speculative decoding is lossless only if every verification pass computes the same argmax
as one-token decoding would. Blocks of several tokens, tree masks, left padding and rollback holes
change the shapes (and so the reduction order) of the target's matrix products; in low precision
that can flip a near-tie. This tool measures how often it happens on real prompts, so a change to a
forward pass can be judged by its before and after counts, not by a single parity test.

    python -m specdec.commands.exactness [--target DIR] [--draft DIR] [--dtype float32|bfloat16]
        [--backend auto|native|hf] [--prompts N] [--max-new-tokens N] [--task code-completion] [--json OUT]

The reference is plain decoding (drafter none) of each prompt alone. Every configuration (plain in
a ragged batch; prompt lookup and draft model, chains of k and trees, alone and in one ragged batch
of all prompts) counts the prompts whose tokens differ from the reference and where they first do.
Exit status 1 when any run differs, 0 when none does, 2 on bad input.
"""

from __future__ import annotations

import json
import sys
from tqdm import tqdm

from specdec.errors import InvalidArgumentError, SpecdecError

K = 4
TREE = dict(depth=4, topk=2, num_nodes=8)
ALONE, RAGGED = "alone", "ragged"


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """The first position where two outputs differ (a shorter output differs where it ends); None if equal."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def configurations(draft) -> list[tuple[str, object, object]]:
    """(name, drafter, tree or None) of every speculative method measured; plain comes first."""
    from specdec import TreeConfig
    from specdec.drafters import NoDraft, PromptLookup

    tree = TreeConfig(**TREE)
    tag = f"tree={tree.depth}/{tree.topk}/{tree.num_nodes}"
    lookup = PromptLookup()
    configs = [("plain", NoDraft(), None), (f"prompt-lookup k={K}", lookup, None)]
    if draft is not None:
        configs.append((f"draft-model k={K}", draft, None))
    configs.append((f"prompt-lookup {tag}", lookup, tree))
    if draft is not None:
        configs.append((f"draft-model {tag}", draft, tree))
    return configs


def measure(target, prompts: list[list[int]], draft=None, max_new_tokens: int = 128, progress: bool = True) -> dict:
    """Generate the reference and every configuration alone and ragged; the differences per run."""
    import specdec

    configs = configurations(draft)
    bar = tqdm(total=len(prompts) * len(configs) + len(configs), desc="exactness", unit="run",
               disable=not progress, leave=False)

    def run(batch, drafter, tree):
        out = specdec.generate(target, batch, drafter=drafter, num_draft_tokens=K, max_new_tokens=max_new_tokens,
                               temperature=0.0, tree=tree)
        bar.update(1)
        return out.token_ids

    reference = [run([p], configs[0][1], None)[0] for p in prompts]
    runs = []
    for name, drafter, tree in configs:
        for mode in (ALONE, RAGGED):
            if name == "plain" and mode == ALONE:
                continue  # the reference itself
            try:
                outputs = ([run([p], drafter, tree)[0] for p in prompts] if mode == ALONE
                           else run(prompts, drafter, tree))
            except SpecdecError as exc:  # e.g. a backend that refuses trees: reported, not counted as a difference
                bar.update(len(prompts) if mode == ALONE else 1)
                runs.append(dict(config=name, batch=mode, refused=str(exc), differing=0, total=len(prompts), diffs=[]))
                continue
            diffs = []
            for i, (ref, tokens) in enumerate(zip(reference, outputs)):
                position = first_difference(ref, tokens)
                if position is not None:
                    diffs.append(dict(prompt=i, position=position, reference_length=len(ref), length=len(tokens)))
            runs.append(dict(config=name, batch=mode, differing=len(diffs), total=len(prompts), diffs=diffs))
    bar.close()
    return dict(runs=runs, differing_runs=sum(r["differing"] > 0 for r in runs),
                identical=all(r["differing"] == 0 for r in runs))


def format_table(result: dict) -> str:
    """One line per run: configuration, batch mode, differing/total and the first differing positions."""
    s = result["settings"]
    lines = [f"{s['backend_ran']} {s['dtype']}, {s['prompts']} {s['task']} prompts, {s['max_new_tokens']} new tokens, "
             "greedy; reference: plain decoding of each prompt alone",
             f"{'configuration':<30} {'batch':<7} {'differ':>7}  first differing position (prompt:pos)"]
    lines.append("-" * len(lines[-1]))
    for r in result["runs"]:
        where = r.get("refused") or " ".join(f"{d['prompt']}:{d['position']}" for d in r["diffs"])
        lines.append(f"{r['config']:<30} {r['batch']:<7} {r['differing']:>3}/{r['total']:<3}  {where}")
    lines.append("all outputs identical" if result["identical"] else
                 f"OUTPUTS DIFFER in {result['differing_runs']} of {len(result['runs'])} runs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specdec.commands.clitools import BACKENDS, ArgumentParser
    from specdec.models.files import check_output_path, write_atomic

    parser = ArgumentParser(prog="python -m specdec.commands.exactness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", metavar="DIR", help="target model directory (default: the zoo's target)")
    parser.add_argument("--draft", metavar="DIR", help="draft model directory (default: the zoo's draft with the "
                                                       "zoo's target, else no draft-model runs)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="target's and draft's forward pass")
    parser.add_argument("--prompts", type=int, default=20, help="the first N prompts of the task set (default 20)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--task", default="code-completion", help="zoo task set the prompts come from")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--json", metavar="OUT", help="write the settings, runs and differences to OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        import torch

        import specdec
        from specdec.backends.target import parse_dtype
        from specdec.zoo import zoo_path
        from specdec.zoo.tasks import load_tasks

        check_output_path(args.json)
        if args.prompts < 1 or args.max_new_tokens < 1:
            raise InvalidArgumentError("--prompts and --max-new-tokens must be >= 1")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        dtype = parse_dtype(args.dtype)
        target_dir = args.target or zoo_path("target")
        draft_dir = args.draft or (None if args.target else zoo_path("draft"))
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        target = specdec.load_target(target_dir, dtype=dtype, backend=args.backend)
        draft = specdec.drafters.DraftModel(draft_dir, dtype=dtype, backend=args.backend) if draft_dir else None
        prompts = target.encode(load_tasks(args.task, tokenizer=target.tokenizer)[: args.prompts])
        result = measure(target, prompts, draft, args.max_new_tokens, progress=not args.no_progress)
    except SpecdecError as exc:
        print(f"specdec.commands.exactness: error: {exc}", file=sys.stderr)
        return 2
    result["settings"] = dict(target=str(target_dir), draft=str(draft_dir) if draft_dir else None, dtype=args.dtype,
                              backend=args.backend, backend_ran=target.backend.description,
                              draft_backend_ran=draft.backend.description if draft else None, task=args.task,
                              prompts=len(prompts), prompt_lengths=[len(p) for p in prompts],
                              max_new_tokens=args.max_new_tokens, k=K, tree=TREE, threads=torch.get_num_threads(),
                              torch=torch.__version__, specdec=specdec.__file__)
    result = {"settings": result.pop("settings"), **result}
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
