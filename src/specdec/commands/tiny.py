"""Tiny random-weight models with a real tokenizer, built offline: for tests and self-checks.

They say nothing about acceptance rates (see the zoo for trained models) but exercise every code
path of loading, caching and verification on several architectures.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json.decoder
import textwrap
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from specdec.backends.hf import quiet

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")
EOS, PAD = "<|endoftext|>", "<|pad|>"


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few standard-library modules: deterministic for a Python version."""
    texts = [inspect.getsource(module) for module in (argparse, dataclasses, json.decoder, textwrap)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)


def build_model(architecture: str, vocab_size: int, eos_token_id: int, pad_token_id: int, layers: int = 2,
                hidden: int = 64, max_positions: int = 256, seed: int = 0, init_std: float = 0.02):
    """A random causal LM of the given family; init_std > 0.02 makes its greedy choices clear-cut."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                  bos_token_id=eos_token_id, initializer_range=init_std)
    llama_like = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, **common)
    if architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(**llama_like))
    elif architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**llama_like))
    elif architecture == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **llama_like))
    elif architecture == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **llama_like))
    elif architecture == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_positions,
                                           **common))
    else:
        raise ValueError(f"unknown architecture {architecture!r}; choose from {', '.join(ARCHITECTURES)}")
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model.eval()


def save_tiny(directory: str | Path, architecture: str = "llama", tokenizer: PreTrainedTokenizerFast | None = None,
              **model_options) -> Path:
    """Write a tiny model and its tokenizer to directory, in the Hugging Face layout."""
    directory = Path(directory)
    tokenizer = tokenizer or build_tokenizer()
    model = build_model(architecture, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id,
                        **model_options)
    with quiet():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_bench_pair(directory: str | Path, layers: int = 12, hidden: int = 512, vocab_size: int = 8192,
                    max_positions: int = 2048, heads: int = 8, kv_heads: int = 4, intermediate: int | None = None,
                    tie: bool = False) -> tuple[Path, Path]:
    """A ~70M-parameter random Llama and a 1-layer draft cut from it (its first layer, embedding,
    final norm and head), for timing the decode loop where a forward pass is not trivially cheap.

    Random weights say nothing about real acceptance rates; the early-exit draft only makes them
    non-zero. Returns (target dir, draft dir).
    """
    directory = Path(directory)
    tokenizer = build_tokenizer(vocab_size)
    torch.manual_seed(0)
    # The vocabulary keeps its requested size even where the small training text yields fewer merges:
    # the LM head's cost is part of the shape being measured.
    config = LlamaConfig(vocab_size=max(vocab_size, len(tokenizer)), hidden_size=hidden,
                         intermediate_size=intermediate or 3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=tie)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})).eval()
    draft.load_state_dict({name: value for name, value in target.state_dict().items()
                           if not name.startswith("model.layers.") or name.startswith("model.layers.0.")})
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        with quiet():
            model.save_pretrained(directory / name)
        tokenizer.save_pretrained(directory / name)
        paths.append(directory / name)
    return paths[0], paths[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m specdec.commands.tiny",
                                     description="write OUT/target (random Llama) and OUT/draft (its first layer)")
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP size (default 3 x hidden)")
    parser.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    args = parser.parse_args()
    # e.g. the 135M shape of SmolLM: --layers 30 --hidden 576 --heads 9 --kv-heads 3 --intermediate 1536
    #      --vocab 49152 --tie
    for path in save_bench_pair(args.out, layers=args.layers, hidden=args.hidden, vocab_size=args.vocab,
                                heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
                                tie=args.tie):
        print(path)
