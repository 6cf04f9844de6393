"""1. PROPOSE: the protocol every drafter implements.

A ``Drafter`` is the reusable part (loaded weights, settings). ``start`` opens a ``DraftSession`` for
one generation call, holding per-call state such as a KV cache. The decode loop only talks to these
two protocols; it never branches on which drafter it drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from specdec.batch import Sequences
from specdec.errors import InvalidArgumentError
from specdec.models import kernels
from specdec.sampling import SamplingConfig, probabilities, sample


@dataclass(frozen=True)
class Proposal:
    """Drafts for every live row: a chain of k tokens, or a tree of k nodes (``parents`` given)."""

    tokens: torch.Tensor              # [B, k] long; slots at or past `lengths` are padding
    lengths: torch.Tensor             # [B] long, drafts (tree nodes) per row, 0..k
    probs: torch.Tensor | None = None  # [B, k, V] distributions the drafts were sampled from; None = one-hot
    parents: torch.Tensor | None = None  # [B, k] long, trees only: parent node, -1 = the pending token;
                                         # nodes in order of depth (a parent before its children)
    node_depths: torch.Tensor | None = None  # [B, k] long, trees: depth of each node when the drafter knows it
    confidence: torch.Tensor | None = None  # [B, k] float, chains: the drafter's estimate that draft j is
                                            # accepted given every draft before it was (DSpark's confidence
                                            # head); a function of the drafts before j only, never of draft j

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def depths(self) -> torch.Tensor:
        """[B, k] depth of each draft (1 = right after the pending token); chains: 1..k."""
        if self.parents is None:
            return torch.arange(1, self.k + 1, device=self.tokens.device).expand(self.tokens.shape[0], -1)
        if self.node_depths is None:  # computed once (the loop asks several times per step)
            from specdec.verify.tree import depths
            object.__setattr__(self, "node_depths", depths(self.parents, self.lengths))
        return self.node_depths

    def clamp(self, max_lengths: torch.Tensor) -> "Proposal":
        """Limit rows to max_lengths[b] drafts in depth (no row drafts past its token budget)."""
        if self.parents is None:
            return Proposal(self.tokens, torch.minimum(self.lengths, max_lengths), self.probs,
                            confidence=self.confidence)
        # Nodes come in order of depth, so the nodes within the budget are a prefix.
        depth = self.depths()
        lengths = torch.minimum(self.lengths, (depth <= max_lengths[:, None]).sum(1))
        kept = torch.arange(self.k, device=depth.device) < lengths[:, None]
        return Proposal(self.tokens, lengths, self.probs, self.parents, depth * kept)


@dataclass(frozen=True)
class FeatureSpec:
    """What a drafter reads from the target besides tokens; the loop serves it without knowing why.

    ``hidden_layers`` index transformers' ``hidden_states``: 0 is the embedding output, i the output
    of decoder layer i (1-based), num_layers the final-normed output (what the LM head reads).
    ``embedding`` / ``head``: the drafter reuses the target's input embedding / LM head
    (``Target.input_embeddings()``, ``Target.output_head()``), read once when a session starts.
    """

    hidden_layers: tuple[int, ...] = ()
    embedding: bool = False
    head: bool = False


@dataclass(frozen=True)
class TargetFeatures:
    """The target's hidden states of the tokens a step committed, handed to the drafter after the
    prefill and after every verification (trees: the accepted path only). Right-aligned: the last
    column of every row is the token just before its pending one."""

    states: torch.Tensor  # [B, m, len(hidden_layers), H]; column j of row b: token seqs.lengths[b] - 1 - m + j
    valid: torch.Tensor   # [B, m] bool; each row's valid columns are its last ones (at least one)


@dataclass(frozen=True)
class TreeConfig:
    """Token trees instead of chains: ``depth`` drafts deep, ``topk`` children per expanded node,
    ``num_nodes`` drafts verified per step (SGLang: --speculative-num-steps = depth,
    --speculative-eagle-topk = topk, --speculative-num-draft-tokens = num_nodes + 1, the root counted)."""

    depth: int = 5
    topk: int = 4
    num_nodes: int = 16

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.num_nodes < 1:
            raise InvalidArgumentError(f"tree depth, topk and num_nodes must be >= 1, got depth {self.depth}, "
                                       f"topk {self.topk}, num_nodes {self.num_nodes}")
        if self.num_nodes < self.depth:
            raise InvalidArgumentError(f"a tree of depth {self.depth} needs num_nodes >= {self.depth}, "
                                       f"got {self.num_nodes}")


@dataclass(frozen=True)
class DecodeContext:
    """What a drafter may read about the generation it joins."""

    target: object                 # specdec.backends.target.Target
    sampling: SamplingConfig
    generator: torch.Generator | None
    max_new_tokens: int
    max_draft_tokens: int          # upper bound on k for this call (adaptive k never exceeds it)
    cache_capacity: int | None = None  # columns a KV cache of this call may need (preallocating backends)
    tree: TreeConfig | None = None  # trees instead of chains (drafters that cannot build trees refuse)


class DraftSession(Protocol):
    def propose(self, seqs: Sequences, k: int) -> Proposal:
        """Up to k drafts per row continuing ``seqs``."""

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        """After verification: ``seqs`` now holds the committed tokens; num_accepted: [B]."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only rows ``index`` (finished rows leave the batch)."""

    def extend(self, other: "DraftSession") -> None:
        """Append the rows of ``other``, a session of the same drafter opened for requests joining the
        batch (between steps: both have seen their rows' committed tokens and features)."""

    # Sessions that draft with the target's own first layers (early exit) also implement:
    # def share_cache(self, cache) -> None:
    #     """The target's KV cache of this call, given once before the prefill."""
    # def verify_forward(self, cache, tokens, valid, logits_to_keep, hidden_layers=()):
    #     """Target.forward for the verification block, reusing what drafting computed."""

    # Sessions of a draft model that copies the target (the same network, quantized) implement:
    # def adopt_prompt(self, cache) -> None:
    #     """The target's KV cache right after the prefill, to take the prompt's keys and values from."""

    # Sessions of drafters that declare ``features`` also implement:
    # def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
    #     """The target's features of newly committed tokens (after the prefill and after ``accepted``)."""


