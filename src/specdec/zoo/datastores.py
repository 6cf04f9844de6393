"""Datastores for retrieval drafting, built from real text with a target's tokenizer.

Sources: ``sharegpt`` (the train split's conversations, each rendered whole with the tokenizer's chat
template when it has one; the held-out split, which the task sets come from, never enters),
``stdlib`` (the running interpreter's standard library, the zoo corpus's train split), ``answers``
(the target's own greedy answers to first user turns of the train split, generated once and cached;
the real target's are committed) and text files (each file one sequence).
``zoo_path("smollm2-135m/retrieval")`` is the real target's, built from ``sharegpt``, ``stdlib`` and
``answers`` into ``$SPECDEC_CACHE/datastores/smollm2-135m`` on first use (one to two minutes on two
cores; delete the folder to rebuild it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Iterable, Iterator

from specdec.errors import InvalidArgumentError

SOURCES = ("sharegpt", "stdlib", "answers")
REAL_SOURCES = ("sharegpt", "stdlib", "answers")
# The target's own answers: greedy, in bfloat16, to chat-templated first user turns of ShareGPT's train
# split of at most ``prompt_len`` tokens (the first ``count`` in the order the trainers' data use, seed 0).
ANSWERS = dict(count=4096, prompt_len=256, new_tokens=192, batch=64)
# The real target's datastore is built on each machine, not committed: it starts with the setting
# `specdec bench --record` measured fastest here (docs/real-target.md, eighteenth session), which a
# later `--record` on the machine at hand replaces.
REAL_DEFAULTS = {"num_draft_tokens": 4, "tree": None, "tau": 1.971, "speedup_vs_plain": 1.226,
                 "measured_on": "sharegpt + humaneval, 16 prompts, 128 new tokens, 2 threads, bfloat16",
                 "cpu": "AMD EPYC (family 25 model 1; avx2 fma)"}
BATCH = 256  # texts per tokenizer call


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary: a datastore made with another one drafts nonsense."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def answers_file(fingerprint: str, count: int, new_tokens: int) -> Path:
    from specdec.zoo.fetch import cache_root

    return cache_root() / "answers" / f"{fingerprint}-{count}-{new_tokens}.pt"


def save_answers(rows: list[list[int]], folder: str | Path, meta: dict) -> Path:
    """Keep answers (token ids, as ``target_answers`` returns them) in ``folder``: answers.npz (the ids
    one row after another, uint16 where they fit, and each row's length) and answers.json (``meta``:
    the target's fingerprint and the recipe), each written under a temporary name and renamed."""
    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    flat = np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])
    dtype = np.uint16 if flat.max() < 2 ** 16 else np.int32
    staging = folder / ".answers.npz.tmp"
    with open(staging, "wb") as handle:
        np.savez_compressed(handle, tokens=flat.astype(dtype), lengths=np.asarray([len(r) for r in rows], np.int32))
    staging.replace(folder / "answers.npz")
    (folder / ".answers.json.tmp").write_text(json.dumps({**meta, "rows": len(rows), "tokens": int(flat.size)},
                                                         indent=2) + "\n")
    (folder / ".answers.json.tmp").replace(folder / "answers.json")
    return folder


def kept_answers(meta: dict, folders: Iterable[Path] | None = None) -> list[list[int]] | None:
    """Answers kept by ``save_answers`` in one of ``folders`` (default: the zoo's, ``<model>/answers``)
    that the same target made with the same recipe, as ``meta`` says; else None."""
    import numpy as np

    if folders is None:
        from specdec.zoo import _DATA_DIR
        folders = sorted(_DATA_DIR.glob("*/answers"))
    for folder in folders:
        if not (Path(folder) / "answers.json").is_file():
            continue
        recorded = json.loads((Path(folder) / "answers.json").read_text())
        if all(recorded.get(key) == value for key, value in meta.items()):
            break
    else:
        return None
    with np.load(Path(folder) / "answers.npz") as kept:
        tokens, lengths = kept["tokens"].astype(np.int64), kept["lengths"]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]


