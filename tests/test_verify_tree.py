"""Tree acceptance rules and tree utilities on hand-made tensors: no model involved."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency
from test_sampling import chi_square_p

from specdec.errors import InvalidArgumentError
from specdec.sampling import SamplingConfig, probabilities
from specdec.verify import tree, verify_greedy, verify_sampling
from specdec.verify.tree import (
    accepted_path,
    ancestor_mask,
    check_tree,
    depths,
    verify_tree_greedy,
    verify_tree_sampling,
)

P_VALUE = 1e-3  # fixed seeds make every test deterministic; a real bias gives p-values far below this


def one_hot_logits(tokens, vocab=8):
    """Logits whose argmax at position j is tokens[j]. tokens: [B, N+1] -> [B, N+1, V]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float() * 5.0


def chain_parents(batch, k):
    """The tree of a chain of k drafts: node i hangs from node i-1. -> [B, k]"""
    return (torch.arange(k) - 1).expand(batch, k)


# Utilities ----------------------------------------------------------------------------------------
#        root
#      /   |   \
#     0    2    5        node 5 is a leaf at depth 1; nodes come in topological, not level, order
#    / \   |
#   1   3  4
PARENTS = [-1, 0, -1, 0, 2, -1]


def test_depths_and_ancestor_mask_of_a_hand_made_tree():
    parents = torch.tensor([PARENTS, [-1, 0, 1, 99, 7, 0]])  # row 1: a chain of 3, then padding
    num_nodes = torch.tensor([6, 3])
    assert depths(parents, num_nodes).tolist() == [[1, 2, 1, 2, 2, 1], [1, 2, 3, 0, 0, 0]]
    sees = ancestor_mask(parents, num_nodes)
    assert sees[0].long().tolist() == [[1, 0, 0, 0, 0, 0],
                                       [1, 1, 0, 0, 0, 0],
                                       [0, 0, 1, 0, 0, 0],
                                       [1, 0, 0, 1, 0, 0],
                                       [0, 0, 1, 0, 1, 0],
                                       [0, 0, 0, 0, 0, 1]]
    assert sees[1].long().tolist() == [[1, 0, 0, 0, 0, 0],
                                       [1, 1, 0, 0, 0, 0],
                                       [1, 1, 1, 0, 0, 0],
                                       [0, 0, 0, 1, 0, 0],  # padding sees only itself
                                       [0, 0, 0, 0, 1, 0],
                                       [0, 0, 0, 0, 0, 1]]


def test_ancestor_mask_reaches_the_top_of_a_long_chain():
    size = 37  # not a power of two: the last doubling must still cover depth 37
    sees = ancestor_mask(chain_parents(1, size), torch.tensor([size]))
    assert torch.equal(sees[0], torch.ones(size, size, dtype=torch.bool).tril())


def test_accepted_path_walks_up_from_the_last_node():
    parents = torch.tensor([PARENTS] * 4)
    path = accepted_path(parents, torch.tensor([4, 3, 5, 0]), torch.tensor([2, 2, 1, 0]))
    assert path.tolist() == [[2, 4], [0, 3], [5, -1], [-1, -1]]
    assert accepted_path(parents, torch.tensor([0, 0, 0, 0]), torch.zeros(4, dtype=torch.long)).shape == (4, 0)


def test_check_tree_refuses_a_parent_after_its_child():
    check_tree(torch.tensor([[-1, 0, 5]]), torch.tensor([2]))  # node 2 is padding: anything goes
    with pytest.raises(InvalidArgumentError, match="node 1 has parent 1"):
        check_tree(torch.tensor([[-1, 1, 0]]), torch.tensor([3]))
    with pytest.raises(InvalidArgumentError, match="num_nodes"):
        check_tree(torch.tensor([[-1, 0]]), torch.tensor([3]))


# Greedy -------------------------------------------------------------------------------------------
def test_greedy_chains_equal_the_chain_rule():
    generator = torch.Generator().manual_seed(0)
    batch, k, vocab = 300, 5, 3  # a small vocabulary makes long matches common
    logits = torch.randn(batch, k + 1, vocab, generator=generator)
    drafts = torch.randint(vocab, (batch, k), generator=generator)
    lengths = torch.randint(k + 1, (batch,), generator=generator)
    chain_accepted, chain_next = verify_greedy(logits, drafts, lengths)
    accepted, path, nxt = verify_tree_greedy(logits, drafts, chain_parents(batch, k), lengths)
    assert torch.equal(accepted, chain_accepted) and torch.equal(nxt, chain_next)
    slots = torch.arange(path.shape[1])
    assert torch.equal(path, torch.where(slots < accepted[:, None], slots, -1))
    assert int(accepted.max()) == k  # the draw covers full acceptance too


