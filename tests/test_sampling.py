"""Speculative sampling must reproduce the target's warped distribution exactly (statistical tests)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

import specdec
from specdec import TreeConfig
from specdec.drafters import DraftModel, Lookahead, NoDraft, PromptLookup
from specdec.sampling import SamplingConfig, probabilities, sample, warp_logits
from specdec.verify import verify_sampling

P_VALUE = 1e-3  # fixed seeds make every test deterministic; a real bias gives p-values far below this


def chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of samples (ints) under probs, pooling cells with small expectation."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    assert counts[expected == 0].sum() == 0, "a sample fell outside the target's support"
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    return float(chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                     (0.9, 8, 0.9), (2.0, 1, None)])
def test_warping_matches_transformers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[0, :10] = 1.5  # ties at the top-k threshold
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = warp_logits(logits, SamplingConfig(temperature, top_k, top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    assert torch.allclose(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


# Pure-function tests: the chain rule's output tokens follow the target at each position ---------------
V = 8
TARGET = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.03, 0.0],
                       [0.05, 0.05, 0.10, 0.40, 0.0, 0.0, 0.20, 0.20],
                       [0.125] * 8])  # [k+1, V], k = 2


def draft_cases():
    uniform = torch.full((2, V), 1.0 / V)
    disjoint = torch.zeros(2, V)
    disjoint[0, 7] = 1.0  # the target gives token 7 no mass at position 0
    disjoint[1, 4:6] = 0.5  # nor tokens 4, 5 at position 1
    skewed = torch.softmax(torch.tensor([[3.0, 0, 0, 0, 0, 0, 0, 2.0], [0, 0, 0, 0, 2.0, 0, 1.0, 0]]), -1)
    disjoint_second = torch.stack([TARGET[0], disjoint[1]])
    return {"equal": TARGET[:2].clone(), "uniform": uniform, "disjoint": disjoint, "skewed": skewed,
            "disjoint-second": disjoint_second}


def run_chain(draft, n=40000, seed=0, one_hot_tokens=None):
    generator = torch.Generator().manual_seed(seed)
    target = TARGET.expand(n, -1, -1)
    if one_hot_tokens is None:
        tokens = torch.stack([torch.multinomial(draft[j], n, replacement=True, generator=generator)
                              for j in range(2)], dim=1)  # [n, 2]
        draft_probs = draft.expand(n, -1, -1)
    else:
        tokens, draft_probs = one_hot_tokens.expand(n, -1), None
    accepted, nxt = verify_sampling(target, tokens, torch.full((n,), 2), draft_probs, generator)
    emitted = torch.cat([tokens, nxt[:, None]], dim=1)
    emitted.scatter_(1, accepted[:, None], nxt[:, None])
    return accepted, emitted


def test_sample_draws_each_row_from_its_weights():
    """sampling.sample inverts each row's cumulative weights: unnormalised rows, any leading shape, a weight
    of 0 never drawn (at either end or between), the frequencies those of the weights (chi-square)."""
    generator = torch.Generator().manual_seed(3)
    weights = torch.tensor([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    n = 40_000
    draws = sample(weights[:, None, :].expand(2, n, 6), generator)  # [2, n]
    assert draws.shape == (2, n) and draws.dtype == torch.long
    for row in range(2):
        counts = torch.bincount(draws[row], minlength=6).double()
        assert counts[weights[row] == 0].sum() == 0
        expected = weights[row] / weights[row].sum() * n
        kept = weights[row] > 0
        assert chisquare(counts[kept].numpy(), expected[kept].numpy()).pvalue > 1e-3
    one = torch.zeros(49152)
    one[49151] = 1.0
    assert int(sample(one, generator)) == 49151  # a point mass at the last token, one row without a batch


@pytest.mark.parametrize("case", ["equal", "uniform", "disjoint", "skewed", "disjoint-second"])
def test_chain_output_follows_target_at_each_position(case):
    accepted, emitted = run_chain(draft_cases()[case])
    assert chi_square_p(emitted[:, 0], TARGET[0]) > P_VALUE
    if case == "disjoint":  # nothing is ever accepted: every token comes from the residual
        assert bool((accepted == 0).all())
        return
    assert chi_square_p(emitted[accepted >= 1, 1], TARGET[1]) > P_VALUE
    if case == "equal":
        assert bool((accepted == 2).all())
    if case == "disjoint-second":
        assert bool((accepted == 1).all())


def test_chain_with_point_mass_drafts_follows_target():
    accepted, emitted = run_chain(None, one_hot_tokens=torch.tensor([1, 3]))
    assert chi_square_p(emitted[:, 0], TARGET[0]) > P_VALUE
    assert chi_square_p(emitted[accepted >= 1, 1], TARGET[1]) > P_VALUE


def test_the_chi_square_check_has_power():
    """Keeping drafts without the rejection step must be caught: the tests above can fail."""
    draft = draft_cases()["skewed"]
    tokens = torch.multinomial(draft[0], 40000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert chi_square_p(tokens, TARGET[0] + 1e-9) < 1e-6


# End to end: specdec.generate on a tiny model, batches of identical prompts ----------------------------
def exact_two_token_distribution(model, prompt, config: SamplingConfig) -> torch.Tensor:
    """P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) under the warped target, as a flat [V*V] vector."""
    vocab = model.get_output_embeddings().weight.shape[0]
    with torch.no_grad():
        first = probabilities(model(torch.tensor([prompt])).logits[0, -1], config)
        support = first.nonzero().squeeze(1)
        rows = torch.tensor([prompt + [t] for t in support.tolist()])
        second = probabilities(model(rows).logits[:, -1], config)
    joint = torch.zeros(vocab, vocab)
    joint[support] = first[support, None] * second
    return joint.flatten()


@pytest.mark.parametrize("drafter_kind,temperature,top_k,top_p", [
    ("none", 1.0, 6, None),
    ("draft", 1.0, 6, None),
    ("draft", 0.8, None, 0.7),
    ("self", 1.2, 5, 0.95),
    ("lookup", 1.0, 4, None),
    ("draft-tree", 1.0, 6, None),   # trees: top-k point-mass siblings, exact recursive rejection
    ("self-tree", 0.9, None, 0.9),
    ("lookup-tree", 1.0, 4, None),
    ("retrieval", 1.0, 5, None),
    ("retrieval-tree", 0.8, None, 0.9),
    ("lookahead", 1.0, 5, None),
    ("lookahead-tree", 0.9, None, 0.9),
])
def test_generate_samples_the_warped_target(drafter_kind, temperature, top_k, top_p, targets, hf_models, model_dirs,
                                            backend, tmp_path):
    target = targets["llama"]
    target.eos_token_ids = ()
    prompt = target.encode(["x = x + 1\nx = x"])[0]
    config = SamplingConfig(temperature, top_k, top_p)
    exact = exact_two_token_distribution(hf_models["llama"], prompt, config)
    drafter = {"none": NoDraft(), "draft": DraftModel(model_dirs["llama-draft"], backend=backend),
               "self": DraftModel(model_dirs["llama"], backend=backend),
               "lookup": PromptLookup(max_ngram=2),
               "lookahead": Lookahead(window=3, ngram=3, guesses=3)}.get(drafter_kind.removesuffix("-tree"))
    if drafter_kind.startswith("retrieval"):  # text whose n-grams meet the prompt's tail, some drafts right
        from specdec.drafters.retrieval import Retrieval, build_datastore
        texts = ["x = x + 1\nx = x + 2\n", "x = x * y\n", "y = x - 1\nx = x\n"] * 3
        generator = torch.Generator().manual_seed(0)
        noise = torch.randint(target.vocab_size, (4, 30), generator=generator).tolist()
        drafter = Retrieval(build_datastore(target.encode(texts) + noise, tmp_path / "store",
                                            vocab_size=target.vocab_size), min_ngram=1)
    tree = TreeConfig(depth=2, topk=3, num_nodes=6) if drafter_kind.endswith("-tree") else None
    samples, neighbours, proposed = [], [], 0
    for seed in range(3):  # t1 from the prefill, t2 from the first speculative step (room for two drafts)
        out = specdec.generate(target, [prompt] * 1500, drafter=drafter, num_draft_tokens=2, max_new_tokens=4,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, tree=tree)
        samples += [a * target.vocab_size + b for a, b, *_ in out.token_ids]
        proposed += out.stats.drafts_proposed
        firsts = [ids[0] for ids in out.token_ids]
        neighbours += [a * target.vocab_size + b for a, b in zip(firsts[0::2], firsts[1::2])]
    assert drafter_kind == "none" or proposed > 0, "nothing drafted: speculative sampling untested"
    assert chi_square_p(torch.tensor(samples), exact) > P_VALUE
    # Rows of one batch are independent draws: neighbouring rows' first tokens follow p x p.
    first = exact.reshape(target.vocab_size, target.vocab_size).sum(1)
    assert chi_square_p(torch.tensor(neighbours), torch.outer(first, first).flatten()) > P_VALUE
    again = specdec.generate(target, [prompt] * 50, drafter=drafter, num_draft_tokens=2, max_new_tokens=4,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=11, tree=tree)
    same_seed = specdec.generate(target, [prompt] * 50, drafter=drafter, num_draft_tokens=2, max_new_tokens=4,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=11, tree=tree)
    assert again.token_ids == same_seed.token_ids


def test_sampling_in_ragged_batches_runs_to_each_rows_own_end(targets, model_dirs):
    """Rows of different lengths stop at their own EOS or limit while the others go on."""
    target = targets["qwen2"]
    target.eos_token_ids = (target.encode(["\n"])[0][0],)
    prompts = target.encode(["def f(x):\n    return x\n", "import os", "x = 1\ny = 2\nz = 3\n", "class A:\n", "a"])
    for drafter in (DraftModel(model_dirs["qwen2-draft"]), PromptLookup()):
        runs = [specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=30,
                                 temperature=0.9, top_p=0.95, seed=3) for _ in range(2)]
        assert runs[0].token_ids == runs[1].token_ids
        for ids in runs[0].token_ids:
            assert 1 <= len(ids) <= 30
            assert all(t not in target.eos_token_ids for t in ids[:-1])
            assert len(ids) == 30 or ids[-1] in target.eos_token_ids
