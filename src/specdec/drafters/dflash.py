"""DFlash session: a whole block of drafts in one drafter pass over the target's fused features.

The drafter's cache holds one column per committed token: each layer's keys and values of that
token's fused context (models/dflash.py). ``observe`` only keeps the target's features of the
tokens a step committed; the next ``propose`` enters them and drafts in the same pass:
[new context ; anchor, mask, ..., mask], the anchor being the pending token (the last one the target
produced, whose own features do not exist yet). The block's columns are dropped right after, so a
rejected draft never leaves anything behind and ``accepted`` has nothing to roll back.

Drafts are the argmax of each block slot (greedy), or samples of each slot's own distribution
(sampling): the slots are predicted in parallel, so slot j's distribution does not depend on the
drafts before it, and the verifier's chain rule stays exact with those distributions.
"""

from __future__ import annotations

import os

import torch

from specdec.backends.target import resolve_model
from specdec.batch import Backlog, Sequences
from specdec.errors import InvalidArgumentError
from specdec.models import dflash, llama
from specdec.drafters.base import (DecodeContext, FeatureSpec, Proposal, TargetFeatures, draft_from,
                                   read_draft_vocabulary, recorded_defaults)
from specdec.drafters.eagle import check_target, require_kernels


class DFlash:
    """A DFlash folder. ``block_size``: verify blocks of this many tokens (the pending one and
    block_size - 1 drafts), at most the trained one (the default)."""

    name = "dflash"
    label = "DFlash"

    load_net = staticmethod(dflash.load_net)
    runtime_class = dflash.DFlashRuntime
    anchor_drafts = False  # the anchor slot predicts nothing: a block of B gives B - 1 drafts
    supports_trees = False  # its slots ignore the drafts before them: branches would all score alike

    def __init__(self, path: str | os.PathLike, block_size: int | None = None, draft_vocab: bool = True,
                 quantize: str | None = None):
        """``draft_vocab``: draft from the folder's draft_vocab.json (``specdec train draft-vocab``) when it has
        one, computing only those rows of the target's head. ``quantize`` (q8_0, q4_0, q4_1): the network's
        matrices block-quantized at load, run with int8 activations (fewer bytes a step; the target's
        output is unchanged); None: the target's dtype, or Q8_0 beside a quantized target."""
        self.path = str(resolve_model(path))  # a folder, or a real model's drafter by name: smollm2-135m/dflash
        self.quantize = llama.check_drafter_quantize(quantize, f"{self.label} drafter")
        self.net = self.load_net(self.path)
        self.config = self.net.config
        self.vocabulary = read_draft_vocabulary(self.path, self.config.vocab_size) if draft_vocab else None
        trained = self.config.block_size
        block_size = trained if block_size is None else int(block_size)
        smallest = 1 if self.anchor_drafts else 2
        if not smallest <= block_size <= trained:
            raise InvalidArgumentError(f"{self.label} block size must be in {smallest}..{trained} (the drafter in "
                                       f"{self.path} was trained with blocks of {trained}), got {block_size}")
        self.block_size = block_size
        self.drafts = drafts = block_size if self.anchor_drafts else block_size - 1
        recorded, tree = recorded_defaults(self.path)   # the setting that measured fastest, when the block is the trained one
        self.default_draft_tokens = min(recorded or drafts, drafts)
        self.default_tree = tree if self.supports_trees and tree is not None and tree.depth <= drafts else None
        self.features = FeatureSpec(hidden_layers=self.config.hidden_layers(), embedding=True, head=True)
        self._runtimes: dict = {}

    @property
    def setting(self) -> str:
        """What bench's labels show of this drafter's own settings: its weights' quantization."""
        return self.quantize or ""

    def check_target(self, target) -> None:
        check_target(self, self.config.target, self.config.hidden_size, self.config.vocab_size, target,
                     f"the {self.label} drafter in {self.path}")
        if not 0 <= self.config.mask_token_id < target.vocab_size:
            raise InvalidArgumentError(f"the {self.label} drafter's mask token {self.config.mask_token_id} is not a row of "
                                       f"the target's embedding ({target.vocab_size} rows)")

    def runtime(self, target) -> dflash.DFlashRuntime:
        key = (id(target), target.backend.dtype)
        if key not in self._runtimes:
            require_kernels(target, f"{self.label} drafters")
            self._runtimes = {key: self.runtime_class(self.net, target.input_embeddings(), target,
                                                      target.backend.dtype,
                                                      llama.drafter_qtype(target, self.quantize), self.vocabulary)}
        return self._runtimes[key]

    def start(self, context: DecodeContext, seqs: Sequences) -> "DFlashSession":
        self.check_target(context.target)
        tree = context.tree
        if tree is not None and not self.supports_trees:
            raise InvalidArgumentError(f"{self.label} drafts chains (one block per step); token-tree options do not apply")
        if tree is not None and tree.depth > self.drafts:
            raise InvalidArgumentError(f"a {self.label} tree is at most as deep as its block ({self.drafts} drafts for "
                                       f"the drafter in {self.path}), got depth {tree.depth}")
        return self.session_class(self.runtime(context.target), context, seqs.batch_size, self.block_size)


class DFlashSession:
    def __init__(self, runtime: dflash.DFlashRuntime, context: DecodeContext, batch_size: int, block_size: int):
        self.runtime = runtime
        self.vocab = context.target.vocab_size
        self.block_size = block_size
        self.sampling, self.generator = context.sampling, context.generator
        capacity = None if context.cache_capacity is None else context.cache_capacity + block_size
        self.cache = runtime.new_cache(batch_size, capacity)
        self.backlog = Backlog(batch_size)  # features of committed tokens not yet in the cache

    def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
        self.backlog.append(features.states.flatten(2), features.valid)  # several steps without drafts: all wait

    def enter(self, anchors: torch.Tensor, block: int) -> torch.Tensor:
        """The waiting context entered and a block [anchor, mask, ...] of ``block`` inputs run on it:
        its outputs [B, block, H]."""
        states, valid = self.backlog.waiting()
        out = self.cache.draft(states, valid, anchors, block)
        self.backlog.clear()
        self.cache.compact()
        return out

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        drafts = max(1, min(k, self.block_size - 1))
        anchors = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])[:, 0]  # the pending tokens
        out = self.enter(anchors, drafts + 1)  # [B, drafts + 1, H]
        logits = self.runtime.logits(out[:, 1:])  # slot 0 is the anchor: it predicts nothing
        lengths = torch.full((anchors.shape[0],), drafts, dtype=torch.long, device=anchors.device)
        tokens, probs = draft_from(logits, self.runtime.rows, self.vocab, self.sampling, self.generator)
        return Proposal(tokens, lengths, probs)  # probs: [B, drafts, V] when sampling

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass  # the cache holds committed context only; the accepted tokens' features come with ``observe``

    def select_rows(self, index: torch.Tensor) -> None:
        self.cache.select_rows(index)
        self.backlog.select_rows(index)

    def extend(self, other: "DFlashSession") -> None:
        self.cache.extend(other.cache)
        self.backlog.extend(other.backlog)


DFlash.session_class = DFlashSession