def test_greedy_takes_the_second_sibling_when_it_matches():
    # root -> 1; after node 2 (token 1) -> 3; node 4 (token 3) is accepted; after it -> 6
    logits = one_hot_logits([[1, 0, 0, 3, 0, 6, 0]])
    tokens = torch.tensor([[2, 3, 1, 0, 3, 3]])
    parents = torch.tensor([[-1, 0, -1, -1, 2, 2]])
    accepted, path, nxt = verify_tree_greedy(logits, tokens, parents, torch.tensor([6]))
    assert accepted.tolist() == [2] and path.tolist() == [[2, 4]] and nxt.tolist() == [6]


def test_greedy_accepts_down_to_a_leaf_and_draws_the_bonus_there():
    logits = one_hot_logits([[4, 5, 1, 7, 2, 7, 3]])  # root, then nodes 0..5 in PARENTS
    tokens = torch.tensor([[4, 5, 0, 1, 7, 3]])  # 4 matches at the root, 5 under it; after leaf 1: bonus 1
    accepted, path, nxt = verify_tree_greedy(logits, tokens, torch.tensor([PARENTS]), torch.tensor([6]))
    assert accepted.tolist() == [2] and path.tolist() == [[0, 1]] and nxt.tolist() == [1]


def test_greedy_rejects_every_child_of_the_root():
    logits = one_hot_logits([[6, 0, 0, 0, 0, 0, 0]])
    accepted, path, nxt = verify_tree_greedy(logits, torch.tensor([[1, 0, 2, 0, 0, 3]]), torch.tensor([PARENTS]),
                                             torch.tensor([6]))
    assert accepted.tolist() == [0] and path.shape == (1, 0) and nxt.tolist() == [6]


def test_greedy_ignores_padding_and_handles_ragged_rows():
    nan = float("nan")
    logits = one_hot_logits([[1, 2, 3, 4, 5, 6, 7]] * 4)
    logits[1, 3:] = nan  # the padding of row 1 may hold anything
    tokens = torch.tensor([[1, 2, 9, 3, 0, 0],
                           [1, 2, 3, 4, 5, 6],  # padding continues the chain but is not in the tree
                           [1, 2, 9, 3, 0, 0],
                           [1, 2, 3, 4, 5, 6]])
    parents = torch.tensor([[-1, 0, 1, 1, 3, 4],
                            [-1, 0, 1, 2, 3, 4],
                            [-1, 0, 1, 1, -3, 99],
                            [-1, 0, 1, 2, 3, 4]])
    accepted, path, nxt = verify_tree_greedy(logits, tokens, parents, torch.tensor([6, 2, 4, 0]))
    # row 0: 1 -> 2 (node 1), then node 3 (token 3) matches after node 1 -> argmax after node 3 is 5
    assert accepted.tolist() == [3, 2, 3, 0]
    assert path.tolist() == [[0, 1, 3], [0, 1, -1], [0, 1, 3], [-1, -1, -1]]
    assert nxt.tolist() == [5, 3, 5, 1]


def test_greedy_duplicate_siblings_longest_path_then_first():
    # Both node 0 and node 1 carry the matching token 2; only node 1's subtree continues the match.
    logits = one_hot_logits([[2, 3, 3, 0, 5, 6]])
    tokens = torch.tensor([[2, 2, 7, 3, 5]])
    parents = torch.tensor([[-1, -1, 0, 1, 3]])
    accepted, path, nxt = verify_tree_greedy(logits, tokens, parents, torch.tensor([5]))
    assert accepted.tolist() == [3] and path.tolist() == [[1, 3, 4]] and nxt.tolist() == [6]
    # Equal depth on both sides: the first sibling's path wins, though its leaf has the larger index.
    logits = one_hot_logits([[2, 3, 3, 0, 5]])
    tokens = torch.tensor([[2, 2, 3, 3]])
    parents = torch.tensor([[-1, -1, 1, 0]])
    accepted, path, nxt = verify_tree_greedy(logits, tokens, parents, torch.tensor([4]))
    assert accepted.tolist() == [2] and path.tolist() == [[0, 3]] and nxt.tolist() == [5]


def test_greedy_with_an_empty_tree_is_a_plain_step():
    logits = one_hot_logits([[3], [5]])
    empty = torch.zeros(2, 0, dtype=torch.long)
    accepted, path, nxt = verify_tree_greedy(logits, empty, empty, torch.zeros(2, dtype=torch.long))
    assert accepted.tolist() == [0, 0] and path.shape == (2, 0) and nxt.tolist() == [3, 5]


