"""DSpark session: DFlash's one-pass block, then the drafts taken left to right through the Markov head.

The block ``[anchor, mask, ..., mask]`` of k inputs runs in one drafter pass on DFlash's context
cache (drafters/dflash.py keeps the cache, the waiting features and the batch bookkeeping); every
slot predicts, the anchor's too. Slot j's logits are the head's plus the Markov term of the draft
before it, so the drafts are taken one after the other: the argmax (greedy), or a sample of that
exact softmax (sampling), whose distribution goes to the verifier. The confidence head's estimate
that each draft survives, given the drafts before it, rides along in ``Proposal.confidence`` for
the confidence policies (specdec.schedule); it reads only the drafts before each slot.

Trees (EAGLE-2's dynamic trees, drafters/tree.py): the block's backbone outputs do not depend on the
drafts, only the Markov term does, so every branch at depth d shares slot d's head logits and adds
the Markov term of its own parent token. A tree of depth D costs one block pass of D inputs plus
one rank-r product per expanded node; its children are top-k choices, exact under the tree rule.
"""

from __future__ import annotations

import torch

from specdec.batch import Sequences
from specdec.drafters.base import DecodeContext, Proposal, draft_from
from specdec.drafters.dflash import DFlash, DFlashSession
from specdec.drafters.tree import dynamic_tree, tree_scores
from specdec.models import dspark


class DSpark(DFlash):
    """A DSpark folder. ``block_size``: drafts per step (block inputs; every slot drafts), at most the
    trained block (the default, or the setting recorded as measured fastest)."""

    name = "dspark"
    label = "DSpark"
    has_confidence = True

    load_net = staticmethod(dspark.load_net)
    runtime_class = dspark.DSparkRuntime
    anchor_drafts = True
    supports_trees = True


class DSparkSession(DFlashSession):
    def __init__(self, runtime, context: DecodeContext, batch_size: int, block_size: int):
        super().__init__(runtime, context, batch_size, block_size)
        self.tree = context.tree

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        if self.tree is not None:
            return self._propose_tree(seqs)
        drafts = max(1, min(k, self.block_size))
        runtime = self.runtime
        anchors = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])[:, 0]  # the pending tokens
        out = self.enter(anchors, drafts)                                   # [B, drafts, H]: every slot drafts
        head = runtime.logits(out)                                          # [B, drafts, V]
        hidden = runtime.normed(out)
        with torch.inference_mode():
            chain = runtime.greedy_chain(head, anchors) if self.sampling.greedy else None
            if chain is not None:  # the loop below in one kernel call, the same drafts
                tokens, codes = chain
                dists = None
            else:
                tokens, codes, dists = self._left_to_right(head, hidden, anchors)
            # every slot's confidence at once: slot j's reads its output and the draft before it only
            confidence = runtime.confidences(hidden, codes) if runtime.confidence is not None else None
        lengths = torch.full((anchors.shape[0],), drafts, dtype=torch.long, device=anchors.device)
        return Proposal(tokens, lengths, dists, confidence=confidence)

    def _left_to_right(self, head: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor):
        """(drafts [B, S], codes [B, S, r], distributions [B, S, V] or None when greedy): slot after slot, each
        with the Markov term of the draft before it, argmaxed or sampled."""
        runtime = self.runtime
        previous, tokens, dists, codes = anchors, [], [], []
        for j in range(head.shape[1]):
            logits, code = runtime.markov(head[:, j], hidden[:, j], previous)
            previous, probs = draft_from(logits, runtime.rows, self.vocab, self.sampling, self.generator)
            if probs is not None:
                dists.append(probs)
            tokens.append(previous)
            codes.append(code)
        return torch.stack(tokens, 1), torch.stack(codes, 1), torch.stack(dists, 1) if dists else None

    def _propose_tree(self, seqs: Sequences) -> Proposal:
        runtime = self.runtime
        anchors = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])[:, 0]
        out = self.enter(anchors, self.tree.depth)                  # [B, D, H]: slot d drafts depth d + 1
        head, hidden = runtime.logits(out), runtime.normed(out)     # [B, D, S], [B, D, H]
        with torch.inference_mode():
            root, _ = runtime.markov(head[:, 0], hidden[:, 0], anchors)

        def expand(frontier_token, parent_slot, sees, depth):     # every branch: slot `depth`, its own parent
            batch, width = frontier_token.shape
            with torch.inference_mode():
                logits, _ = runtime.markov(head[:, depth, None].expand(-1, width, -1).reshape(batch * width, -1),
                                           hidden[:, depth, None].expand(-1, width, -1).reshape(batch * width, -1),
                                           frontier_token.reshape(-1))
            return tree_scores(logits.view(batch, width, -1), self.sampling)

        return dynamic_tree(tree_scores(root, self.sampling), expand, self.tree, runtime.rows)


DSpark.session_class = DSparkSession
