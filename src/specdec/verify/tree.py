"""Acceptance rules for a tree of drafts, one tree per row, and the tree utilities they share.

Shapes: B rows, N node slots, V vocabulary. Row b's tree has ``num_nodes[b] <= N`` nodes; slots past
that are padding and are never read. Its root is the row's pending token (already committed), and
    tokens [B, N] long     the token of each node;
    parents [B, N] long    the index of each node's parent node, -1 for a child of the root;
                           parents come before their children (parents[b, i] < i);
    num_nodes [B] long     valid nodes per row.
The target scores the root and every node: position 0 of ``target_logits`` / ``target_probs``
[B, N+1, V] is the distribution after the root, position i+1 the distribution after node i.
A chain of k drafts is the tree ``parents = [-1, 0, 1, ..., k-2]``.

Both rules return ``(num_accepted [B], path [B, D], next_token [B])``: the row keeps the tokens of
the nodes ``path[b, :num_accepted[b]]`` (root to leaf; -1 pads, D = max(num_accepted)), then
``next_token``, the target's correction after a rejection or its bonus token after a leaf.
"""

from __future__ import annotations

import math

import torch

from specdec.errors import InvalidArgumentError
from specdec.models import kernels
from specdec.sampling import sample


# Tree utilities -----------------------------------------------------------------------------------
def check_tree(parents: torch.Tensor, num_nodes: torch.Tensor) -> None:
    """Raise InvalidArgumentError unless every valid node's parent is -1 or an earlier node."""
    if parents.dim() != 2 or num_nodes.shape != parents.shape[:1]:
        raise InvalidArgumentError(f"parents must be [B, N] and num_nodes [B], got {tuple(parents.shape)} "
                                   f"and {tuple(num_nodes.shape)}")
    size = parents.shape[1]
    if bool(((num_nodes < 0) | (num_nodes > size)).any()):
        raise InvalidArgumentError(f"num_nodes must lie in [0, {size}], got {num_nodes.tolist()}")
    index = torch.arange(size, device=parents.device)
    valid = index < num_nodes[:, None]  # [B, N]
    bad = valid & ((parents < -1) | (parents >= index))
    if bool(bad.any()):
        row, node = bad.nonzero()[0].tolist()
        raise InvalidArgumentError(f"row {row}: node {node} has parent {int(parents[row, node])}; a parent "
                                   "must be -1 (the root) or an earlier node")


def _valid_and_clean(parents: torch.Tensor, num_nodes: torch.Tensor):
    """valid [B, N] bool, and parents with every padding node hung from the root (never read as data)."""
    valid = torch.arange(parents.shape[1], device=parents.device) < num_nodes[:, None]
    return valid, torch.where(valid, parents, -1)