class Drafter(Protocol):
    name: str
    # features: FeatureSpec   (optional: what it reads from the target besides tokens)

    def start(self, context: DecodeContext, seqs: Sequences) -> DraftSession:
        """Validate against the target and open the per-call state."""


class StatelessSession:
    """Base for sessions with nothing to update or select: prompt lookup, the no-draft baseline."""

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, index: torch.Tensor) -> None:
        pass

    def extend(self, other) -> None:
        pass


def recorded_setting(folder: str) -> dict:
    """The setting a drafter folder records as measured fastest (``specdec bench --record``: its config.json's
    ``specdec.defaults``), {} when it records none or the file does not read."""
    import json
    import os

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            best = (json.load(handle).get("specdec") or {}).get("defaults") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return best if isinstance(best, dict) else {}


def record_setting(folder, setting: dict, replace: bool = True) -> Path:
    """Write ``setting`` as the drafter folder's measured-fastest setting (config.json's ``specdec.defaults``,
    what ``recorded_setting`` reads), atomically; ``replace=False``: only where it records none. Returns the file."""
    import json

    from specdec.models.files import write_atomic

    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    if replace or not (config.get("specdec") or {}).get("defaults"):
        config.setdefault("specdec", {})["defaults"] = setting
        write_atomic(path, json.dumps(config, indent=2) + "\n")
    return path


