"""Retrieval drafting (REST): what followed the context's tail in a datastore of text, and in the context.

A datastore is a folder holding token sequences (``tokens.npy``: int32, the sequences one after another,
each followed by -1) and ``order.npy``, every position that starts a token, sorted by the next
``key_length`` tokens (a -1 sorts first: a window that runs off its sequence sorts before one that goes
on). The positions whose next n tokens equal a query are then one range of ``order``, found by binary
search. Drafting takes the longest tail of the context (``max_ngram`` down to ``min_ngram`` tokens) that
occurs in the datastore, reads what followed it at up to ``samples`` of its occurrences (evenly spread
over the range, so the sample keeps the continuations' frequencies), and scores each prefix of those
continuations by the share of samples that share it. Prompt lookup's matches in the context itself
(``context_paths`` of them, the longest and most recent first) are added with weight 1 each, so a copy
from the context leads and the datastore fills in where the context has nothing. A chain follows the
best-scored child at every depth; a tree takes the best-scored nodes (at most ``topk`` children each),
which is where REST's trie of retrieved continuations goes. Drafts are point masses, as prompt lookup's:
verification keeps exactly the target's greedy tokens or its sampling distribution.

``build_datastore`` writes a folder from token sequences (atomically, its size printed first);
``specdec datastore`` builds one from ShareGPT's train split, the stdlib's train split, the target's own
answers or text files with a target's tokenizer; ``zoo_path("smollm2-135m/retrieval")`` builds the real
target's on first use. A drafter may draft from several datastores: those whose match of the context's
tail is the longest of all draft, their shares averaged.
"""

from __future__ import annotations

import bisect
import heapq
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from specdec.backends.target import resolve_model
from specdec.batch import Sequences
from specdec.drafters.base import DecodeContext, Proposal, StatelessSession, TreeConfig, recorded_defaults
from specdec.drafters.prompt_lookup import longest_occurring, lookup_many, tree_proposal
from specdec.errors import InvalidArgumentError, SpecdecError

FORMAT = "specdec-datastore"
KEY_LENGTH = 8  # tokens a position is sorted by: the longest query a datastore answers


class DatastoreError(SpecdecError):
    """A datastore folder is missing, damaged or made for another tokenizer."""


def _sort_keys(tokens: np.ndarray, vocab_size: int, key_length: int) -> list[np.ndarray]:
    """uint64 keys whose lexicographic order is the order of the windows tokens[p: p + key_length]:
    each token as token + 1 (-1 -> 0) in ``bits`` bits, as many tokens per key as fit in 64 bits."""
    bits = int(vocab_size).bit_length()
    per_key = 64 // bits
    count = tokens.shape[0] - key_length
    shifted = tokens.astype(np.uint64) + np.uint64(1)  # -1 wraps to 2^64 - 1; + 1 makes it 0
    keys = []
    for first in range(0, key_length, per_key):
        key = np.zeros(count, dtype=np.uint64)
        for j in range(first, min(first + per_key, key_length)):
            key = (key << np.uint64(bits)) | shifted[j: j + count]
        key <<= np.uint64(bits * (per_key - min(per_key, key_length - first)))  # a short last key left-aligned
        keys.append(key)
    return keys


