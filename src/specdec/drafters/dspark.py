"""DSpark session: DFlash's one-pass block, then the drafts taken left to right through the Markov head.

The block ``[anchor, mask, ..., mask]`` of k inputs runs in one drafter pass on DFlash's context
cache (drafters/dflash.py keeps the cache, the waiting features and the batch bookkeeping); every
slot predicts, the anchor's too. Slot j's logits are the head's plus the Markov term of the draft
before it, so the drafts are taken one after the other: the argmax (greedy), or a sample of that
exact softmax (sampling), whose distribution goes to the verifier. The confidence head's estimate
that each draft survives, given the drafts before it, rides along in ``Proposal.confidence`` for
the confidence policies (specdec.schedule); it reads only the drafts before each slot.
"""

from __future__ import annotations

import torch

from specdec.batch import Sequences
from specdec.drafters.base import Proposal, draft_from
from specdec.drafters.dflash import DFlash, DFlashSession
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


class DSparkSession(DFlashSession):
    def propose(self, seqs: Sequences, k: int) -> Proposal:
        drafts = max(1, min(k, self.block_size))
        runtime = self.runtime
        anchors = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])[:, 0]  # the pending tokens
        out = self.enter(anchors, drafts)                                   # [B, drafts, H]: every slot drafts
        head = runtime.logits(out)                                          # [B, drafts, V]
        hidden = runtime.normed(out)
        previous, tokens, dists, confidences = anchors, [], [], []
        for j in range(drafts):
            logits, confidence = runtime.slot(head[:, j], hidden[:, j], previous, j)
            previous, probs = draft_from(logits, runtime.rows, self.vocab, self.sampling, self.generator)
            if probs is not None:
                dists.append(probs)
            tokens.append(previous)
            confidences.append(confidence)
        lengths = torch.full((anchors.shape[0],), drafts, dtype=torch.long, device=anchors.device)
        confidence = torch.stack(confidences, 1) if confidences[0] is not None else None
        return Proposal(torch.stack(tokens, 1), lengths, torch.stack(dists, 1) if dists else None,
                        confidence=confidence)


DSpark.session_class = DSparkSession
