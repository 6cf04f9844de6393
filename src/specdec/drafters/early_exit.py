"""Early-exit self-speculation (LayerSkip): the target's first E layers, its final norm and its head draft.

Two ways to run it:

* **Shared layers** (the native backend, the default): drafting runs layers [0, E) of the pending
  token and of each draft in the target's own KV cache, one column at a time, and keeps each
  column's exit state (the input of layer E). Verification then runs layers [0, E) of the last
  draft only and layers [E, L) of the whole block, starting from those exit states: the early
  layers' keys, values and activations of the drafts are computed once. The drafting columns are
  rolled back (bookkeeping only) before the verification block re-enters the same columns
  (``NativeCache.begin_at``), so the cache's invariants are those of every other drafter.
* **Recompute** (the transformers backend, or ``reuse_kv=False``): the first E layers act as a
  separate draft model with their own KV cache, sharing the weights, and verification runs the
  whole network again, as transformers' ``assistant_early_exit`` does.

Both are lossless: the target's own verification decides every token.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.batch import Sequences
from specdec.drafters.base import DecodeContext, Proposal
from specdec.errors import InvalidArgumentError, UnsupportedModelError
from specdec.models import kernels
from specdec.sampling import probabilities, sample


def recorded_exit(config) -> int | None:
    """The exit layer a LayerSkip variant's config.json records (``specdec_layerskip.exit_layer``)."""
    record = getattr(config, "specdec_layerskip", None)
    if isinstance(record, dict) and record.get("exit_layer") is not None:
        return int(record["exit_layer"])
    return None


class EarlyExit:
    """Draft with the target's own first ``exit_layer`` layers (None: the layer its folder records,
    else half its depth). ``reuse_kv``: share the early layers' work with verification (native)."""

    name = "early-exit"

    def __init__(self, exit_layer: int | None = None, reuse_kv: bool = True):
        if exit_layer is not None and int(exit_layer) < 1:
            raise InvalidArgumentError(f"the exit layer must be >= 1, got {exit_layer}")
        self.exit_layer = None if exit_layer is None else int(exit_layer)
        self.reuse_kv = reuse_kv
        self._views: dict = {}

    def exit_for(self, target) -> int:
        """The exit layer for ``target``; one line when it is not inside [1, L)."""
        layers = int(target.num_layers)
        exit_layer = self.exit_layer or recorded_exit(target.config) or max(1, layers // 2)
        if not 1 <= exit_layer < layers:
            raise InvalidArgumentError(f"exit layer {exit_layer} is outside [1, {layers}): {target.name} has "
                                       f"{layers} layers")
        return exit_layer

    def shares_layers(self, target) -> bool:
        return self.reuse_kv and getattr(target.backend, "name", "") == "native"

    def start(self, context: DecodeContext, seqs: Sequences):
        target = context.target
        exit_layer = self.exit_for(target)
        if context.tree is not None:
            raise UnsupportedModelError("early-exit drafting builds chains, not token trees; drop --tree")
        if self.shares_layers(target):
            return SharedLayersSession(target.backend.model, exit_layer, context)
        from specdec.drafters.draft_model import DraftModelSession

        return DraftModelSession(self.view(target, exit_layer), context, seqs.batch_size, target.vocab_size)

    def view(self, target, exit_layer: int):
        """A backend running the target's first ``exit_layer`` layers (the recompute path), kept per target."""
        key = (id(target), exit_layer)
        if key not in self._views:
            backend = target.backend
            if getattr(backend, "name", "") == "native":
                from specdec.backends.native import NativeBackend

                view = NativeBackend(dataclasses.replace(backend.model, layers=backend.model.layers[:exit_layer]))
            else:
                from specdec.backends import hf

                view = hf.HFBackend.for_model(hf.first_layers(backend.model, exit_layer))
            self._views = {key: view}
        return self._views[key]


class SharedLayersSession:
    """Drafting in the target's own cache; ``verify_forward`` runs only what drafting did not."""

    def __init__(self, model, exit_layer: int, context: DecodeContext):
        self.model, self.exit_layer = model, exit_layer
        self.sampling, self.generator = context.sampling, context.generator
        self.cache = None
        self.base: torch.Tensor | None = None    # [B] live tokens before drafting
        self.start = 0                           # the cache's columns before drafting
        self.states: torch.Tensor | None = None  # [B, k, H] exit states of the pending token and drafts 1..k-1

    def share_cache(self, cache) -> None:
        self.cache = cache

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        cache = self.cache
        cache.truncate(cache.lengths)  # drop trailing columns no row uses (rows that left may leave some),
        self.base = cache.lengths.clone()  # so rolling back to ``base`` returns to exactly these columns
        self.start = cache.columns
        token = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])[:, 0]  # the pending token [B]
        states, drafts, dists = [], [], []
        for _ in range(k):
            state = cache.step(token, self.exit_layer)  # [B, H]
            states.append(state)
            logits = self.model.logits(state)  # the shared final norm and head
            if self.sampling.greedy:
                draft, probs = kernels.argmax(logits), None
            else:
                probs = probabilities(logits.float(), self.sampling)
                draft = sample(probs, self.generator)
            drafts.append(draft)
            dists.append(probs)
            token = draft
        self.states = torch.stack(states, dim=1)
        lengths = torch.full_like(seqs.lengths, k)
        return Proposal(torch.stack(drafts, dim=1), lengths, None if self.sampling.greedy else torch.stack(dists, 1))

    def verify_forward(self, cache, tokens, valid, logits_to_keep: int = 1, hidden_layers=(), block_mask=None,
                       positions=None):
        """[pending, drafts]: layers [0, E) of the last draft, then layers [E, L) of the whole block."""
        if block_mask is not None or positions is not None:
            raise UnsupportedModelError("early-exit drafting verifies chains only")
        last = cache.step(tokens[:, -1], self.exit_layer)
        hidden = torch.cat([self.states, last[:, None]], dim=1)  # [B, k + 1, H]
        cache.truncate(self.base)  # back to the committed columns; the early layers' entries stay in place
        if cache.columns != self.start:
            raise RuntimeError(f"early-exit verification would enter column {cache.columns}, drafting began at "
                               f"{self.start}")
        block = cache.begin_at(hidden, valid, self.exit_layer, hidden_layers)
        return cache.finish(block, logits_to_keep)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        self.base = self.states = None  # the loop rolled the shared cache back to what was accepted

    def select_rows(self, index: torch.Tensor) -> None:
        pass  # the loop selects the shared cache's rows

    def extend(self, other: "SharedLayersSession") -> None:
        pass  # the loop extends the shared cache