def recorded_defaults(folder: str) -> tuple[int | None, TreeConfig | None]:
    """(k, tree) a drafter folder records as measured fastest, each None when it records none: what a
    generation that asks for neither uses."""
    best = recorded_setting(folder)
    tree = best.get("tree")
    return best.get("num_draft_tokens"), TreeConfig(*tree) if tree else None


def recorded_p_min(folder: str) -> float | None:
    """The confidence cut (``ConfidenceStop``'s p_min) a drafter folder records with its fastest setting, or None."""
    value = recorded_setting(folder).get("p_min")
    return float(value) if isinstance(value, (int, float)) and 0.0 < value < 1.0 else None


DRAFT_VOCAB_FILE = "draft_vocab.json"  # beside a drafter that reads the target's head: the rows it drafts from


def read_draft_vocabulary(folder: str, vocab: int, required: bool = False) -> torch.Tensor | None:
    """The target ids a drafter folder restricts its drafts to (``specdec train draft-vocab``), sorted; None
    when it keeps the whole vocabulary. ``folder`` may name the file itself; ``required``: a missing file is
    an error too. A damaged or missing file is one line (DrafterMismatchError)."""
    import json
    import os

    from specdec.errors import DrafterMismatchError

    path = folder if os.path.isfile(folder) else os.path.join(folder, DRAFT_VOCAB_FILE)
    if not os.path.exists(path):
        if required:
            raise DrafterMismatchError(f"{path}: no draft vocabulary there (specdec train draft-vocab writes one)")
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            ids = torch.tensor(json.load(handle)["ids"], dtype=torch.long)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise DrafterMismatchError(f"{path}: not a draft vocabulary ({error})") from None
    if ids.dim() != 1 or not ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= vocab \
            or not bool((ids[1:] > ids[:-1]).all()):
        raise DrafterMismatchError(f"{path}: the ids must be distinct, sorted and within the target's "
                                   f"vocabulary of {vocab}")
    return ids