# Sampling: small deterministic checks -------------------------------------------------------------
def test_sampling_with_point_mass_target_and_drafts_behaves_like_greedy():
    logits = one_hot_logits([[4, 5, 1, 7, 2, 7, 3], [6, 5, 1, 7, 2, 7, 3], [7, 5, 1, 0, 2, 2, 3]])
    tokens = torch.tensor([[4, 1, 0, 1, 7, 3], [1, 0, 2, 0, 0, 3], [4, 1, 7, 0, 2, 3]])
    parents, num_nodes = torch.tensor([PARENTS] * 3), torch.tensor([6, 6, 6])
    greedy = verify_tree_greedy(logits, tokens, parents, num_nodes)
    for seed in range(5):
        sampled = verify_tree_sampling(logits.softmax(-1).round(), None, tokens, parents, num_nodes,
                                       torch.Generator().manual_seed(seed))
        assert all(torch.equal(a, b) for a, b in zip(sampled, greedy))


def test_sampling_never_accepts_a_token_the_target_excludes():
    target = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]]])
    draft = torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    for seed in range(20):
        accepted, _, nxt = verify_tree_sampling(target, draft, torch.tensor([[0, 0]]), torch.tensor([[-1, -1]]),
                                                torch.tensor([2]), torch.Generator().manual_seed(seed))
        assert accepted.item() == 0 and nxt.item() in (1, 2)


def test_sampling_survives_a_residual_with_no_mass():
    """q >= p everywhere (a q summing past 1, as rounding can make it) leaves no residual: no NaN."""
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]]).expand(200, -1, -1)
    draft = torch.tensor([[[0.6, 0.5, 0.0], [0.6, 0.5, 0.0]]]).expand(200, -1, -1)
    tokens = torch.tensor([[0, 0]]).expand(200, -1)
    accepted, _, nxt = verify_tree_sampling(target, draft, tokens, torch.tensor([[-1, -1]]).expand(200, -1),
                                            torch.full((200,), 2), torch.Generator().manual_seed(0))
    assert set(nxt[accepted == 0].tolist()) <= {0, 1}  # after two rejections: the kept target law
    assert set(nxt[accepted == 1].tolist()) == {2}
    assert bool((accepted == 0).any())


