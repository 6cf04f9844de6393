"""End to end, in bfloat16 as in float32: every drafter's output equals plain decoding of the same
target token for token (native backend), and sampling keeps the target's own distribution.

The reference is specdec's plain decoding (drafter none) of each prompt alone, on the same loaded
target: in bfloat16 transformers' logits are not a reference at all, since its kernels round a
row differently in every block shape.
"""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec import TreeConfig
from specdec.drafters import DraftModel, Lookahead, NoDraft, PromptLookup
from specdec.sampling import SamplingConfig, probabilities
from specdec.zoo import zoo_path
from specdec.zoo.tasks import load_tasks

from test_greedy_parity import PROMPTS
from test_sampling import P_VALUE, chi_square_p

TREE = TreeConfig(depth=3, topk=2, num_nodes=6)


def plain(target, prompts, max_new_tokens):
    return [specdec.generate(target, [p], drafter=NoDraft(), max_new_tokens=max_new_tokens).token_ids[0]
            for p in prompts]


def assert_equal_to(target, prompts, reference, runs, max_new_tokens):
    """Every (drafter, generate options) of ``runs`` gives ``reference`` on the ragged batch ``prompts``
    and on its third prompt alone."""
    for drafter, setting in runs:
        out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=max_new_tokens, **setting)
        assert out.token_ids == reference, f"{drafter.name} {setting} batch"
        alone = specdec.generate(target, [prompts[2]], drafter=drafter, max_new_tokens=max_new_tokens, **setting)
        assert alone.token_ids == [reference[2]], f"{drafter.name} {setting} alone"