def ancestor_mask(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: node i sees node j iff j is i or one of its ancestors (the tree attention mask).

    Padding nodes see only themselves. Ancestor sets are closed under composition, so squaring the
    "self or parent" relation ceil(log2 N) times reaches every ancestor of a node at depth <= N.
    """
    batch, size = parents.shape
    _, parents = _valid_and_clean(parents, num_nodes)
    step = torch.eye(size, device=parents.device).expand(batch, size, size).clone()  # [B, N, N]
    has_parent = parents >= 0
    rows, nodes = has_parent.nonzero(as_tuple=True)
    step[rows, nodes, parents[rows, nodes]] = 1.0
    for _ in range(math.ceil(math.log2(max(size, 2)))):
        step = (step @ step).clamp_max(1.0)  # entries stay 0/1, so float matmul is exact
    return step > 0


def depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N] long: 1 for children of the root, parent's depth + 1 below; 0 for padding."""
    valid, _ = _valid_and_clean(parents, num_nodes)
    return ancestor_mask(parents, num_nodes).sum(-1) * valid


def accepted_path(parents: torch.Tensor, last_node: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """[B, D] node indices root -> last_node, padded with -1; D = max(num_accepted).

    last_node: [B] long, the deepest accepted node (ignored where num_accepted == 0).
    num_accepted: [B] long, its depth.
    """
    width = int(num_accepted.max()) if num_accepted.numel() else 0
    path = torch.full((parents.shape[0], width), -1, dtype=torch.long, device=parents.device)
    node = last_node.clone()
    slot = num_accepted - 1  # where `node` goes in the path; walks up to 0
    rows = torch.arange(parents.shape[0], device=parents.device)
    for _ in range(width):
        here = slot >= 0
        path[rows[here], slot[here]] = node[here]
        node = torch.where(here, parents.gather(1, node.clamp_min(0)[:, None]).squeeze(1), node)
        slot = slot - 1
    return path


# Greedy -------------------------------------------------------------------------------------------
def verify_tree_greedy(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       num_nodes: torch.Tensor):
    """Keep the longest root-to-node path whose every token is the target's argmax at its parent.

    target_logits: [B, N+1, V]. Several longest paths exist only when siblings repeat a token; then
    the path through the first such sibling (in node order) at every level is taken.
    """
    check_tree(parents, num_nodes)
    batch, size = tokens.shape
    target_tokens = kernels.argmax(target_logits)  # [B, N+1]: torch's index, in one native call
    if size == 0:
        return (torch.zeros(batch, dtype=torch.long, device=tokens.device),
                torch.empty(batch, 0, dtype=torch.long, device=tokens.device), target_tokens[:, 0])
    valid, parents = _valid_and_clean(parents, num_nodes)
    matches = valid & (tokens == target_tokens.gather(1, parents + 1))  # [B, N]: right token at its parent
    sees = ancestor_mask(parents, num_nodes)  # [B, N, N]
    alive = valid & ~(sees & ~matches[:, None, :]).any(-1)  # every node root -> i matches
    depth = sees.sum(-1) * alive  # [B, N], 0 where not alive
    # deepest[b, j]: the greatest depth of an alive node in j's subtree (j included).
    deepest = ((sees & alive[:, :, None]) * depth[:, :, None]).amax(1)  # [B, N]
    num_accepted = depth.amax(1)  # [B]

    # Walk down from the root, each time into the first child that leads to a longest path.
    width = int(num_accepted.max())
    path = torch.full((batch, width), -1, dtype=torch.long, device=tokens.device)
    current = torch.full((batch,), -1, dtype=torch.long, device=tokens.device)
    leads = alive & (deepest == num_accepted[:, None])  # [B, N]
    for level in range(width):
        children = leads & (parents == current[:, None])
        found = children.any(1)
        child = children.long().argmax(1)  # the first True
        path[:, level] = torch.where(found, child, -1)
        current = torch.where(found, child, current)
    next_token = target_tokens.gather(1, (current + 1)[:, None]).squeeze(1)
    return num_accepted, path, next_token


# Sampling -----------------------------------------------------------------------------------------
def _accepts(uniform: torch.Tensor, target_at: torch.Tensor, draft_at: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, target/draft): u < p/q written without dividing by q."""
    return uniform * draft_at < target_at


def _residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, target - draft)) per row [B, V], the law of the token after a rejection.

    Its mass sum(max(0, p - q)) = 1 - sum(min(p, q)) is exactly the probability of rejecting, so a
    row with no mass left had p <= q everywhere, i.e. p == q, and could not have rejected: u < 1 makes
    u * q(x) < p(x) whenever p(x) = q(x) > 0. Only rounding reaches it (p(x) a few ulps below q(x) and
    u just under 1, or a q that does not sum to 1); such a row keeps p, the law before the rejection.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs)


def verify_tree_sampling(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tokens: torch.Tensor,
                         parents: torch.Tensor, num_nodes: torch.Tensor, generator: torch.Generator | None):
    """Recursive rejection sampling: the output is distributed exactly as sampling from ``target_probs``.

    target_probs: [B, N+1, V] warped target distributions. draft_probs: [B, N, V], the distribution
    each node's token was drawn from, conditioned on its earlier siblings when siblings are drawn
    without replacement; None when every node is a deterministic choice (a point mass on its token,
    e.g. top-k siblings).

    Starting at the root with p = its target distribution, the children of the current node are
    tried in node order. Child x, drawn from q, is accepted with probability min(1, p(x)/q(x)); the
    walk then moves to it and p becomes its target distribution. On rejection p becomes
    normalize(max(0, p - q)) and the next sibling is tried. When the current node has no untried
    child left, the next token is drawn from p.

    Why this is exact, by induction on the untried siblings: a step accepts x with probability
    q(x) min(1, p(x)/q(x)) = min(p(x), q(x)) and rejects with probability Z = sum(max(0, p - q)).
    If the rest of the walk emits normalize(max(0, p - q)) after any rejection, the step emits
    min(p, q) + max(0, p - q) = p. The residual depends on q only, not on the rejected token, so the
    next sibling may be drawn from any law that depends on the earlier siblings (without
    replacement) and the hypothesis holds for it; with no sibling left the walk draws from p itself.
    After an acceptance the same argument applies one level down, with the target's distribution
    given the accepted path. With a point mass q = onehot(x) the residual is p with x removed, so a
    repeated token among siblings has p(x) = 0 exactly and is always rejected again.
    """
    check_tree(parents, num_nodes)
    batch, size = tokens.shape
    device = tokens.device
    rows = torch.arange(batch, device=device)
    index = torch.arange(size, device=device)
    valid, parents = _valid_and_clean(parents, num_nodes)
    tokens = torch.where(valid, tokens, 0)  # padding tokens may be anything; never used

    probs = target_probs[:, 0].clone()  # [B, V] the law of the next token at the current node
    current = torch.full((batch,), -1, dtype=torch.long, device=device)  # node whose children are tried
    tried = torch.full((batch,), -1, dtype=torch.long, device=device)  # children <= tried are done
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, max(size, 1)), -1, dtype=torch.long, device=device)
    for _ in range(size):  # each pass tries one node per row, in increasing order: at most N passes
        untried = valid & (parents == current[:, None]) & (index > tried[:, None])  # [B, N]
        trying = untried.any(1)  # [B]
        if not bool(trying.any()):
            break
        child = untried.long().argmax(1)  # first untried child; meaningless where not trying
        token = tokens[rows, child]  # [B]
        if draft_probs is None:
            draft_next = torch.nn.functional.one_hot(token, probs.shape[-1]).to(probs.dtype)  # [B, V]
        else:
            draft_next = draft_probs[rows, child]  # [B, V]
        uniform = torch.rand(batch, generator=generator, device=device)
        accept = trying & _accepts(uniform, probs.gather(1, token[:, None]).squeeze(1),
                                   draft_next.gather(1, token[:, None]).squeeze(1))
        reject = trying & ~accept

        slot = num_accepted.clamp_max(size - 1)
        path[rows, slot] = torch.where(accept, child, path[rows, slot])
        num_accepted = num_accepted + accept
        current = torch.where(accept, child, current)
        tried = torch.where(trying, child, tried)  # an accepted child's own children all come after it
        probs = torch.where(accept[:, None], target_probs[rows, child + 1],
                            torch.where(reject[:, None], _residual(probs, draft_next), probs))

    next_token = sample(probs, generator)
    width = int(num_accepted.max()) if batch else 0
    return num_accepted, path[:, :width], next_token
