"""Conversations as prompts: ``generate`` renders them with the target's chat template, as
``specdec generate --chat`` and the server do; a target without a template refuses them in one line."""

from __future__ import annotations

import json

import pytest

import specdec
from specdec.backends.target import load_target
from specdec.commands.cli import main
from specdec.commands.tiny import build_tokenizer, save_tiny
from specdec.errors import InvalidArgumentError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer has ChatML's special tokens and template."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return save_tiny(tmp_path_factory.mktemp("chat") / "llama", "llama", tokenizer, init_std=0.15)


@pytest.fixture(scope="module")
def chat_target(chat_dir):
    return load_target(chat_dir)


def rendered_ids(target, messages) -> list[int]:
    """transformers' own rendering and tokenisation of a conversation."""
    return target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]


def test_conversation_equals_its_rendered_ids(chat_target):
    ids = rendered_ids(chat_target, CONVERSATION)
    assert ids[0] == chat_target.tokenizer.convert_tokens_to_ids("<|im_start|>")  # special tokens stay whole
    assert chat_target.encode(CONVERSATION) == [ids]
    expected = specdec.generate(chat_target, [ids], max_new_tokens=8).token_ids
    assert specdec.generate(chat_target, CONVERSATION, max_new_tokens=8).token_ids == expected
    drafted = specdec.generate(chat_target, [CONVERSATION, "def f(x):", ids], drafter=specdec.drafters.PromptLookup(),
                               num_draft_tokens=3, max_new_tokens=8)
    plain = specdec.generate(chat_target, ["def f(x):"], max_new_tokens=8).token_ids
    assert drafted.token_ids == [expected[0], plain[0], expected[0]]


def test_conversation_without_template_is_refused(model_dirs):
    target = load_target(model_dirs["llama"])
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        specdec.generate(target, [{"role": "user", "content": "hi"}], max_new_tokens=2)


def test_cli_chat(capsys, chat_dir, chat_target, model_dirs, tmp_path):
    user = [{"role": "user", "content": "def add(a, b):"}]
    assert main(["generate", "--target", str(chat_dir), "--prompt", user[0]["content"], "--chat", "--json",
                 "--max-new-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["token_ids"] == specdec.generate(chat_target, user, max_new_tokens=6).token_ids[0]

    assert main(["generate", "--target", str(model_dirs["llama"]), "--prompt", "hi", "--chat"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no chat template" in lines[0]

    prompts = tmp_path / "ids.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    assert main(["generate", "--target", str(chat_dir), "--prompts", str(prompts), "--chat"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--chat takes text prompts" in lines[0]
