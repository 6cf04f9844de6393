"""EAGLE-1 and EAGLE-3 sessions: one drafter layer over the target's features, chains and EAGLE-2 trees.

The drafter's own KV cache holds one entry per committed token pair (f_t, x_{t+1}): the target's
feature at t and the token after it. ``observe`` appends the pairs the target just committed (after
the prefill and after every verification), and keeps the drafter's output at each row's last pair,
which predicts the first draft. Drafting adds entries fed with the drafter's own outputs; after
verification ``accepted`` drops them all (the cache rolls back to the committed pairs), and the
next ``observe`` re-enters the accepted tokens with the target's true features.
"""

from __future__ import annotations

import os
import warnings

import torch

from specdec.backends.target import resolve_model
from specdec.batch import Sequences
from specdec.errors import TargetMismatchWarning, UnsupportedModelError
from specdec.models import eagle, kernels, llama
from specdec.drafters.base import (ConfidenceStop, DecodeContext, DeferredObserve, FeatureSpec, Proposal,
                                   TargetFeatures, check_p_min, cut_label, draft_from, read_draft_vocabulary,
                                   recorded_defaults)
from specdec.drafters.tree import dynamic_tree, tree_scores


class Eagle:
    """An EAGLE drafter folder (EAGLE-1 or EAGLE-3, read from its config.json).

    ``version``: refuse a folder of the other version (1 or 3); None accepts either.
    """

    def __init__(self, path: str | os.PathLike, version: int | None = None, draft_vocab: bool = True,
                 p_min: float | None = None, quantize: str | None = None):
        """``draft_vocab``: EAGLE-1 drafts from the folder's draft vocabulary (``specdec train draft-vocab``) when
        it has one; False: from the target's whole head. ``p_min`` (llama.cpp's ``--draft-p-min``): a row's
        chain stops before its first draft whose most likely token the drafter gives less than this
        probability (``drafters.base.ConfidenceStop``); None: the folder's recorded one (``bench --record``),
        else none; 0: none. ``quantize`` (q8_0, q4_0, q4_1): the network's matrices block-quantized at load
        and run with int8 activations (fewer bytes a draft; the target's output is unchanged); None: the
        target's dtype, or Q8_0 beside a quantized target."""
        self.path = str(resolve_model(path))  # a folder, or a real model's drafter by name: smollm2-135m/eagle3
        self.p_min = check_p_min(p_min, self.path)
        self.quantize = llama.check_drafter_quantize(quantize, "EAGLE drafter")
        self.net = eagle.load_net(self.path, expect_version=version)
        self.config = self.net.config
        self.vocabulary = None
        if self.config.version == 1 and draft_vocab:
            self.vocabulary = read_draft_vocabulary(self.path, self.config.vocab_size)
        self.name = self.config.name
        self.features = FeatureSpec(hidden_layers=self.config.hidden_layers(), embedding=True,
                                    head=self.config.version == 1)
        self.default_draft_tokens, self.default_tree = recorded_defaults(self.path)
        self._runtimes: dict = {}

    @property
    def version(self) -> int:
        return self.config.version

    @property
    def setting(self) -> str:
        """What bench's labels show of this drafter's own settings."""
        return " ".join(filter(None, (cut_label(self.p_min), self.quantize)))

    def check_target(self, target) -> None:
        check_target(self, self.config.target, self.config.hidden_size, self.config.vocab_size, target,
                     f"the EAGLE-{self.version} drafter in {self.path}")

    def runtime(self, target) -> eagle.EagleRuntime:
        dtype = target.backend.dtype
        key = (id(target), dtype)
        if key not in self._runtimes:
            require_kernels(target, "EAGLE drafters")
            self._runtimes = {key: eagle.EagleRuntime(self.net, target.input_embeddings(), target, dtype,
                                                      llama.drafter_qtype(target, self.quantize), self.vocabulary)}
        return self._runtimes[key]

    def start(self, context: DecodeContext, seqs: Sequences) -> DeferredObserve:
        self.check_target(context.target)
        session = EagleSession(self.runtime(context.target), context, seqs.batch_size, self.p_min)
        return DeferredObserve(session, seqs.batch_size)  # steps that do not draft run no drafter layer


