"""3. ACCEPT: one step propose -> verify -> commit / roll back, for a ragged batch, and the
generation settings it runs under. The engine (engine.py) drives it; nothing here knows the engine.

Invariant between steps: the target cache holds every committed token of a row except the last
one (the "pending" token), so a verification feeds [pending, draft_1 .. draft_k] and its k+1
logits score every draft plus the token after them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from specdec.batch import Sequences
from specdec.drafters.base import Proposal, TargetFeatures, TreeConfig
from specdec.errors import ContextLengthError, InvalidArgumentError, NumericsWarning
from specdec.sampling import SamplingConfig, probabilities, sample
from specdec.backends.target import Target
from specdec.verify import ancestor_mask, verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling

SCHEDULES = ("constant", "heuristic")


@dataclass(frozen=True)
class GenerationConfig:
    num_draft_tokens: int = 5
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    draft_schedule: str = "constant"  # "heuristic": +2 after a fully accepted step, -1 otherwise
    max_draft_tokens: int = 32        # cap for the heuristic schedule
    tree: TreeConfig | None = None    # token trees instead of chains (num_draft_tokens is then unused)

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise InvalidArgumentError(f"the number of draft tokens k must be >= 1, got {self.num_draft_tokens}")
        if self.max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.draft_schedule not in SCHEDULES:
            raise InvalidArgumentError(
                f"draft schedule must be one of {', '.join(SCHEDULES)}, got {self.draft_schedule!r}")

    @property
    def k_limit(self) -> int:
        """The widest block of drafts a step may verify."""
        if self.tree is not None:
            return self.tree.num_nodes
        if self.draft_schedule == "constant":
            return self.num_draft_tokens
        return max(self.num_draft_tokens, self.max_draft_tokens)


def check_context(target: Target, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Refuse, before any work, generations that would run past the context window."""
    longest = max(len(p) for p in prompts)
    window = target.max_positions
    if window is not None and longest + max_new_tokens > window:
        raise ContextLengthError(
            f"prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
            f"the context window of {window} tokens")


DEFAULT_DRAFT_TOKENS = 5


def default_draft_tokens(drafter) -> int:
    """k when none is asked for: the drafter's own (a DFlash block minus its anchor), else 5."""
    return int(getattr(drafter, "default_draft_tokens", None) or DEFAULT_DRAFT_TOKENS)


def default_tree(drafter, num_draft_tokens: int | None, tree: TreeConfig | None) -> TreeConfig | None:
    """The tree a generation verifies: the one asked for; with neither k nor a tree asked for, the one
    the drafter records as measured fastest (None: chains)."""
    if tree is not None or num_draft_tokens is not None:
        return tree
    return getattr(drafter, "default_tree", None)


def warn_inexact(target: Target) -> None:
    """Say once per target that its numerics depend on the block shape (only the target's decide the output)."""
    if getattr(target, "_warned_inexact", False):
        return
    target._warned_inexact = True
    backend = target.backend
    dtype = str(getattr(backend, "dtype", "this dtype")).removeprefix("torch.")
    fix = "float32" if getattr(backend, "name", "") == "native" else "float32 or the native backend"
    warnings.warn(f"speculative output may differ from plain decoding in {dtype} on the {backend.description} "
                  f"backend (its numerics depend on the block shape); use {fix} for identical output",
                  NumericsWarning, stacklevel=3)


