"""Decide before running: every model runs exactly (batched, or row by row) or is refused in one line.

Sliding windows (Mistral, Qwen2, Gemma-2/3-style alternation, gpt_neo's local layers), decoders that
place tokens themselves (the bart family), eager-only attention, recurrent hybrids, and the logits
processing a generation config asks for.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specdec
from specdec.backends import hf
from specdec.drafters import DraftModel, Lookahead, NoDraft, PromptLookup
from specdec.errors import UnsupportedModelError
from specdec.backends.target import Target, load_target
from specdec.commands.tiny import build_model

TEXTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "import torch",
         "class Cache:\n    def __init__(self, size):\n        self.size = size\n"]
MAX_NEW = 30


def tiny(model_type, tokenizer, init=0.15, seed=0, attn="sdpa", **options):
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                 bos_token_id=tokenizer.eos_token_id, initializer_range=init)
    config = AutoConfig.for_model(model_type, **{**sizes, **options})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def reference(model, prompt, max_new_tokens=MAX_NEW):
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def noisy_copy(model, scale=0.02, seed=1):
    """A draft that agrees with the target often but not always: rollback and holes get exercised."""
    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return draft


def assert_exact(model, tokenizer, expect_mode=None):
    target = Target(model, tokenizer)
    target.eos_token_ids = ()
    if expect_mode is not None:
        assert target.backend.mode == expect_mode, target.backend
    prompts = target.encode(TEXTS)
    expected = [reference(model, p) for p in prompts]
    assert len({t for row in expected for t in row}) >= 6, "the test model barely varies its output"
    accepted = 0
    for drafter in (NoDraft(), PromptLookup(max_ngram=3), DraftModel(noisy_copy(model))):
        out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=MAX_NEW)
        assert out.token_ids == expected, f"{drafter.name}, ragged batch"
        accepted += out.stats.drafts_accepted
        alone = specdec.generate(target, prompts[:1], drafter=drafter, num_draft_tokens=4, max_new_tokens=MAX_NEW)
        assert alone.token_ids == expected[:1], f"{drafter.name}, alone"
    assert accepted > 0
    return target


@pytest.mark.parametrize("model_type, options", [
    ("mistral", dict(sliding_window=8)),
    ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1)),  # layer 1 slides
    ("gemma2", dict(sliding_window=8, head_dim=16, init=0.02, attn="eager")),         # alternating layers
    ("gemma3_text", dict(sliding_window=8, head_dim=16, init=0.02,
                         layer_types=["sliding_attention", "full_attention"])),
    ("cohere2", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
])
def test_sliding_windows_run_exactly_past_the_window(model_type, options, tokenizer):
    model = tiny(model_type, tokenizer, **options)
    target = assert_exact(model, tokenizer, expect_mode="batched")
    assert any(w.sliding == 8 for w in target.backend.masks.values())


def test_a_wrong_window_fails_the_probe(tokenizer):
    """The decision is measured: masks that ignore the window, or use another one, are caught."""
    model = tiny("mistral", tokenizer, sliding_window=8)
    assert hf.HFBackend(model, masks={"sliding_attention": hf.Window(sliding=8)}).probe() < 1e-4
    assert hf.HFBackend(model).probe() > 1e-2                                             # no window
    assert hf.HFBackend(model, masks={"sliding_attention": hf.Window(sliding=9)}).probe() > 1e-2


def test_local_windows_under_other_names_run_row_by_row(tokenizer):
    model = tiny("gpt_neo", tokenizer, window_size=8, attention_types=[[["global", "local"], 1]], num_layers=2,
                 num_heads=4, attn="eager")
    target = assert_exact(model, tokenizer, expect_mode="rowwise")
    assert "window_size" in target.backend.reason
    with pytest.raises(UnsupportedModelError) as error:  # lookahead's window needs a block mask
        specdec.generate(target, target.encode(TEXTS[:1]), drafter=Lookahead(), max_new_tokens=4)
    assert "lookahead" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("model_type", ["bart", "mbart", "marian", "pegasus", "blenderbot"])
def test_decoders_that_place_tokens_themselves_run_row_by_row(model_type, tokenizer):
    options = dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
                   encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=128, init_std=0.3,
                   decoder_start_token_id=tokenizer.eos_token_id)
    model = tiny(model_type, tokenizer, **options)
    target = assert_exact(model, tokenizer, expect_mode="rowwise")
    assert "positions" in target.backend.reason
    assert hf.HFBackend(model).probe() > 1e-2  # batched, it would be silently wrong


@pytest.mark.parametrize("model_type, words", [
    ("qwen3_next", "recurrent state"),
    ("mamba", "recurrent state"),
])
def test_recurrent_models_are_refused_before_running(model_type, words, tokenizer):
    model = tiny(model_type, tokenizer, init=0.02, attn="eager")
    with pytest.raises(UnsupportedModelError) as error:
        Target(model, tokenizer)
    message = str(error.value)
    assert "\n" not in message and model_type in message and words in message


def test_eager_only_models_load_with_eager_and_say_so(tmp_path, tokenizer):
    model = tiny("gemma2", tokenizer, sliding_window=8, head_dim=16, init=0.02, attn="eager")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    assert target.backend.attention == "eager"
    out = specdec.generate(target, TEXTS[:2], drafter=PromptLookup(), max_new_tokens=8)
    assert out.stats.backend == "hf/eager"


def test_generation_config_logits_processing_is_applied_exactly(tokenizer):
    model = build_model("llama", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, init_std=0.15)
    target = Target(model, tokenizer)
    target.eos_token_ids = ()
    prompts = target.encode(TEXTS)
    plain = [reference(model, p) for p in prompts]
    settings = model.generation_config
    settings.repetition_penalty, settings.no_repeat_ngram_size, settings.min_new_tokens = 1.3, 3, 5
    settings.suppress_tokens, settings.bad_words_ids = [plain[0][0]], [[plain[1][0]], [plain[2][1], plain[2][2]]]
    expected = [reference(model, p) for p in prompts]
    assert expected != plain, "the processing must change the output, or this test proves nothing"
    for drafter in (NoDraft(), PromptLookup(), DraftModel(noisy_copy(model))):
        out = specdec.generate(target, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=MAX_NEW)
        assert out.token_ids == expected, drafter.name
        assert "RepetitionPenaltyLogitsProcessor" in out.stats.logits_processors