def build_datastore(sequences: Iterable[Sequence[int]], out: str | Path, *, vocab_size: int,
                    key_length: int = KEY_LENGTH, meta: dict | None = None) -> Path:
    """Write the datastore of ``sequences`` (token ids below ``vocab_size``) to the folder ``out``.

    Built in a temporary folder beside ``out`` and renamed when complete; the size is printed before
    anything is written. ``meta`` goes into config.json (sources, the tokenizer's fingerprint)."""
    out = Path(out)
    parts, count = [], 0
    for sequence in sequences:
        array = np.asarray(sequence, dtype=np.int64)
        if array.size == 0:
            continue
        if array.min() < 0 or array.max() >= vocab_size:
            raise InvalidArgumentError(f"datastore tokens must lie in [0, {vocab_size}); got "
                                       f"{int(array.min())}..{int(array.max())}")
        parts.append(np.append(array.astype(np.int32), np.int32(-1)))
        count += 1
    if not parts:
        raise InvalidArgumentError("a datastore needs at least one non-empty token sequence")
    tokens = np.concatenate(parts + [np.full(key_length, -1, dtype=np.int32)])
    keys = _sort_keys(tokens, vocab_size, key_length)
    order = np.lexsort(keys[::-1])
    order = order[tokens[order] >= 0]  # a query never starts at a separator
    order = order.astype(np.int32 if tokens.shape[0] < 2 ** 31 else np.int64)
    size = tokens.nbytes + order.nbytes
    print(f"[specdec] datastore: {count:,} sequences, {order.shape[0]:,} tokens, {size / 2 ** 20:.0f} MiB "
          f"-> {out}", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)
    try:
        np.save(staging / "tokens.npy", tokens)
        np.save(staging / "order.npy", order)
        config = {"format": FORMAT, "vocab_size": int(vocab_size), "key_length": key_length,
                  "sequences": count, "tokens": int(order.shape[0]), **(meta or {})}
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


