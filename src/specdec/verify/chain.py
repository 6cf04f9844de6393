"""Acceptance rules for a chain of drafts, one chain per row.

Shapes: B rows, k draft slots, V vocabulary. Row b proposes ``draft_lengths[b] <= k`` drafts; slots
past that are padding and never accepted. Both rules return ``(num_accepted [B], next_token [B])``:
the row keeps drafts ``[:num_accepted]`` and then ``next_token``, which is the target's correction
after a rejection or its bonus token after a fully accepted chain.
"""

from __future__ import annotations

import torch

from specdec.sampling import sample


def _accepted_prefix(accept: torch.Tensor, draft_lengths: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of accepted slots, limited to each row's drafts. accept: [B, k] bool."""
    in_draft = torch.arange(accept.shape[1], device=accept.device) < draft_lengths[:, None]
    return (accept & in_draft).long().cumprod(1).sum(1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  draft_lengths: torch.Tensor):
    """Accept drafts while they equal the target's argmax.

    target_logits: [B, k+1, V], position j scores the token after draft j (j = 0: after the context).
    draft_tokens: [B, k] long. draft_lengths: [B] long.
    """
    from specdec.models import kernels

    fast = kernels.greedy_accept(target_logits, draft_tokens, draft_lengths)  # one C call, where it runs
    if fast is not None:
        return fast
    target_tokens = target_logits.argmax(-1)  # [B, k+1]
    if draft_tokens.shape[1] == 0:  # nothing drafted: a plain decoding step
        return torch.zeros_like(draft_lengths), target_tokens[:, 0]
    num_accepted = _accepted_prefix(draft_tokens == target_tokens[:, :-1], draft_lengths)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def verify_sampling(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_lengths: torch.Tensor,
                    draft_probs: torch.Tensor | None, generator: torch.Generator | None):
    """Speculative sampling: the output is distributed exactly as sampling from ``target_probs``.

    target_probs: [B, k+1, V] warped target distributions. draft_probs: [B, k, V] the distributions
    the drafts were sampled from, or None for a deterministic drafter (a point mass on each draft).
    Draft x is accepted with probability min(1, target(x) / draft(x)); at the first rejection the
    next token comes from the normalised residual max(0, target - draft); after a fully accepted
    chain it is the bonus token, sampled from the target.
    """
    batch, k = draft_tokens.shape
    target_at_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)  # [B, k]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)  # [B, k]
    uniform = torch.rand(batch, k, generator=generator, device=target_probs.device)
    accept = uniform * draft_at_draft < target_at_draft  # u < p/q without dividing by q
    num_accepted = _accepted_prefix(accept, draft_lengths)

    rows = torch.arange(batch, device=target_probs.device)
    target_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < draft_lengths  # [B]
    slot = num_accepted.clamp_max(k - 1) if k > 0 else num_accepted
    if draft_probs is None:
        draft_next = torch.zeros_like(target_next)
        if k > 0:
            draft_next.scatter_(1, draft_tokens[rows, slot][:, None], 1.0)
    else:
        draft_next = draft_probs[rows, slot]
    residual = (target_next - draft_next).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A residual with no mass can only come from rounding (target == draft); fall back to the target.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_next)
    next_dist = torch.where(rejected[:, None], residual, target_next)
    next_token = sample(next_dist, generator)
    return num_accepted, next_token
