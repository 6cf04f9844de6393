"""Medusa session: heads on the target's last feature propose a static token tree.

A node at depth d with rank r (from the tree's index paths) is rank r of head d - 1's top tokens,
all read from the feature of the token before the pending one; the tree is verified in one target
pass under a tree mask (verify/tree.py), so greedy output is the target's own and sampling keeps the
target's distribution (deterministic top-k candidates are point masses).
"""

from __future__ import annotations

import os

import torch

from specdec.backends.target import resolve_model
from specdec.batch import Sequences
from specdec.errors import InvalidArgumentError, UnsupportedModelError
from specdec.models import medusa
from specdec.drafters.base import DecodeContext, FeatureSpec, Proposal, TargetFeatures, read_draft_vocabulary
from specdec.drafters.eagle import check_target, require_kernels
from specdec.drafters.tree import static_tree


class Medusa:
    """A Medusa folder; ``choices`` replaces its default tree (index paths, e.g. [[0], [0, 0], [1]])."""

    name = "medusa"

    def __init__(self, path: str | os.PathLike, choices=None, draft_vocab: bool = True):
        """``draft_vocab``: heads that end in the target's head read the folder's draft vocabulary (``specdec
        train draft-vocab``) when it has one; False: the whole head."""
        self.path = str(resolve_model(path))  # a folder, or a real model's drafter by name: smollm2-135m/medusa
        self.net = medusa.load_net(self.path)
        self.config = self.net.config
        self.vocabulary = None
        if self.config.original_lm_head and draft_vocab:
            self.vocabulary = read_draft_vocabulary(self.path, self.config.vocab_size)
        choices = choices if choices is not None else self.config.medusa_choices
        if not choices:
            choices = [[0] * d for d in range(1, self.config.medusa_num_heads + 1)]  # a chain of top-1 tokens
        try:
            self.parents, self.depths, self.ranks = static_tree(choices)
        except ValueError as exc:
            raise InvalidArgumentError(f"bad Medusa tree: {exc}") from None
        if int(self.depths.max()) > self.config.medusa_num_heads:
            raise InvalidArgumentError(f"the tree is {int(self.depths.max())} deep, the drafter has "
                                       f"{self.config.medusa_num_heads} heads")
        self.choices = [list(p) for p in choices]
        self.tree_nodes = len(self.parents)  # the loop sizes its caches for blocks of this many drafts
        self.features = FeatureSpec(hidden_layers=self.config.hidden_layers())
        self._runtime = None

    def start(self, context: DecodeContext, seqs: Sequences) -> "MedusaSession":
        target = context.target
        check_target(self, self.config.target, self.config.hidden_size, self.config.vocab_size, target,
                     f"the Medusa drafter in {self.path}")
        if context.tree is not None:
            raise InvalidArgumentError("Medusa verifies its own static tree (medusa_choices in its folder, or "
                                       "choices=); dynamic tree options do not apply")
        if not target.backend.supports_trees:
            raise UnsupportedModelError(f"{target.backend.description} cannot verify token trees, which Medusa needs")
        dtype = target.backend.dtype
        key = (id(target), dtype) if self.config.original_lm_head else dtype
        if self._runtime is None or self._runtime[0] != key:
            require_kernels(target, "Medusa heads")
            self._runtime = (key, medusa.MedusaRuntime(self.net, dtype, target, self.vocabulary,
                                                       heads=int(self.depths.max())))
        return MedusaSession(self, self._runtime[1])


class MedusaSession:
    def __init__(self, drafter: Medusa, runtime: medusa.MedusaRuntime):
        self.runtime = runtime
        self.parents, self.depths, self.ranks = drafter.parents, drafter.depths, drafter.ranks
        self.top = int(self.ranks.max()) + 1
        self.feature: torch.Tensor | None = None  # [B, H] the last committed token's feature

    def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
        self.feature = features.states[:, -1, 0]

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        logits = self.runtime.logits(self.feature)  # [B, heads, V]
        top = logits.float().topk(self.top, dim=-1).indices  # [B, heads, top]
        if self.runtime.draft_ids is not None:
            top = self.runtime.draft_ids[top]
        batch = top.shape[0]
        tokens = top[:, self.depths - 1, self.ranks]  # [B, N]
        size = tokens.shape[1]
        return Proposal(tokens, torch.full((batch,), size, dtype=torch.long), None,
                        self.parents.expand(batch, size), self.depths.expand(batch, size))

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, index: torch.Tensor) -> None:
        self.feature = self.feature.index_select(0, index)

    def extend(self, other: "MedusaSession") -> None:
        self.feature = torch.cat([self.feature, other.feature])