class Datastore:
    """A datastore folder, memory-mapped."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as error:
            raise DatastoreError(f"{folder} is not a datastore ({error})") from None
        if config.get("format") != FORMAT:
            raise DatastoreError(f"{folder}/config.json is not a specdec datastore (format {config.get('format')!r})")
        try:
            # plain arrays over the mapped files: indexing a memmap object costs several times more
            self.tokens = np.asarray(np.load(folder / "tokens.npy", mmap_mode="r"))
            self.order = np.asarray(np.load(folder / "order.npy", mmap_mode="r"))
        except (OSError, ValueError) as error:
            raise DatastoreError(f"{folder}: tokens.npy or order.npy does not read ({error}); rebuild it") from None
        if self.order.shape[0] != config.get("tokens") or self.tokens.shape[0] <= self.order.shape[0]:
            raise DatastoreError(f"{folder}: {self.order.shape[0]} sorted positions for {config.get('tokens')} "
                                 f"tokens; the folder is damaged, rebuild it")
        self.folder, self.config = folder, config
        self.vocab_size, self.key_length = int(config["vocab_size"]), int(config["key_length"])

    def _window(self, index: int, n: int) -> list[int]:
        position = int(self.order[index])
        return self.tokens[position: position + n].tolist()

    def _bisect(self, side, query: list[int], lo: int = 0) -> int:
        """``side`` (bisect_left or bisect_right) of ``query`` among the entries of ``order``, each keyed by its
        next len(query) tokens."""
        return side(range(self.order.shape[0]), query, lo=lo, key=lambda index: self._window(index, len(query)))

    def _first(self, query: list[int]) -> int:
        """The first entry of ``order`` whose next len(query) tokens are not below ``query``."""
        return self._bisect(bisect.bisect_left, query)

    def find(self, query: Sequence[int]) -> tuple[int, int]:
        """[lo, hi): the entries of ``order`` whose next len(query) tokens equal ``query`` (at most
        key_length tokens)."""
        query = list(query)
        start = self._first(query)
        return start, self._bisect(bisect.bisect_right, query, start)

    def occurs(self, query: Sequence[int]) -> bool:
        """Whether ``query`` (at most key_length tokens) starts some entry: one bisection where ``find`` takes two."""
        query = list(query)
        start = self._first(query)
        return start < self.order.shape[0] and self._window(start, len(query)) == query

    def match(self, context: Sequence[int], max_ngram: int, min_ngram: int) -> tuple[int, int, int]:
        """(n, lo, hi): the longest tail of ``context`` (max_ngram down to min_ngram tokens) found here and
        its entries [lo, hi) of ``order``; n = 0 where no tail of min_ngram tokens occurs. Where a tail
        does not occur no longer one does, so the longest is bisected over n (each probe ``occurs``), and
        only its entries are then found."""
        longest = min(max_ngram, self.key_length, len(context))
        valid = 0  # the longest tail of token ids this datastore can hold
        while valid < longest and 0 <= context[len(context) - 1 - valid] < self.vocab_size:
            valid += 1
        found = longest_occurring(min_ngram, valid, lambda n: self.occurs(context[len(context) - n:]))
        return (found, *self.find(context[len(context) - found:])) if found >= min_ngram else (0, 0, 0)

    def following(self, found: int, lo: int, hi: int, depth: int, samples: int) -> list[list[int]]:
        """What followed the ``found``-token tail at entries [lo, hi): ``depth`` tokens (fewer where its
        sequence ended) at up to ``samples`` evenly spread occurrences."""
        if hi <= lo:
            return []
        picks = np.arange(samples) * (hi - lo) // samples + lo if hi - lo > samples else np.arange(lo, hi)
        starts = np.asarray(self.order[picks], dtype=np.int64) + found
        window = np.minimum(starts[:, None] + np.arange(depth), self.tokens.shape[0] - 1)
        rows = np.asarray(self.tokens[window])
        paths = []
        for row in rows.tolist():
            end = row.index(-1) if -1 in row else depth
            if end:
                paths.append(row[:end])
        return paths

    def continuations(self, context: Sequence[int], depth: int, max_ngram: int, min_ngram: int,
                      samples: int) -> list[list[int]]:
        """What followed the longest tail of ``context`` (max_ngram down to min_ngram tokens) found here,
        ``depth`` tokens (fewer where its sequence ended) at up to ``samples`` evenly spread occurrences."""
        return self.following(*self.match(context, max_ngram, min_ngram), depth, samples)


def select_nodes(scores: dict[tuple[int, ...], float], depth: int, topk: int, num_nodes: int,
                 min_score: float = 0.0):
    """(tokens, parents, depths) of the best-scored prefixes, best first while a parent is taken, at most
    ``topk`` children per node, none scored below ``min_score``, nodes in order of depth. A prefix never
    outscores its parent, so this is the top ``num_nodes`` of the tree (ties: shallower, then first
    scored, first)."""
    rank = {prefix: i for i, prefix in enumerate(scores)}
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for prefix, score in scores.items():
        if len(prefix) <= depth and score >= min_score:
            children.setdefault(prefix[:-1], []).append(prefix)
    frontier = [(-scores[p], len(p), rank[p], p) for p in children.get((), [])]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    taken: dict[tuple[int, ...], int] = {}
    while frontier and len(chosen) < num_nodes:
        _, _, _, prefix = heapq.heappop(frontier)
        parent = prefix[:-1]
        if taken.get(parent, 0) >= topk:
            continue
        taken[parent] = taken.get(parent, 0) + 1
        chosen.append(prefix)
        for child in children.get(prefix, []):
            heapq.heappush(frontier, (-scores[child], len(child), rank[child], child))
    chosen.sort(key=len)  # stable: within a depth, best first
    index = {prefix: i for i, prefix in enumerate(chosen)}
    return ([p[-1] for p in chosen], [index.get(p[:-1], -1) for p in chosen], [len(p) for p in chosen])


def score_paths(context_paths: list[list[int]], *store_paths: list[list[int]]) -> dict[tuple[int, ...], float]:
    """Each prefix's score: 1 per context path through it plus the share of datastore paths through it
    (several datastores' paths: the mean of their shares)."""
    scores: dict[tuple[int, ...], float] = {}
    weighted = [(1.0, context_paths)] + [(1.0 / (max(1, len(paths)) * len(store_paths)), paths)
                                         for paths in store_paths]
    for weight, paths in weighted:
        for path in paths:
            for end in range(1, len(path) + 1):
                prefix = tuple(path[:end])
                scores[prefix] = scores.get(prefix, 0.0) + weight
    return scores


@dataclass(frozen=True)
class Retrieval:
    """REST: drafts from a datastore (a folder, or a ``Datastore``; or a list of them, of which those with
    the longest match of the context's tail draft, their shares averaged) and from the context."""

    datastore: object
    max_ngram: int = 6
    min_ngram: int = 2
    samples: int = 64
    context_paths: int = 1          # prompt lookup's matches in the context, weight 1 each (0: datastore only)
    context_max_ngram: int = 8       # the longest tail of the context looked up in the context itself
    min_score: float = 0.1          # drafts no node scored below this (share of datastore paths; context: 1)
    name: str = "retrieval"
    store: Datastore = field(init=False, repr=False, compare=False)
    stores: tuple = field(init=False, repr=False, compare=False)
    default_draft_tokens: int | None = field(init=False, repr=False, compare=False)
    default_tree: TreeConfig | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram or self.samples < 1 or self.context_paths < 0:
            raise InvalidArgumentError(f"retrieval needs 1 <= min_ngram <= max_ngram, samples >= 1 and "
                                       f"context_paths >= 0; got {self.min_ngram}..{self.max_ngram}, "
                                       f"{self.samples}, {self.context_paths}")
        given = self.datastore if isinstance(self.datastore, (list, tuple)) else [self.datastore]
        if not given:
            raise InvalidArgumentError("retrieval needs at least one datastore")
        stores = tuple(item if isinstance(item, Datastore) else Datastore(resolve_model(item)) for item in given)
        store = stores[0]  # its recorded setting and tokenizer record speak for all
        object.__setattr__(self, "store", store)
        object.__setattr__(self, "stores", stores)
        k, tree = recorded_defaults(str(store.folder))  # bench --record's fastest setting
        object.__setattr__(self, "default_draft_tokens", k)
        object.__setattr__(self, "default_tree", tree)

    @property
    def path(self) -> str:
        """The (first) datastore's folder: what bench's labels and ``--record`` name the drafter by."""
        return str(self.store.folder)

    def check_target(self, target) -> None:
        """Refuse, in one line, a target whose tokenizer is not the one the datastore was built with."""
        from specdec.zoo.datastores import tokenizer_fingerprint

        tokenizer = getattr(target, "tokenizer", None)
        fingerprint = None if tokenizer is None else tokenizer_fingerprint(tokenizer)
        for store in self.stores:
            recorded = store.config.get("tokenizer")
            if recorded and fingerprint is not None and fingerprint != recorded:
                raise InvalidArgumentError(f"the datastore {store.folder} was built with another tokenizer "
                                           f"({recorded}); build one with the target's (specdec datastore)")
            if store.vocab_size > target.vocab_size:
                raise InvalidArgumentError(f"the datastore {store.folder} holds token ids up to {store.vocab_size}, "
                                           f"the target's vocabulary {target.vocab_size}: build it with the target's "
                                           f"tokenizer")

    def start(self, context: DecodeContext, seqs: Sequences) -> "RetrievalSession":
        if getattr(self, "_checked", None) is not context.target:
            self.check_target(context.target)
            object.__setattr__(self, "_checked", context.target)
        return RetrievalSession(self, context.tree)


class RetrievalSession(StatelessSession):
    def __init__(self, config: Retrieval, tree: TreeConfig | None = None):
        self.config, self.tree = config, tree

    def _row(self, tokens: torch.Tensor, depth: int, topk: int, num_nodes: int):
        config = self.config
        context = lookup_many(tokens, config.context_max_ngram, 1, depth, config.context_paths) \
            if config.context_paths else []
        ids = tokens.tolist()
        matches = [(store, store.match(ids, config.max_ngram, config.min_ngram)) for store in config.stores]
        longest = max(found for _, (found, _, _) in matches)
        paths = [store.following(*match, depth, config.samples) for store, match in matches
                 if longest and match[0] == longest]
        return select_nodes(score_paths(context, *paths), depth, topk, num_nodes, config.min_score)

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        tree, device = self.tree, seqs.tokens.device
        shape = (tree.depth, tree.topk, tree.num_nodes) if tree is not None else (k, 1, k)
        rows = [self._row(seqs.tokens[row, :length].cpu(), *shape) for row, length in enumerate(seqs.lengths.tolist())]
        return tree_proposal(rows, device, width=k if tree is None else None, chain=tree is None)
