"""The target model: a Hugging Face causal LM, its tokenizer and the facts generation needs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from specdec.backends import hf
from specdec.errors import InvalidArgumentError, SpecdecError, UnsupportedModelError


BACKENDS = ("auto", "native", "hf")


@dataclass
class Target:
    """A loaded causal LM. ``forward`` runs it on a block of columns of a ragged KV cache."""

    model: torch.nn.Module | None = None  # the transformers model; None on the native backend
    tokenizer: object | None = None
    name: str = "target"
    eos_token_ids: tuple[int, ...] = field(default=())
    backend: object = None  # how the model runs on a ragged cache (hf.HFBackend, native.NativeBackend)
    generation_config: object = None
    path: str | None = None  # the model directory, when loaded from one

    def __post_init__(self):
        if self.backend is None:
            self.backend = hf.HFBackend.for_model(self.model)
        if self.generation_config is None and self.model is not None:
            self.generation_config = getattr(self.model, "generation_config", None)
        if not self.eos_token_ids:
            self.eos_token_ids = hf.eos_token_ids(self.config, self.generation_config)

    @property
    def config(self):
        return self.backend.config

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def max_positions(self) -> int | None:
        return hf.max_positions(self.config)

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def num_layers(self) -> int:
        return self.backend.num_layers

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.config, "pad_token_id", None)
        if pad is None and self.tokenizer is not None:
            pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        return int(pad)

    def generation_model(self):
        """A transformers model for generation-config logic: the model itself, or a weightless one."""
        if self.model is not None:
            return self.model
        if getattr(self, "_weightless", None) is None:
            self._weightless = hf.weightless_model(self.config, self.generation_config)
        return self._weightless

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
        return cache.forward(tokens, valid, logits_to_keep, hidden_layers, block_mask, positions)  # None: all valid

    def input_embeddings(self) -> torch.Tensor:
        """The embedding matrix [V, H] (drafters that reuse the target's embedding)."""
        if self.model is None:
            return self.backend.model.embed
        return self.model.get_input_embeddings().weight.detach()

    def output_head(self) -> torch.Tensor:
        """The LM head's weight [V, H], applied after the final norm (drafters that reuse the head)."""
        if self.model is None:
            return self.backend.model.head_weight()
        return self.model.get_output_embeddings().weight.detach()

    def fingerprint(self) -> str:
        """A short hash of the weights a drafter depends on (embedding and head, rounded to bfloat16, so
        the same checkpoint loaded in any dtype gives the same value)."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = weights_fingerprint(self.input_embeddings(), self.output_head())
        return self._fingerprint

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or None

    def render_chat(self, messages: list[dict], template: str | None = None) -> str:
        """A conversation as the text the model continues as the assistant, through ``template`` (default:
        the tokenizer's). The template writes the special tokens it wants: tokenise the text adding none."""
        template = template or self.chat_template
        if self.tokenizer is None or not template:
            raise InvalidArgumentError(f"{self.name} has no chat template to render a conversation with")
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # the template's own refusals (roles out of order, ...)
            raise InvalidArgumentError(f"the chat template cannot render these messages: {exc}") from None

    def encode(self, prompts) -> list[list[int]]:
        """Prompts as token ids. A prompt is a string (needs a tokenizer), a list of ints, or a conversation
        (a list of {"role", "content"} dicts, rendered by ``render_chat``); a lone prompt needs no list."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if not prompts:
            raise InvalidArgumentError("no prompts given")
        encoded = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                prompt = self.render_chat(prompt)
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


def weights_fingerprint(embed: torch.Tensor, head: torch.Tensor) -> str:
    import hashlib

    digest = hashlib.sha256()
    for tensor in (embed, head):
        digest.update(tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def load_target(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu", backend: str = "auto", quantize: str | None = None) -> Target:
    """Load a local Hugging Face causal-LM directory (config, weights, tokenizer), offline; or a GGUF file
    (its quantized weights run as they are on the native backend). ``quantize`` (q8_0, q4_0, q4_1):
    block-quantize the matrices at load (native backend only).

    ``backend``: "native" runs specdec's own forward pass (Llama, Qwen2, Qwen3, Mistral), "hf" runs
    transformers' model, "auto" picks native where it is supported and transformers elsewhere.
    """
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    path = resolve_model(path)
    runner, model = load_backend(path, dtype, device, backend, quantize)
    target = Target(model=model, tokenizer=hf.load_tokenizer(path), name=str(path), backend=runner,
                    generation_config=hf.load_generation_config(path) if model is None else None, path=str(path))
    if model is None and target.generation_config is not None:
        # The weightless transformers model that reads the generation config costs about a second of
        # imports: pay it while loading, not inside the first generation's timings.
        try:
            target.generation_model()
        except Exception:
            pass  # GenerationProcessors.for_target says what is not applied, when generating
    return target


def load_backend(path: str | os.PathLike, dtype: torch.dtype, device, backend: str = "auto",
                 quantize: str | None = None):
    """(backend, transformers model or None) for a model directory; shared by targets and draft models."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    path = resolve_model(path)
    hf.check_model_dir(path)
    if quantize is not None and backend == "hf":
        raise InvalidArgumentError(f"quantizing at load ({quantize}) runs on the native backend, not on transformers")
    if backend != "hf":
        from specdec.backends.native import NativeBackend
        reason = NativeBackend.supports(path) or NativeBackend.supports_run(dtype, device)
        if reason is None:
            return NativeBackend.load(path, dtype=dtype, device=device, quantize=quantize), None
        if backend == "native" or quantize is not None:
            from specdec.models.llama import SUPPORTED
            raise UnsupportedModelError(f"the native backend cannot run {path}: {reason}; it runs {SUPPORTED}")
    model = hf.load_causal_lm(path, dtype=dtype, device=device)
    return hf.HFBackend.for_model(model), model


def resolve_model(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` itself, or the folder of the zoo or real model it names (``smollm2-135m``, built on
    first use) when no such path exists."""
    from specdec.zoo import REAL_MODELS, zoo_path

    name = str(path)
    if name.endswith(".gguf") and os.path.isfile(name):  # a GGUF file: a folder of its metadata linking it
        from specdec.models.gguf import gguf_folder

        return gguf_folder(name)
    if not os.path.exists(name) and (name in REAL_MODELS or name.partition("/")[0] in REAL_MODELS):
        return zoo_path(name)
    return path


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise InvalidArgumentError(f"unknown dtype {name!r}; use one of {', '.join(sorted(table))}")
    return table[name]
