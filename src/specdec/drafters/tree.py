"""Dynamic draft trees as EAGLE-2 builds them, for any drafter that scores continuations.

Every expanded node gets its ``topk`` most likely children; of those, the ``topk`` with the highest
cumulative log-probability are expanded at the next depth, in one batched drafter pass under a tree
mask. Of all candidates, the ``num_nodes`` best by cumulative log-probability are verified.
Children are deterministic top-k choices (point masses), which keeps sampling exact under the tree
rule (verify/tree.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec.drafters.base import Proposal, TreeConfig
from specdec.sampling import SamplingConfig, probabilities

# expand(frontier tokens [B, K], parent slot [B, K] into the previous frontier (None at depth 1: the root),
#        sees [B, K, fed] which of the fed nodes (then themselves) each sees, depth) -> log-scores [B, K, S]
Expand = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, int], torch.Tensor]


def tree_scores(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-scores a tree ranks a drafter's logits by: log-softmax (greedy), else the log of the warped
    sampling distribution."""
    logits = logits.float()
    if sampling.greedy:
        return torch.log_softmax(logits, dim=-1)
    return probabilities(logits, sampling).log()


def dynamic_tree(root_scores: torch.Tensor, expand: Expand, tree: TreeConfig,
                 ids: torch.Tensor | None = None) -> Proposal:
    """A tree of drafts from the root's log-scores [B, S]; ``ids`` [S] maps score slots to token ids
    (a reduced draft vocabulary), None when slots are token ids."""
    batch, device = root_scores.shape[0], root_scores.device
    width = tree.topk

    def tokens_of(slots):
        return slots if ids is None else ids[slots]

    score, slot = root_scores.topk(width, dim=-1)  # [B, K]
    token = tokens_of(slot)
    pool_tokens, pool_scores = [token], [score.double()]
    pool_parents = [torch.full((batch, width), -1, dtype=torch.long, device=device)]
    pool_depths = [torch.ones(batch, width, dtype=torch.long, device=device)]
    frontier = torch.arange(width, device=device).expand(batch, width)  # pool index of each expanded node
    frontier_score, frontier_token, parent_slot = score.double(), token, None
    sees = torch.eye(width, dtype=torch.bool, device=device).expand(batch, width, width)  # [B, K, fed]
    for depth in range(1, tree.depth):
        child_score, child_slot = expand(frontier_token, parent_slot, sees, depth).topk(width, dim=-1)  # [B, K, K]
        child_token = tokens_of(child_slot)
        child_score = frontier_score[:, :, None] + child_score.double()
        start = sum(t.shape[1] for t in pool_tokens)
        pool_tokens.append(child_token.flatten(1))
        pool_scores.append(child_score.flatten(1))
        pool_parents.append(frontier[:, :, None].expand(-1, -1, width).flatten(1))
        pool_depths.append(torch.full((batch, width * width), depth + 1, dtype=torch.long, device=device))
        if depth + 1 == tree.depth:
            break
        best = child_score.flatten(1).topk(width, dim=-1).indices  # [B, K] among the K*K children
        parent_slot = best // width  # which fed node each new frontier node hangs from
        fed = sees.shape[2]
        ancestors = sees.gather(1, parent_slot[:, :, None].expand(-1, -1, fed))  # [B, K, fed]
        itself = torch.eye(width, dtype=torch.bool, device=device).expand(batch, width, width)
        sees = torch.cat([ancestors, itself], dim=2)  # [B, K, fed + K]
        frontier = start + best
        frontier_score = child_score.flatten(1).gather(1, best)
        frontier_token = child_token.flatten(1).gather(1, best)
    return select_tree(torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1), torch.cat(pool_parents, 1),
                       torch.cat(pool_depths, 1), tree.num_nodes)


def select_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                num_nodes: int) -> Proposal:
    """The ``num_nodes`` best candidates of a pool as a tree in order of depth.

    tokens, scores, parents (pool index, -1 = root), depths: [B, P]. A child never scores above its
    parent (log-probabilities add up), and ties go to the shallower node, so the chosen set holds
    every ancestor of its members.
    """
    batch, pool = tokens.shape
    count = min(num_nodes, pool)
    rank = scores - 1e-9 * depths  # ties: parents first
    chosen = rank.topk(count, dim=-1).indices  # [B, n]
    order = (depths.gather(1, chosen) * pool + chosen).argsort(dim=-1)  # by depth, then pool index
    chosen = chosen.gather(1, order)
    new_index = torch.full((batch, pool), -1, dtype=torch.long, device=tokens.device)
    new_index.scatter_(1, chosen, torch.arange(count, device=tokens.device).expand(batch, count))
    old_parents = parents.gather(1, chosen)
    tree_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
    lengths = torch.full((batch,), count, dtype=torch.long, device=tokens.device)
    return Proposal(tokens.gather(1, chosen), lengths, None, tree_parents, depths.gather(1, chosen))


def static_tree(paths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed tree from index paths (Medusa's ``medusa_choices``): (parents [N], depths [N], ranks [N])
    in order of depth; a node's token is rank ``ranks[i]`` of head ``depths[i] - 1``."""
    paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
    if missing:
        raise ValueError(f"tree path {list(missing[0])} has no parent path {list(missing[0][:-1])}")
    parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long)
    depths = torch.tensor([len(p) for p in paths], dtype=torch.long)
    ranks = torch.tensor([p[-1] for p in paths], dtype=torch.long)
    return parents, depths, ranks
