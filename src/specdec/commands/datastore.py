"""`specdec datastore`: build a retrieval drafter's datastore from real text with a target's tokenizer."""

from __future__ import annotations

from pathlib import Path

from specdec.errors import InvalidArgumentError


def add_datastore_command(commands) -> None:
    from specdec.zoo.datastores import REAL_SOURCES, SOURCES

    parser = commands.add_parser("datastore", help="build a datastore for retrieval drafting (REST)")
    parser.add_argument("--target", required=True,
                        help="the model whose tokenizer the datastore uses (a folder, a GGUF file or smollm2-135m)")
    parser.add_argument("--out", required=True, type=Path, help="the datastore folder (written atomically)")
    parser.add_argument("--sources", nargs="+", default=list(REAL_SOURCES), metavar="SOURCE",
                        help=f"{' | '.join(SOURCES)} | a UTF-8 text file (each file one sequence; answers: the "
                             f"target's own greedy answers to ShareGPT train prompts, generated once and cached); "
                             f"default: {' '.join(REAL_SOURCES)}")
    parser.set_defaults(func=run_datastore)


def run_datastore(args) -> int:
    from specdec.backends.hf import load_tokenizer
    from specdec.backends.target import resolve_model
    from specdec.zoo.datastores import SOURCES, build

    for source in args.sources:  # every source checked before any work
        if source not in SOURCES and not Path(source).is_file():
            raise InvalidArgumentError(f"datastore source {source!r} is neither {' nor '.join(SOURCES)} nor a file")
    out = args.out
    if out.exists() and not (out / "config.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidArgumentError(f"{out} exists and is not a datastore; give a new folder")
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"output folder does not exist: {out.parent}")
    folder = resolve_model(args.target)
    tokenizer = load_tokenizer(folder) if Path(folder).is_dir() else None
    if tokenizer is None:
        raise InvalidArgumentError(f"{args.target} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    print(build(tokenizer, args.sources, out, target_dir=folder))
    return 0