def test_sampling_ignores_padding_and_is_reproducible():
    nan = float("nan")
    generator = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(3, 7, 5, generator=generator), -1)
    draft = torch.softmax(torch.randn(3, 6, 5, generator=generator), -1)
    tokens = torch.multinomial(draft.reshape(-1, 5), 1, generator=generator).reshape(3, 6)
    num_nodes = torch.tensor([6, 2, 0])
    target[1, 3:], draft[1, 2:], tokens[1, 2:] = nan, nan, 10 ** 6
    target[2, 1:], draft[2], tokens[2] = nan, nan, -5
    parents = torch.tensor([PARENTS, [-1, 0, 99, -7, 3, 3], [5, 5, 5, 5, 5, 5]])
    runs = [verify_tree_sampling(target, draft, tokens, parents, num_nodes, torch.Generator().manual_seed(9))
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    accepted, path, nxt = runs[0]
    assert accepted[2] == 0 and bool((accepted <= torch.tensor([2, 2, 0])).all()) and bool((path[2] == -1).all())
    assert bool(((0 <= nxt) & (nxt < 5)).all())


# Sampling: the output follows the warped target ---------------------------------------------------
# The tree is PARENTS. A "world" gives the target's law after every context of up to two tokens:
# p1 [V] after the root, p2 [V, V] after token a, p3 [V, V, V] after tokens a, b. Drafts come from a
# world of the same shape (d1, d2). Output tokens past what a verification emits are completed by
# sampling the target world itself, so the first three tokens must follow p1 * p2 * p3 exactly.
V = 6


def seeded_logits(seed, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def target_world(config: SamplingConfig | None = None):
    logits = [seeded_logits(1, V), seeded_logits(2, V, V), seeded_logits(3, V, V, V)]
    if config is not None:
        return [probabilities(x, config) for x in logits]
    logits[0][4:] = float("-inf")  # the target never says 4 or 5 first ...
    logits[1][:, :2] = float("-inf")  # ... nor 0 or 1 second
    return [x.softmax(-1) for x in logits]


def draft_world(kind, target):
    if kind == "equal":
        return target[0], target[1]
    if kind == "uniform":
        return torch.full((V,), 1.0 / V), torch.full((V, V), 1.0 / V)
    if kind == "skewed":
        return seeded_logits(4, V, scale=2.5).softmax(-1), seeded_logits(5, V, V, scale=2.5).softmax(-1)
    only = torch.zeros(V)
    if kind == "disjoint-1":  # all mass on 4 and 5, which the target excludes at depth 1
        return only.index_fill(0, torch.tensor([4, 5]), 0.5), target[1]
    if kind == "disjoint-2":  # all mass on 0 and 1, which the target excludes at depth 2
        return target[0], only.index_fill(0, torch.tensor([0, 1]), 0.5).expand(V, V)
    raise ValueError(kind)


def draft_tree(d1, d2, scheme, n, generator):
    """Draft n trees of shape PARENTS. -> tokens [n, N], draft_probs [n, N, V] or None.

    scheme: "replace" draws siblings independently; "without" draws each sibling from the draft
    with its earlier siblings' tokens removed (and reports that conditioned law); "topk" takes the
    draft's most likely tokens in order (point masses, draft_probs None).
    """
    tokens = torch.zeros(n, len(PARENTS), dtype=torch.long)
    draft_probs = torch.zeros(n, len(PARENTS), V)
    for node, parent in enumerate(PARENTS):
        base = d1.expand(n, V) if parent < 0 else d2[tokens[:, parent]]  # [n, V]
        earlier = [j for j in range(node) if PARENTS[j] == parent]
        if scheme == "topk":
            tokens[:, node] = torch.sort(base, stable=True, dim=-1, descending=True).indices[:, len(earlier)]
            continue
        draft = base.clone()
        if scheme == "without" and earlier:
            draft.scatter_(1, tokens[:, earlier], 0.0)
            draft = draft / draft.sum(-1, keepdim=True)
        tokens[:, node] = torch.multinomial(draft, 1, generator=generator).squeeze(1)
        draft_probs[:, node] = draft
    return tokens, None if scheme == "topk" else draft_probs


def tree_target(world, tokens):
    """target_probs [n, N+1, V] of trees of shape PARENTS under a target world."""
    p1, p2, p3 = world
    laws = [p1.expand(tokens.shape[0], V)]
    for node, parent in enumerate(PARENTS):
        laws.append(p2[tokens[:, node]] if parent < 0 else p3[tokens[:, parent], tokens[:, node]])
    return torch.stack(laws, 1)


def sample_tree_outputs(world, d1, d2, scheme, n=40000, seed=0, tokens=None):
    """Verify n drafted trees; -> (num_accepted [n], the first three output tokens [n, 3])."""
    generator = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens, draft_probs = draft_tree(d1, d2, scheme, n, generator)
    else:
        tokens, draft_probs = tokens.expand(n, -1), None
    parents = torch.tensor(PARENTS).expand(n, -1)
    accepted, path, nxt = verify_tree_sampling(tree_target(world, tokens), draft_probs, tokens, parents,
                                               torch.full((n,), len(PARENTS)), generator)
    kept = torch.cat([tokens.gather(1, path.clamp_min(0)), torch.zeros(n, 3, dtype=torch.long)], 1)
    out = torch.zeros(n, 3, dtype=torch.long)
    for col in range(3):
        law = [world[0].expand(n, V), world[1][out[:, 0]], world[2][out[:, 0], out[:, 1]]][col]
        fresh = torch.multinomial(law, 1, generator=generator).squeeze(1)
        out[:, col] = torch.where(col < accepted, kept[:, col], torch.where(col == accepted, nxt, fresh))
    return accepted, out


def p_values(world, out):
    """The output's first token, first two and first three against the exact target laws."""
    p1, p2, p3 = world
    pairs = p1[:, None] * p2  # [V, V]
    return [chi_square_p(out[:, 0], p1),
            chi_square_p(out[:, 0] * V + out[:, 1], pairs.flatten()),
            chi_square_p((out[:, 0] * V + out[:, 1]) * V + out[:, 2], (pairs[..., None] * p3).flatten())]


WARPED = SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)
CASES = {  # name: (target warping, draft world, scheme)
    "equal": (None, "equal", "replace"),
    "uniform": (None, "uniform", "replace"),
    "disjoint-depth-1": (None, "disjoint-1", "replace"),
    "disjoint-depth-2": (None, "disjoint-2", "replace"),
    "skewed-with-duplicates": (None, "skewed", "replace"),  # skewed q repeats tokens among siblings often
    "skewed-without-replacement": (None, "skewed", "without"),
    "top-k-point-masses": (None, "skewed", "topk"),
    "warped-without-replacement": (WARPED, "skewed", "without"),
    "warped-top-k": (WARPED, "skewed", "topk"),
    "warped-uniform": (WARPED, "uniform", "replace"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_output_follows_the_target(case):
    config, draft_kind, scheme = CASES[case]
    world = target_world(config)
    accepted, out = sample_tree_outputs(world, *draft_world(draft_kind, world), scheme)
    assert min(p_values(world, out)) > P_VALUE
    if case == "equal":  # q == p accepts the first child at every level
        assert bool((accepted == 2).all())
    if case == "disjoint-depth-1":
        assert bool((accepted == 0).all())
    if case == "disjoint-depth-2":
        assert bool((accepted == 1).all())
    if case == "skewed-with-duplicates":
        assert bool((accepted >= 1).any() & (accepted == 0).any())


def test_tree_output_follows_the_target_with_duplicated_point_masses():
    # Root children 2, 2, 0; under node 0: 3, 3; under node 2: 3. The repeated 2 and 3 must be
    # rejected again after a first rejection, since the residual leaves them no mass.
    world = target_world()
    world[0] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.0, 0.15])  # 2 is likely, 4 excluded
    accepted, out = sample_tree_outputs(world, None, None, None, tokens=torch.tensor([[2, 3, 2, 3, 3, 0]]))
    assert min(p_values(world, out)) > P_VALUE
    assert bool((accepted == 2).any())


@pytest.mark.parametrize("wrong_rule", ["accept-with-p", "no-residual"])
def test_the_chi_square_check_rejects_a_wrong_rule(wrong_rule, monkeypatch):
    """The tests above can fail: the same check catches a rule that is only slightly wrong."""
    if wrong_rule == "accept-with-p":  # min(1, p/q) replaced by p: right only for point masses
        monkeypatch.setattr(tree, "_accepts", lambda uniform, target_at, draft_at: uniform < target_at)
    else:  # keep p after a rejection instead of moving to the residual
        monkeypatch.setattr(tree, "_residual", lambda target_probs, draft_probs: target_probs)
    world = target_world()
    for scheme in ("replace", "without"):
        _, out = sample_tree_outputs(world, *draft_world("skewed", world), scheme)
        assert min(p_values(world, out)) < 1e-6
    if wrong_rule == "no-residual":  # point masses need the residual too
        _, out = sample_tree_outputs(world, *draft_world("skewed", world), "topk")
        assert min(p_values(world, out)) < 1e-6


# Chains are trees: the same law as verify_sampling -------------------------------------------------
def chain_outcomes(rule, use_draft_probs, n=30000, seed=0):
    """(num_accepted, next_token) of n random chains of up to 3 drafts, as one cell index each."""
    k = 3
    generator = torch.Generator().manual_seed(seed)
    target = seeded_logits(6, k + 1, V).softmax(-1)
    target[0, 5] = 0.0  # a token the target excludes, proposed by the draft
    target[0] /= target[0].sum()
    draft = seeded_logits(7, k, V, scale=2.0).softmax(-1)
    draft[0, 5] += 0.3
    draft[0] /= draft[0].sum()
    drafts = torch.multinomial(draft.repeat(n, 1), 1, generator=generator).reshape(n, k)
    lengths = torch.randint(k + 1, (n,), generator=generator)
    draft_probs = draft.expand(n, -1, -1) if use_draft_probs else None
    if rule == "chain":
        accepted, nxt = verify_sampling(target.expand(n, -1, -1), drafts, lengths, draft_probs, generator)
    else:
        accepted, path, nxt = verify_tree_sampling(target.expand(n, -1, -1), draft_probs, drafts,
                                                   chain_parents(n, k), lengths, generator)
        slots = torch.arange(path.shape[1])
        assert torch.equal(path, torch.where(slots < accepted[:, None], slots, -1))
    return (lengths * (k + 1) + accepted) * V + nxt


@pytest.mark.parametrize("use_draft_probs", [True, False])
def test_chains_as_trees_agree_with_the_chain_rule(use_draft_probs):
    cells = (3 + 1) * (3 + 1) * V
    counts = torch.stack([torch.bincount(chain_outcomes(rule, use_draft_probs, seed=seed), minlength=cells)
                          for rule, seed in (("chain", 0), ("tree", 1))])  # independent draws
    counts = counts[:, counts.sum(0) > 0]
    assert chi2_contingency(counts.numpy()).pvalue > P_VALUE
