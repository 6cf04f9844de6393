"""Acceptance rules on hand-made tensors: no model involved."""

import pytest
import torch

from specdec.verify import verify_greedy, verify_sampling


def one_hot_logits(tokens, vocab=6):
    """Logits whose argmax at position j is tokens[j]. tokens: [B, k+1] -> [B, k+1, V]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float() * 5.0


def test_greedy_accepts_matching_prefix_then_corrects():
    logits = one_hot_logits([[1, 2, 3, 4]])
    accepted, nxt = verify_greedy(logits, torch.tensor([[1, 2, 5]]), torch.tensor([3]))
    assert accepted.tolist() == [2] and nxt.tolist() == [3]


def test_greedy_bonus_after_full_acceptance():
    logits = one_hot_logits([[1, 2, 3, 4]])
    accepted, nxt = verify_greedy(logits, torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    assert accepted.tolist() == [3] and nxt.tolist() == [4]


def test_greedy_rejects_first_and_respects_row_lengths():
    logits = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    drafts = torch.tensor([[0, 2, 3], [1, 2, 3], [0, 0, 0]])
    accepted, nxt = verify_greedy(logits, drafts, torch.tensor([3, 1, 0]))
    # row 0 mismatches at once; row 1 proposed one draft (slots past it never count); row 2 proposed none.
    assert accepted.tolist() == [0, 1, 0]
    assert nxt.tolist() == [1, 2, 0]


def test_greedy_match_after_mismatch_is_not_accepted():
    logits = one_hot_logits([[1, 2, 3, 4]])
    accepted, nxt = verify_greedy(logits, torch.tensor([[1, 0, 3]]), torch.tensor([3]))
    assert accepted.tolist() == [1] and nxt.tolist() == [2]


def test_sampling_point_masses_behave_like_greedy():
    target = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3, 4]]), 6).float()
    accepted, nxt = verify_sampling(target, torch.tensor([[1, 2, 5]]), torch.tensor([3]), None,
                                    torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2] and nxt.tolist() == [3]


def test_sampling_never_accepts_a_token_the_target_excludes():
    target = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]]])
    draft = torch.tensor([[[1.0, 0.0, 0.0]]])
    for seed in range(20):
        accepted, nxt = verify_sampling(target, torch.tensor([[0]]), torch.tensor([1]), draft,
                                        torch.Generator().manual_seed(seed))
        assert accepted.item() == 0 and nxt.item() in (1, 2)


def test_sampling_always_accepts_when_draft_equals_target_and_draws_bonus():
    probs = torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.0, 1.0]]])
    accepted, nxt = verify_sampling(probs, torch.tensor([[1, 0]]), torch.tensor([2]), probs[:, :2],
                                    torch.Generator().manual_seed(3))
    assert accepted.item() == 2 and nxt.item() == 1


def test_sampling_is_reproducible_for_a_seed():
    torch.manual_seed(0)
    target = torch.softmax(torch.randn(4, 4, 10), -1)
    draft = torch.softmax(torch.randn(4, 3, 10), -1)
    drafts = torch.multinomial(draft.reshape(-1, 10), 1).reshape(4, 3)
    runs = [verify_sampling(target, drafts, torch.full((4,), 3), draft, torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_kernel_computes_what_pytorch_computes(dtype):
    """One C call (argmax at the positions a row reaches, the accepted prefix) against the PyTorch rule,
    with ties (the first maximum wins), NaN, -inf, rows of every length and drafts that match."""
    from specdec.models import kernels
    from specdec.verify import chain

    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        batch, k, vocab = 1 + trial % 5, trial % 6, 7 + trial % 50
        logits = torch.randint(0, 4, (batch, k + 1, vocab), generator=generator).to(dtype)  # many ties
        if trial % 7 == 0:
            logits[0, 0, 3] = float("nan")
        if trial % 5 == 0:
            logits[:, :, : vocab // 2] = float("-inf")
        target = logits.argmax(-1)
        drafts = torch.where(torch.rand(batch, k, generator=generator) < 0.7, target[:, :k],
                             torch.randint(0, vocab, (batch, k), generator=generator))
        lengths = torch.randint(0, k + 1, (batch,), generator=generator)
        fast = kernels.greedy_accept(logits, drafts, lengths)
        assert fast is not None
        original, kernels.greedy_accept = kernels.greedy_accept, lambda *a: None
        try:
            slow = chain.verify_greedy(logits, drafts, lengths)
        finally:
            kernels.greedy_accept = original
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_argmax_kernel_gives_torchs_index(dtype):
    """kernels.argmax (vector passes for the largest value and its first position) against torch.argmax:
    ties, signed zeros, NaN, -inf, every tail length, and rows that are strided views."""
    from specdec.models import kernels

    generator = torch.Generator().manual_seed(1)
    for trial in range(300):
        n = 1 + trial % 40 if trial % 3 else 49152 - trial % 9
        x = torch.randn(4, n, generator=generator)
        if trial % 4 == 0:
            x = (x * 2).round()  # ties
        if trial % 6 == 1:
            x[torch.rand(4, n, generator=generator) < 0.05] = float("nan")
        if trial % 10 == 2:
            x[:] = float("-inf")
        if trial % 8 == 3:
            x = torch.where(torch.rand(4, n, generator=generator) < 0.5, -0.0, 0.0)
        x = x.to(dtype)
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), trial
        view = torch.stack([x, x.flip(0)], 1)[:, 1]  # rows spaced two apart
        assert torch.equal(kernels.argmax(view), view.argmax(-1)), trial