@functools.lru_cache(maxsize=8)
def _weights_fingerprint(target_dir: str) -> str:
    """The target's fingerprint (loading it once per process: the zoo's check and the build both ask)."""
    import torch

    from specdec.backends.target import load_target

    return load_target(target_dir, dtype=torch.bfloat16).fingerprint()


def answers_meta(target_dir: str | Path) -> dict:
    """What identifies the answers of ``target_dir`` to the ``answers`` recipe: the target's fingerprint
    and the recipe."""
    return {"target": _weights_fingerprint(str(Path(target_dir).resolve())), "count": ANSWERS["count"],
            "prompt_len": ANSWERS["prompt_len"], "new_tokens": ANSWERS["new_tokens"]}


def target_answers(target_dir: str | Path, progress: bool = True, generate: bool = True) -> list[list[int]] | None:
    """Each prompt of the ``answers`` source followed by the target's greedy answer (``ANSWERS``: at most
    ``new_tokens``): the zoo's copy where it holds this target's answers to this recipe (the real
    target's are committed: ``kept_answers``), else generated once by specdec's batched decoding in
    bfloat16 and cached under the target's fingerprint; chunks are kept as they finish, so a killed
    build resumes where it stopped. ``generate=False``: None where neither copy exists."""
    import shutil

    import torch

    from specdec.backends.hf import load_tokenizer
    from specdec.train.features import cached_sequences, continuations, opening_prompt_ids, parts_folder

    count, new_tokens = ANSWERS["count"], ANSWERS["new_tokens"]
    meta = answers_meta(target_dir)
    committed = kept_answers(meta)
    if committed is not None:
        return committed
    path = answers_file(meta["target"], count, new_tokens)
    if not generate and not path.is_file():
        return None

    def make():
        tokenizer = load_tokenizer(target_dir)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidArgumentError(f"the answers source needs a target with a chat template; {target_dir} has none")
        prompts = opening_prompt_ids(tokenizer, "train", count, ANSWERS["prompt_len"], seed=0)
        log = (lambda message: print(message, file=sys.stderr, flush=True)) if progress else (lambda message: None)
        log(f"[datastore] generating the target's greedy answers to {len(prompts)} ShareGPT train prompts, "
            f"{new_tokens} tokens each (at most {len(prompts) * new_tokens / 1e6:.2f}M tokens; resumable)")
        return continuations(Path(target_dir), prompts, new_tokens, [0.0], ANSWERS["batch"], 0, log,
                             dtype=torch.bfloat16, parts=parts_folder(path))

    made = cached_sequences(path, make)
    shutil.rmtree(parts_folder(path), ignore_errors=True)
    return [row[:length].tolist() for row, length in zip(made.tokens, made.lengths)]


def _texts(source: str, tokenizer) -> list[str]:
    if source == "sharegpt":
        from specdec.zoo.datasets import sharegpt_conversations
        conversations = sharegpt_conversations("train")
        if getattr(tokenizer, "chat_template", None):
            return [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in conversations]
        return ["\n\n".join(m["content"] for m in c["messages"]) for c in conversations]
    if source == "stdlib":
        from specdec.zoo.corpus import read_split
        return [text for text in read_split("train") if text]
    path = Path(source)
    if not path.is_file():
        raise InvalidArgumentError(f"datastore source {source!r} is neither {' nor '.join(SOURCES)} nor a file")
    try:
        return [path.read_text(encoding="utf-8")]
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"{path}: not a UTF-8 text file ({error})") from None


