"""The target model: a Hugging Face causal LM, its tokenizer and the facts generation needs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from . import hf
from .errors import InvalidArgumentError, SpecdecError


@dataclass
class Target:
    """A loaded causal LM. ``forward`` runs it on a block of columns of a ragged KV cache."""

    model: torch.nn.Module
    tokenizer: object | None = None
    name: str = "target"
    eos_token_ids: tuple[int, ...] = field(default=())
    backend: object = None  # how the model runs on a ragged cache (hf.HFBackend); decided at load

    def __post_init__(self):
        if not self.eos_token_ids:
            self.eos_token_ids = hf.eos_token_ids(self.model)
        if self.backend is None:
            self.backend = hf.HFBackend.for_model(self.model)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        return hf.max_positions(self.config)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.config, "pad_token_id", None)
        if pad is None and self.tokenizer is not None:
            pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        return int(pad)

    def new_cache(self, batch_size: int, capacity: int | None = None):
        """A ragged KV cache for ``batch_size`` rows of up to ``capacity`` tokens (None: grows)."""
        return self.backend.new_cache(batch_size, capacity)

    def forward(self, cache, tokens: torch.Tensor, valid: torch.Tensor | None = None, logits_to_keep: int = 1,
                hidden_layers: tuple[int, ...] = (), block_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """Run a block [B, n] through the model on top of ``cache``.

        Returns logits [B, logits_to_keep, V] and, when ``hidden_layers`` is given, hidden states
        [B, n, len(hidden_layers), H]; index 0 is the embedding output, i the output of layer i.
        ``block_mask`` [B, n, n] says which tokens of the block each token sees (None: causal),
        ``positions`` [B, n] overrides the positions (None: live tokens counted in order).
        """
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        return cache.forward(tokens, valid, logits_to_keep, hidden_layers, block_mask, positions)

    def encode(self, prompts) -> list[list[int]]:
        """Prompts as token ids: each prompt is a string (needs a tokenizer) or a list of ints."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise InvalidArgumentError("no prompts given")
        encoded = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise SpecdecError(f"{self.name} has no tokenizer; pass prompts as token ids")
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
            else:
                ids = [int(token) for token in prompt]
                if any(not 0 <= token < self.vocab_size for token in ids):
                    raise InvalidArgumentError(f"prompt {index} has token ids outside [0, {self.vocab_size})")
            if not ids:
                raise InvalidArgumentError(f"prompt {index} is empty")
            encoded.append(ids)
        return encoded

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def load_target(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu") -> Target:
    """Load a local Hugging Face causal-LM directory (config, weights, tokenizer), offline."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    model = hf.load_causal_lm(path, dtype=dtype, device=device)
    return Target(model=model, tokenizer=hf.load_tokenizer(path), name=str(path))


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise InvalidArgumentError(f"unknown dtype {name!r}; use one of {', '.join(sorted(table))}")
    return table[name]
