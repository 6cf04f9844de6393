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


def save_tiny_deepseek_mtp(directory: str | Path, tokenizer: PreTrainedTokenizerFast | None = None,
                           seed: int = 0) -> Path:
    """A tiny random DeepSeek-V3 (MLA attention, a MoE MTP layer) with one MTP layer, in the layout its
    checkpoints use: ``num_nextn_predict_layers`` in config.json and the module as the extra decoder
    layer ``model.layers.{L}.*`` (``enorm``, ``hnorm``, ``eh_proj``, the block, ``shared_head.norm``)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    directory = Path(directory)
    tokenizer = tokenizer or build_tokenizer()
    layers = 2
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=layers, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
        num_nextn_predict_layers=1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    modules = MtpModel(model, 1)
    with torch.no_grad():  # post_init's defaults leave the norms at one: make the module's own weights count
        for name, param in modules.named_parameters():
            if name.startswith("layers.") and param.dim() >= 2:
                param.normal_(0.0, 0.1)
    with quiet():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    weights = load_file(directory / "model.safetensors")
    for name, value in modules.state_dict().items():
        if not name.startswith("layers.0."):
            continue  # the embedding and head are the main model's
        rest = name.removeprefix("layers.0.")
        rest = rest.removeprefix("mtp_block.")
        rest = "shared_head.norm." + rest.removeprefix("post_norm.") if rest.startswith("post_norm.") else rest
        weights[f"model.layers.{layers}.{rest}"] = value.detach().clone().contiguous()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def save_tiny_mtp(directory: str | Path, architecture: str = "llama", design: str = "sequential", depth: int = 2,
                  tokenizer: PreTrainedTokenizerFast | None = None, scale: float = 0.15, **model_options) -> Path:
    """A tiny model (``save_tiny``) with ``depth`` random MTP modules or heads, in specdec's variant layout."""
    from specdec.models import mtp

    directory = save_tiny(directory, architecture, tokenizer, **model_options)
    from transformers import AutoConfig

    config = mtp.MtpConfig.of(AutoConfig.from_pretrained(directory), design, depth)
    torch.manual_seed(model_options.get("seed", 0) + 101)
    net = mtp.MtpNet(config)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, scale)
    return mtp.attach(directory, net)