def cache_capacity(prompts: list[list[int]], config: GenerationConfig, static_tree: int = 0,
                   ragged: bool | None = None) -> int:
    """Columns a KV cache of this generation may hold: every token, a block of drafts, and the holes
    a ragged batch or a tree keeps until ``compact`` (at most max(32, half the longest row)).
    static_tree: the nodes of a drafter's own fixed tree, when it has one; ragged: rows will be
    ragged (default: when there are several prompts)."""
    longest = max(len(p) for p in prompts) + config.max_new_tokens
    width = max(config.k_limit, static_tree)
    ragged = len(prompts) > 1 if ragged is None else ragged
    holes = max(32, longest // 2) + width if ragged or config.tree or static_tree else 0
    return longest + width + 2 + holes


def committed_features(hidden: torch.Tensor, keep: torch.Tensor | None, counts: torch.Tensor) -> TargetFeatures:
    """The features of the tokens a verification committed, right-aligned (drafters.base.TargetFeatures).

    hidden: [B, k+1, F, H] of the block [pending, drafts]; keep: [B, k+1] the accepted path of a
    tree (None: a chain, whose accepted columns come first); counts: [B] tokens committed, so the
    pending token and the first counts - 1 accepted drafts have their features handed on.
    """
    batch, width = hidden.shape[:2]
    if width == 1:  # a plain step: one token per row, its own column
        return TargetFeatures(hidden, torch.ones(batch, 1, dtype=torch.bool, device=hidden.device))
    if keep is None:
        columns = torch.arange(width, device=hidden.device).expand(batch, width)
    else:  # the path's columns in order: kept columns sorted by index (a path's depths increase with column)
        columns = torch.where(keep, torch.arange(width, device=hidden.device), width).sort(dim=1).values
    m = int(counts.max())
    source = counts[:, None] - m + torch.arange(m, device=hidden.device)  # [B, m]; < 0: padding
    valid = source >= 0
    index = columns.gather(1, source.clamp(min=0)).clamp(max=width - 1)
    states = hidden.gather(1, index[:, :, None, None].expand(-1, -1, *hidden.shape[2:]))
    return TargetFeatures(states, valid)


def verify_block(forward, cache, seqs: Sequences, proposal: Proposal,
            sampling: SamplingConfig, generator: torch.Generator, process=None, layers: tuple[int, ...] = ()):
    """One target pass over [pending, drafts]: the chain, or the whole tree under a tree mask.

    forward: ``Target.forward``, or the session's ``verify_forward`` when it drafted with the target's
    own first layers (it then runs only the rest of the network on the drafts).

    Returns (num_accepted [B], next_token [B], accepted tokens [B, D] (row b keeps its first
    num_accepted[b]), keep [B, k+1] bool over the block's columns for trees, else None, hidden
    states [B, k+1, len(layers), H] of the block or None, the block's processed logits [B, k+1, V]).
    """
    pending = seqs.tokens.gather(1, (seqs.lengths - 1)[:, None])  # [B, 1]
    if not proposal.k:  # plain decoding: one live token per row
        logits, hidden = forward(cache, pending, None, logits_to_keep=1, hidden_layers=layers)
        if process is not None:
            logits = process(logits)
        if sampling.greedy:
            next_token = verify_greedy(logits, proposal.tokens, proposal.lengths)[1]
        else:
            next_token = sample(probabilities(logits[:, 0], sampling), generator)
        return proposal.lengths, next_token, proposal.tokens, None, hidden, logits
    tokens = torch.cat([pending, proposal.tokens], dim=1)  # [B, k+1]
    slots = torch.arange(proposal.k + 1, device=tokens.device)
    valid = slots[None, :] <= proposal.lengths[:, None]
    if not proposal.is_tree:
        logits, hidden = forward(cache, tokens, valid, logits_to_keep=proposal.k + 1,
                                 hidden_layers=layers)  # [B, k+1, V]
        if process is not None:
            logits = process(logits)
        if sampling.greedy:
            num_accepted, next_token = verify_greedy(logits, proposal.tokens, proposal.lengths)
        else:
            num_accepted, next_token = verify_sampling(probabilities(logits, sampling), proposal.tokens,
                                                       proposal.lengths, proposal.probs, generator)
        return num_accepted, next_token, proposal.tokens, None, hidden, logits
    parents, lengths = proposal.parents, proposal.lengths
    batch, size = proposal.tokens.shape
    mask = torch.zeros(batch, size + 1, size + 1, dtype=torch.bool, device=tokens.device)
    mask[:, :, 0] = True  # everyone sees the pending token (the root)
    mask[:, 1:, 1:] = ancestor_mask(parents, lengths)
    depth = torch.cat([torch.zeros_like(pending), proposal.depths()], dim=1)
    positions = (seqs.lengths - 1)[:, None] + depth
    logits, hidden = forward(cache, tokens, valid, logits_to_keep=size + 1, block_mask=mask, positions=positions,
                             hidden_layers=layers)
    if process is not None:
        logits = process(logits)
    if sampling.greedy:
        num_accepted, path, next_token = verify_tree_greedy(logits, proposal.tokens, parents, lengths)
    else:
        num_accepted, path, next_token = verify_tree_sampling(probabilities(logits, sampling), proposal.probs,
                                                              proposal.tokens, parents, lengths, generator)
    accepted = proposal.tokens.gather(1, path.clamp(min=0))  # [B, D]
    keep = torch.zeros(batch, size + 1, dtype=torch.bool, device=tokens.device)
    keep[:, 0] = True
    keep.scatter_(1, path + 1, True)  # -1 padding marks the root again
    return num_accepted, next_token, accepted, keep, hidden, logits


def stop_counts(new_tokens: torch.Tensor, counts: torch.Tensor, eos: torch.Tensor):
    """Cut each row's new tokens right after its first EOS. new_tokens: [B, n]; counts: [B].

    Returns (counts [B], hit_eos [B] bool).
    """
    if new_tokens.shape[1] == 1:  # one token per row (plain decoding)
        hit_eos = torch.isin(new_tokens[:, 0], eos)
        return counts, hit_eos
    is_eos = torch.isin(new_tokens, eos)
    if not bool(is_eos.any()):  # the usual step: no stop token anywhere in the block
        return counts, torch.zeros_like(counts, dtype=torch.bool)
    slots = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    is_eos = is_eos & (slots[None, :] < counts[:, None])
    first = torch.where(is_eos, slots[None, :], new_tokens.shape[1]).min(1).values
    return torch.minimum(counts, first + 1), first < new_tokens.shape[1]