def over_vocabulary(logits: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Drafter logits [.., V_draft] over a draft vocabulary (``ids``: each slot's target id) as float32
    logits over the target's whole vocabulary [.., vocab], -inf outside it; None: as they are."""
    if ids is None:
        return logits.float()
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"), dtype=torch.float32)
    full[..., ids] = logits.float()
    return full


def cut_label(p_min: float | None) -> str:
    """What bench labels show of a drafter's cut ("p>=0.3"; none: "")."""
    return "" if p_min is None else f"p>={p_min:g}"


def check_p_min(p_min: float | None, folder: str | None = None) -> float | None:
    """The cut a drafter applies (None: none) from its ``p_min`` argument: a probability in (0, 1); 0: no cut;
    None: the one ``folder`` records beside its fastest setting (``recorded_p_min``), if any. Anything else is
    one line."""
    if p_min is None:
        return recorded_p_min(folder) if folder else None
    if not 0.0 <= float(p_min) < 1.0:
        raise InvalidArgumentError(f"draft p_min must be in (0, 1), or 0 for no cut, got {p_min:g}")
    return float(p_min) or None


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """[...] the probability a drafter's logits [..., V] give their most likely token: what a p_min cut reads."""
    return torch.softmax(logits.float(), -1).amax(-1)


class ConfidenceStop:
    """llama.cpp's ``--draft-p-min`` for drafters that draft one token at a time: a row stops at the first
    draft whose most likely token the drafter gives less than ``p_min`` (that draft is not proposed), and
    drafting stops once every row has stopped, so k becomes a ceiling. The decision on draft j reads the
    drafter's distribution of draft j, which depends on the drafts before it only, never on draft j (a
    sampled draft's own probability is not read) or on the target: speculative sampling stays exact,
    greedy output unchanged. ``p_min`` None: every row keeps all k drafts. It keeps the drafts it admits."""

    def __init__(self, p_min: float | None, batch: int, device):
        self.p_min = p_min
        self.going = torch.ones(batch, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.drafts: list[torch.Tensor] = []  # each [B]
        self.dists: list[torch.Tensor] = []   # each [B, V] when sampling

    def take(self, token: torch.Tensor, probs: torch.Tensor | None, logits: torch.Tensor) -> bool:
        """Count a draft (token [B]; when sampling, probs [B, V], the distribution it was sampled from;
        else logits [B, V] of the drafter) for the rows still drafting and keep it; False, keeping nothing,
        when no row is sure enough of it."""
        if self.p_min is not None:
            top = probs.amax(-1) if probs is not None else top_probability(logits)
            self.going &= top >= self.p_min
            if not bool(self.going.any()):
                return False
        self.lengths += self.going
        self.drafts.append(token)
        self.dists.append(probs)
        return True

    def proposal(self) -> Proposal:
        """The Proposal of the drafts kept."""
        if not self.drafts:  # no row was sure enough of its first draft: a plain step
            return Proposal(self.lengths.new_zeros(self.lengths.shape[0], 0), self.lengths)
        sampled = self.dists[0] is not None
        return Proposal(torch.stack(self.drafts, 1), self.lengths, torch.stack(self.dists, 1) if sampled else None)


def draft_from(logits: torch.Tensor, ids: torch.Tensor | None, vocab: int, sampling: SamplingConfig, generator):
    """(draft tokens, their distributions over the target's vocabulary or None when greedy) from drafter
    logits over a draft vocabulary (``ids``; None: the whole vocabulary): the argmax, or a sample."""
    if sampling.greedy:
        slot = kernels.argmax(logits)
        return (slot if ids is None else ids[slot]), None
    probs = probabilities(over_vocabulary(logits, ids, vocab), sampling)
    return sample(probs, generator), probs


class DeferredObserve:
    """A drafting session whose ``observe`` (a drafter network run over the committed tokens' features:
    EAGLE's layer, MTP's modules) waits until the next ``propose``: a step that does not draft (a policy's
    plain step, under load or between probes) then costs the drafter nothing, and the steps that waited
    enter the drafter together, in one run over all their columns. The native kernels give a row the same
    bits whatever the block, so the drafts are the ones the session would make observing step by step.

    The waiting columns are kept as they come (``batch.Backlog``, moved with the rows that leave) and
    handed on with the batch's ``Sequences`` (whose last columns are the tokens that went with them). They
    stay right-aligned (TargetFeatures' layout): only the first step that waits can commit different
    counts per row (the prompt, or a step that drafted: a drafting step enters what waited before it), and
    every step after it commits one token per row. Rows that join enter what waits on both sides first
    (the engine extends the session before the batch's Sequences). Anything else is the wrapped
    session's."""

    def __init__(self, session, batch_size: int):
        from specdec.batch import Backlog

        self.session = session
        self.backlog = Backlog(batch_size)
        self.seqs: Sequences | None = None  # the batch's, as the engine grows it
        self.shape: tuple[int, int] | None = None  # (layers, hidden) of the features

    def __getattr__(self, name):
        return getattr(self.session, name)

    def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
        self.seqs, self.shape = seqs, tuple(features.states.shape[2:])
        self.backlog.append(features.states.flatten(2), features.valid)

    def enter(self) -> None:
        """Hand the waiting columns to the session."""
        states, valid = self.backlog.waiting()
        if states is not None:
            self.session.observe(self.seqs, TargetFeatures(states.unflatten(2, self.shape), valid))
            self.backlog.clear()

    def propose(self, seqs: Sequences, k: int):
        self.enter()
        return self.session.propose(seqs, k)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        self.session.accepted(seqs, num_accepted)

    def select_rows(self, index: torch.Tensor) -> None:
        self.session.select_rows(index)
        self.backlog.select_rows(index)

    def extend(self, other: "DeferredObserve") -> None:
        self.enter()
        other.enter()
        self.session.extend(other.session)
        self.backlog.extend(other.backlog)  # both empty: the rows only