def require_kernels(target, what: str) -> None:
    """Refuse in one line when a drafter network's kernels cannot run next to ``target``."""
    dtype = target.backend.dtype
    reason = kernels.available() or (None if kernels.supported_dtype(dtype) else f"dtype {dtype}")
    if reason or target.device.type != "cpu":
        raise UnsupportedModelError(f"{what} run on specdec's CPU kernels: "
                                    f"{reason or f'the target is on {target.device}'}")


def check_target(drafter, record, hidden: int, vocab: int, target, what: str) -> None:
    """Refuse a target that ``drafter`` (its hidden size, vocabulary, feature layers) does not fit, in
    one line; warn once per target when it fits but is not the one it was trained for."""
    warning = record.check(target, what, hidden, vocab, drafter.features.hidden_layers)
    if warning and getattr(drafter, "_warned_for", None) is not target:
        drafter._warned_for = target
        warnings.warn(warning, TargetMismatchWarning, stacklevel=4)


class EagleSession:
    def __init__(self, runtime: eagle.EagleRuntime, context: DecodeContext, batch_size: int,
                 p_min: float | None = None):
        self.runtime, self.p_min = runtime, p_min
        self.sampling, self.generator = context.sampling, context.generator
        self.pad = context.target.pad_token_id
        self.vocab = context.target.vocab_size
        self.tree = context.tree
        self.cache = runtime.new_cache(batch_size, context.cache_capacity)
        self.last: torch.Tensor | None = None   # [B, H] output at each row's last committed pair
        self.base: torch.Tensor | None = None   # [B] committed pairs while drafts sit on top

    def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
        width = features.states.shape[1]
        tokens, _ = seqs.window(seqs.lengths - width, seqs.lengths, self.pad)  # x_{t+1} of each feature f_t
        out = self.cache.run(tokens, features.states.flatten(2), features.valid)  # [B, m, H]
        self.last = out[:, -1]

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        self.base = self.cache.lengths.clone()
        if self.tree is not None:
            return self._propose_tree()
        out = self.last
        stop = ConfidenceStop(self.p_min, out.shape[0], out.device)
        for step in range(k):
            logits = self.runtime.logits(out)
            token, probs = draft_from(logits, self.runtime.draft_ids, self.vocab, self.sampling, self.generator)
            if not stop.take(token, probs, logits):
                break
            if step + 1 < k:
                out = self.cache.step(token, out)
        return stop.proposal()

    def _scores(self, out: torch.Tensor) -> torch.Tensor:
        """Log-scores over the draft vocabulary slots (warped when sampling)."""
        return tree_scores(self.runtime.logits(out), self.sampling)

    def _propose_tree(self) -> Proposal:
        """EAGLE-2: expand the best nodes by the drafter's own confidence (tree.py)."""
        cache, state = self.cache, {"out": None}

        def expand(frontier_token, parent_slot, sees, depth):
            batch, width = frontier_token.shape
            if parent_slot is None:
                parents = self.last[:, None].expand(batch, width, -1)
            else:
                previous = state["out"]
                parents = previous.gather(1, parent_slot[:, :, None].expand(-1, -1, previous.shape[2]))
            positions = (self.base + depth - 1)[:, None].expand(batch, width)
            everyone = torch.ones(batch, width, dtype=torch.bool, device=frontier_token.device)
            out = cache.run(frontier_token, parents.contiguous(), everyone, block_mask=sees, positions=positions,
                            fused=False)
            state["out"] = out
            return self._scores(out)

        return dynamic_tree(self._scores(self.last), expand, self.tree, self.runtime.draft_ids)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        if self.base is not None:  # drop every drafted entry; ``observe`` enters the accepted ones anew
            self.cache.truncate(self.base)
            self.cache.compact()
            self.base = None

    def select_rows(self, index: torch.Tensor) -> None:
        self.cache.select_rows(index)
        if self.last is not None:
            self.last = self.last.index_select(0, index)

    def extend(self, other: "EagleSession") -> None:
        self.cache.extend(other.cache)
        self.last = torch.cat([self.last, other.last])