def tokenized(sources: Iterable[str], tokenizer, progress: bool = True,
              target_dir: str | Path | None = None) -> Iterator[list[int]]:
    """Token ids of every text of ``sources`` (names in SOURCES or text files), in order; ``answers``
    needs ``target_dir``, the model that answers."""
    from tqdm import tqdm

    for source in sources:
        if source == "answers":
            if target_dir is None:
                raise InvalidArgumentError("the answers source needs the target's folder (the model that answers)")
            yield from target_answers(target_dir, progress=progress)
            continue
        texts = _texts(source, tokenizer)
        bar = tqdm(total=len(texts), desc=f"tokenizing {Path(source).name}", unit="text", disable=not progress,
                   file=sys.stderr)
        for first in range(0, len(texts), BATCH):
            chunk = texts[first: first + BATCH]
            yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]
            bar.update(len(chunk))
        bar.close()


def source_names(sources: Iterable[str]) -> list[str]:
    """How a datastore's config names its sources: the names of SOURCES, and file names."""
    return [Path(s).name if s not in SOURCES else s for s in sources]


def build(tokenizer, sources: Iterable[str], out: str | Path, progress: bool = True,
          defaults: dict | None = None, target_dir: str | Path | None = None, left_out: Iterable[str] = ()) -> Path:
    """The datastore of ``sources`` tokenized by ``tokenizer``, written to ``out``; ``defaults``: the
    setting it records as fastest (``specdec.defaults``, as ``bench --record`` writes it); ``target_dir``:
    the model whose answers the ``answers`` source holds; ``left_out``: sources asked for but not
    available for this target, recorded as such."""
    from specdec.drafters.retrieval import build_datastore

    sources = list(sources)
    vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    meta = {"sources": source_names(sources),
            "tokenizer": tokenizer_fingerprint(tokenizer)}
    if left_out:
        meta["left_out"] = source_names(left_out)
    if defaults:
        meta["specdec"] = {"defaults": defaults}
    return build_datastore(tokenized(sources, tokenizer, progress, target_dir), out, vocab_size=vocab_size, meta=meta)


def real_datastore_dir(name: str) -> Path:
    """The datastore of the real model ``name`` (``specdec.zoo.REAL_MODELS``), built on first use (and
    again where the folder there was built from other sources, by an earlier version)."""
    from specdec.backends.hf import load_tokenizer
    from specdec.zoo import REAL_MODELS, zoo_path
    from specdec.zoo.fetch import cache_root

    base = REAL_MODELS[name].drafters or name
    folder = cache_root() / "datastores" / base
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if sorted(config.get("sources", []) + config.get("left_out", [])) == sorted(source_names(REAL_SOURCES)):
        return folder  # built from every source this target has (an earlier version's is built again)
    target_dir = zoo_path(base)
    sources, left_out = list(REAL_SOURCES), []
    if "answers" in sources and kept_answers(answers_meta(target_dir)) is None:
        # never 40 minutes of generation behind a first use: the committed answers are another target's
        print(f"[specdec] the zoo holds no answers of this {base}; its datastore is built without them "
              f"(`specdec datastore --sources ... answers` generates them)", file=sys.stderr, flush=True)
        sources.remove("answers")
        left_out.append("answers")
    print(f"[specdec] building the retrieval datastore of {base} from {', '.join(sources)} "
          f"(once; about two minutes) ...", file=sys.stderr, flush=True)
    build(load_tokenizer(target_dir), sources, folder, defaults=REAL_DEFAULTS, target_dir=target_dir,
          left_out=left_out)
    return folder


def datastore_name(folder) -> str:
    """How a record names the datastore ``folder``: a real model's by its zoo name (``smollm2-135m/retrieval``,
    which every machine builds in its own cache), any other by its absolute path."""
    from specdec.zoo import REAL_MODELS
    from specdec.zoo.fetch import cache_root

    path = Path(folder).resolve()
    for name, model in REAL_MODELS.items():
        if path == (cache_root() / "datastores" / (model.drafters or name)).resolve():
            return f"{model.drafters or name}/retrieval"
    return str(path)

