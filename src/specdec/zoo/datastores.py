"""Datastores for retrieval drafting, built from real text with a target's tokenizer.

Sources: ``sharegpt`` (the train split's conversations, each rendered whole with the tokenizer's chat
template when it has one; the held-out split, which the task sets come from, never enters),
``stdlib`` (the running interpreter's standard library, the zoo corpus's train split) and text files
(each file one sequence). ``zoo_path("smollm2-135m/retrieval")`` is the real target's, built from
``sharegpt`` and ``stdlib`` into ``$SPECDEC_CACHE/datastores/smollm2-135m`` on first use (about two
minutes on two cores; delete the folder to rebuild it).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Iterable, Iterator

from specdec.errors import InvalidArgumentError

SOURCES = ("sharegpt", "stdlib")
REAL_SOURCES = ("sharegpt", "stdlib")
# The real target's datastore is built on each machine, not committed: it starts with the setting
# `specdec bench --record` measured fastest here (docs/real-target.md, seventeenth session), which a
# later `--record` on the machine at hand replaces.
REAL_DEFAULTS = {"num_draft_tokens": 2, "tree": None, "tau": 1.695, "speedup_vs_plain": 1.097,
                 "measured_on": "sharegpt + humaneval, 16 prompts, 128 new tokens, 2 threads, bfloat16",
                 "cpu": "AMD EPYC (family 23 model 1; avx2 fma)"}
BATCH = 256  # texts per tokenizer call


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary: a datastore made with another one drafts nonsense."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


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


def tokenized(sources: Iterable[str], tokenizer, progress: bool = True) -> Iterator[list[int]]:
    """Token ids of every text of ``sources`` (names in SOURCES or text files), in order."""
    from tqdm import tqdm

    for source in sources:
        texts = _texts(source, tokenizer)
        bar = tqdm(total=len(texts), desc=f"tokenizing {Path(source).name}", unit="text", disable=not progress,
                   file=sys.stderr)
        for first in range(0, len(texts), BATCH):
            chunk = texts[first: first + BATCH]
            yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]
            bar.update(len(chunk))
        bar.close()


def build(tokenizer, sources: Iterable[str], out: str | Path, progress: bool = True,
          defaults: dict | None = None) -> Path:
    """The datastore of ``sources`` tokenized by ``tokenizer``, written to ``out``; ``defaults``: the
    setting it records as fastest (``specdec.defaults``, as ``bench --record`` writes it)."""
    from specdec.drafters.retrieval import build_datastore

    sources = list(sources)
    vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    meta = {"sources": [Path(s).name if s not in SOURCES else s for s in sources],
            "tokenizer": tokenizer_fingerprint(tokenizer)}
    if defaults:
        meta["specdec"] = {"defaults": defaults}
    return build_datastore(tokenized(sources, tokenizer, progress), out, vocab_size=vocab_size, meta=meta)


def real_datastore_dir(name: str) -> Path:
    """The datastore of the real model ``name`` (``specdec.zoo.REAL_MODELS``), built on first use."""
    from specdec.backends.hf import load_tokenizer
    from specdec.zoo import REAL_MODELS, zoo_path
    from specdec.zoo.fetch import cache_root

    base = REAL_MODELS[name].drafters or name
    folder = cache_root() / "datastores" / base
    if not (folder / "config.json").is_file():
        print(f"[specdec] building the retrieval datastore of {base} from {' and '.join(REAL_SOURCES)} "
              f"(once; about two minutes) ...", file=sys.stderr, flush=True)
        build(load_tokenizer(zoo_path(base)), REAL_SOURCES, folder, defaults=REAL_DEFAULTS)
    return folder