def check_against_plain(target, prompts, drafters, max_new_tokens, ks=(1, 4, 8), alone=(0, 2)):
    reference = plain(target, prompts, max_new_tokens)
    for drafter in drafters:
        settings = [dict(num_draft_tokens=k) for k in ks]
        if target.backend.supports_trees:
            settings.append(dict(tree=TREE))
        for setting in settings:
            out = specdec.generate(target, prompts, drafter=drafter, max_new_tokens=max_new_tokens, **setting)
            assert out.stats.exact_numerics
            assert out.token_ids == reference, f"{drafter.name} {setting} batch of {len(prompts)}"
            for i in alone:
                one = specdec.generate(target, [prompts[i]], drafter=drafter, max_new_tokens=max_new_tokens, **setting)
                assert one.token_ids == [reference[i]], f"{drafter.name} {setting} prompt {i} alone"
    return reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_drafter_equals_plain_decoding_in_bfloat16(arch, model_dirs):
    target = specdec.load_target(model_dirs[arch], dtype=torch.bfloat16, backend="native")
    prompts = target.encode(PROMPTS)
    target.eos_token_ids = ()
    free = plain(target, prompts, 40)
    stops = [t for row in free for t in row[3:] if any(t not in other for other in free)]
    target.eos_token_ids = (stops[0],)  # a token that ends some rows early while others run to the limit
    drafters = [PromptLookup(max_ngram=3),
                DraftModel(model_dirs[f"{arch}-draft"], dtype=torch.bfloat16, backend="native"),
                DraftModel(model_dirs[f"{arch}-draft"], backend="native"),  # a float32 draft for a bf16 target
                DraftModel(target),  # the target as its own draft: every draft accepted
                Lookahead(window=3, ngram=4, guesses=3)]  # its window rides in the bfloat16 pass
    reference = check_against_plain(target, prompts, drafters, 40)
    assert any(r and r[-1] in target.eos_token_ids for r in reference) and any(len(r) == 40 for r in reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zoo_drafters_equal_plain_decoding(dtype):
    """The trained zoo pair, where drafts are mostly right and near-ties are real."""
    target = specdec.load_target(zoo_path("target"), dtype=dtype, backend="native")
    prompts = target.encode(load_tasks("code-completion")[:6])
    drafters = [PromptLookup(), DraftModel(zoo_path("draft"), dtype=dtype, backend="native"), Lookahead()]
    check_against_plain(target, prompts, drafters, 64, ks=(4,), alone=(1,))


def native_two_token_distribution(target, prompt, config: SamplingConfig) -> torch.Tensor:
    """P(t1, t2) under the warped target as the native backend computes it, as a flat [V*V] vector."""
    def last_logits(rows):
        cache = target.new_cache(len(rows), len(rows[0]) + 1)
        logits, _ = target.forward(cache, torch.tensor(rows))
        return logits[:, -1].float()

    first = probabilities(last_logits([prompt])[0], config)
    support = first.nonzero().squeeze(1)
    second = probabilities(last_logits([prompt + [t] for t in support.tolist()]), config)
    joint = torch.zeros(target.vocab_size, target.vocab_size)
    joint[support] = first[support, None] * second
    return joint.flatten()


@pytest.mark.parametrize("drafter_kind,temperature,top_k,top_p", [
    ("draft", 1.0, 6, None),
    ("self", 1.2, 5, 0.95),
    ("lookup", 1.0, 4, None),
    ("draft-tree", 1.0, 6, None),
    ("lookahead", 1.0, 5, None),
])
def test_bfloat16_sampling_keeps_the_targets_distribution(drafter_kind, temperature, top_k, top_p, model_dirs):
    config = SamplingConfig(temperature, top_k, top_p)
    target, prompt, exact = sampling_case(model_dirs["llama"], config)
    drafter = {"draft": DraftModel(model_dirs["llama-draft"], dtype=torch.bfloat16, backend="native"),
               "self": DraftModel(target), "lookup": PromptLookup(max_ngram=2),
               "lookahead": Lookahead(window=3, ngram=3, guesses=3)}[drafter_kind.removesuffix("-tree")]
    tree = TreeConfig(depth=2, topk=3, num_nodes=6) if drafter_kind.endswith("-tree") else None
    assert chi_square_p(sampled_pairs(target, prompt, drafter, config, tree), exact) > P_VALUE


def sampling_case(folder, config: SamplingConfig, text: str = "x = x + 1\nx = x"):
    """(native bfloat16 target without EOS, the prompt's ids, its exact two-token distribution)."""
    target = specdec.load_target(folder, dtype=torch.bfloat16, backend="native")
    target.eos_token_ids = ()
    prompt = target.encode([text])[0]
    return target, prompt, native_two_token_distribution(target, prompt, config)


def bfloat16_with_eos(folder, max_new_tokens=40):
    """(native bfloat16 target, prompts, plain outputs) with an EOS chosen so that some rows stop at it
    and others at the limit."""
    target = specdec.load_target(folder, dtype=torch.bfloat16, backend="native")
    prompts = target.encode(PROMPTS)
    target.eos_token_ids = ()
    free = plain(target, prompts, max_new_tokens)
    target.eos_token_ids = ([t for row in free for t in row[3:] if any(t not in other for other in free)][0],)
    reference = plain(target, prompts, max_new_tokens)
    assert any(r[-1] in target.eos_token_ids for r in reference) and any(len(r) == max_new_tokens for r in reference)
    return target, prompts, reference


def sampled_pairs(target, prompt, drafter, config: SamplingConfig, tree=None, rows: int = 1500) -> torch.Tensor:
    """The first two tokens of continuations of ``prompt`` sampled with ``drafter``, three seeds, as flat ids
    t1 * V + t2. t1 comes from the prefill, t2 is the first token of the first speculative step: four new
    tokens leave that step room for two drafts (and a third token), and it must have drafted."""
    samples, proposed = [], 0
    for seed in range(3):
        out = specdec.generate(target, [prompt] * rows, drafter=drafter, num_draft_tokens=2, max_new_tokens=4,
                               temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, seed=seed,
                               tree=tree)
        samples += [a * target.vocab_size + b for a, b, *_ in out.token_ids]
        proposed += out.stats.drafts_proposed
    assert proposed > 0, f"{drafter.name} drafted nothing: the test would not test speculative sampling"
    return torch.tensor(samples)
