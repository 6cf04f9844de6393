"""Self-speculation networks: a target that drafts for itself, with its first layers or its MTP modules.

Three ways, all kept inside the model's own folder (one Hugging Face Llama checkpoint that loads as
an ordinary causal LM; the extra tensors are ignored by a plain loader):

* **LayerSkip** (no extra weights): the first E layers, then the model's own final norm and head,
  draft; the folder's config.json records the default exit layer (``specdec.layerskip``).
* **Sequential MTP modules** (DeepSeek-V3): module k reads the previous depth's hidden state
  h^{k-1}_i (h^0: the model's final-normed last hidden state) and the embedding of token i + k,
  ``eh_proj(cat(enorm(e), hnorm(h)))`` (embedding first, as the checkpoints order it), runs one
  decoder layer, normalises (``shared_head.norm``) and predicts token i + k + 1 with the model's
  own head. The normed output is h^k, fed to module k + 1 (transformers' ``MtpModel`` does the
  same). Saved as DeepSeek-V3 saves them: extra layers ``model.layers.{L + k - 1}.*`` and
  ``num_nextn_predict_layers`` in config.json.
* **Parallel heads** (Gloeckle et al.): the trunk is the model's first L - 1 layers and head 0
  its last layer (the next token); extra head i (1-based) is one decoder layer plus a norm on the
  trunk's output at position t (``hidden_states[L - 1]``) and predicts token t + 1 + i through the
  shared head. Saved as ``mtp_heads.{i - 1}.*``; no serving engine has a layout for them.

``MtpNet`` holds the modules as PyTorch (training, the reference); the runtime in
``specdec.drafters.mtp`` packs them for the kernels or runs them through transformers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.backends.native import NativeCache
from specdec.errors import DrafterMismatchError, ModelLoadError
from specdec.models import kernels, llama
from specdec.models.layers import DecoderLayer, RMSNorm

DESIGNS = ("sequential", "parallel")
MODULES_KEY = "specdec_mtp_target"   # config.json of a folder holding modules alone: the target they were trained on


@dataclass(frozen=True)
class MtpConfig:
    """The MTP modules a folder holds: ``design`` (sequential or parallel) and how many (``depth``)."""

    design: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int          # the main model's
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False           # each module's attention norms its query and key heads (Qwen3 layers)

    def __post_init__(self):
        if self.design not in DESIGNS:
            raise ModelLoadError(f"unknown MTP design {self.design!r}; expected one of {', '.join(DESIGNS)}")
        if self.depth < 1:
            raise ModelLoadError(f"MTP depth must be >= 1, got {self.depth}")

    @classmethod
    def of(cls, config, design: str, depth: int) -> "MtpConfig":
        """For a transformers Llama config (the main model)."""
        heads = int(config.num_attention_heads)
        return cls(design, depth, int(config.hidden_size), int(config.intermediate_size), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads),
                   int(getattr(config, "head_dim", None) or config.hidden_size // heads), int(config.num_hidden_layers),
                   float(config.rms_norm_eps), float(llama.rope_parameters(config)["rope_theta"]),
                   getattr(config, "model_type", "") == "qwen3")

    def prefix(self, index: int) -> str:
        """Tensor-name prefix of module ``index`` (0-based) in the checkpoint."""
        if self.design == "sequential":
            return f"model.layers.{self.num_hidden_layers + index}."
        return f"mtp_heads.{index}."

    def config_entries(self) -> dict:
        """What config.json of the main model gains."""
        entries = {"specdec_mtp": asdict(self)}
        if self.design == "sequential":
            entries["num_nextn_predict_layers"] = self.depth
        return entries

    @classmethod
    def from_config(cls, config, where: str) -> "MtpConfig | None":
        """The modules a main model's config declares; None when it has none."""
        data = getattr(config, "specdec_mtp", None)
        if data is None and isinstance(config, dict):
            data = config.get("specdec_mtp")
        if data is None:
            return None
        try:
            return cls(**data)
        except TypeError as exc:
            raise ModelLoadError(f"malformed specdec_mtp in {where}: {exc}") from None


class ModuleLayer(DecoderLayer):
    """The decoder layer every module or head is built around, shaped like the main model's layers."""

    def __init__(self, config: MtpConfig):
        c = config
        super().__init__(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, c.rope_theta, c.rms_norm_eps, c.qk_norm)


class SequentialModule(ModuleLayer):
    """One DeepSeek-V3 MTP module (names as the checkpoints use them)."""

    def __init__(self, config: MtpConfig):
        super().__init__(config)
        c = config
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds [B, T, H] of tokens i + k, previous [B, T, H] = h^{k-1}_i -> h^k [B, T, H] (normed)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        return self.shared_head.norm(self.block(x, positions))


class ParallelHead(ModuleLayer):
    """One extra output head: a decoder layer and a norm over the trunk."""

    def __init__(self, config: MtpConfig):
        super().__init__(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, trunk: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """trunk [B, T, H] (the input of the main model's last layer) -> normed output [B, T, H]."""
        return self.norm(self.block(trunk, positions))


class MtpNet(nn.Module):
    def __init__(self, config: MtpConfig):
        super().__init__()
        self.config = config
        kind = SequentialModule if config.design == "sequential" else ParallelHead
        self.modules_ = nn.ModuleList([kind(config) for _ in range(config.depth)])

    def init_from_main(self, main) -> None:
        """Start every module as a copy of the main model's last layer (and its final norm); a
        sequential module's projection passes the hidden state through and reads the embedding
        weakly, so training starts from 'apply the last layer once more'."""
        last = main.model.layers[-1].state_dict()
        final = main.model.norm.weight.detach()
        h = self.config.hidden_size
        with torch.no_grad():
            for module in self.modules_:
                module.load_state_dict(last, strict=False)
                if isinstance(module, SequentialModule):
                    module.shared_head.norm.weight.copy_(final)
                    module.eh_proj.weight.zero_()
                    module.eh_proj.weight[:, h:].copy_(torch.eye(h))
                    module.eh_proj.weight[:, :h].normal_(0.0, 0.02)
                else:
                    module.norm.weight.copy_(final)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The modules' tensors under their checkpoint names."""
        out = {}
        for index, module in enumerate(self.modules_):
            for name, value in module.state_dict().items():
                out[self.config.prefix(index) + name] = value
        return out

    def load_tensors(self, weights: dict[str, torch.Tensor], where: str) -> "MtpNet":
        from specdec.models.files import check_weights

        expected = self.tensors()
        check_weights(weights, expected, where)
        for index, module in enumerate(self.modules_):
            prefix = self.config.prefix(index)
            module.load_state_dict({name: weights[prefix + name].float() for name in module.state_dict()})
        return self.eval()


def read_mtp(path: str | Path, depth: int | None = None) -> MtpNet:
    """The MTP modules of a specdec model folder (float32), the first ``depth`` of them when given;
    one line when it has none or fewer."""
    path = Path(path)
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from None
    config = MtpConfig.from_config(data, str(file))
    if config is None:
        raise DrafterMismatchError(f"{path} has no MTP modules or heads (config.json declares none); "
                                   f"train them with `specdec train mtp` or use another drafter")
    if depth is not None:
        if not 1 <= depth <= config.depth:
            raise DrafterMismatchError(f"{path} has {config.depth} MTP {'modules' if config.design == 'sequential' else 'heads'}, "
                                       f"asked for depth {depth}")
        from dataclasses import replace
        config = replace(config, depth=depth)
    return MtpNet(config).load_tensors(llama.read_weights(path), str(path / "model.safetensors"))


# ---------------------------------------------------------------------------------------------
# Inference on the kernels.

class MtpRuntime:
    """The modules packed for the kernels beside the target's embedding and head.

    ``inputs(i, tokens, previous)`` is module i's first-layer input, ``output(i, states)`` what it
    hands on (sequential: the normed h^k; parallel: the layer's output), ``logits(i, out)`` its
    prediction through the shared head.
    """

    def __init__(self, net: MtpNet, embed: torch.Tensor, head: torch.Tensor, dtype: torch.dtype,
                 vocabulary: torch.Tensor | None = None):
        """``vocabulary``: draft from these rows of the head only (sorted target ids; ``draft_ids``)."""
        config = self.config = net.config
        self.dtype = dtype
        self.sequential = config.design == "sequential"
        self.draft_ids = None if vocabulary is None else vocabulary.clone()
        head = head.float() if vocabulary is None else head.float()[vocabulary]
        self.head = llama.matrix(head, dtype)
        self.cores, self.norms, self.heads, self.enorms, self.hnorms, self.projections = [], [], [], [], [], []
        for module in net.modules_:
            state = {name: value.detach().float() for name, value in module.state_dict().items()}

            def get(name: str, required: bool = True, state=state):
                return state.get(name) if not required else state[name]

            layer = llama.pack_layer(get, "", config.num_attention_heads, config.num_key_value_heads,
                                     config.head_dim, dtype)
            if self.sequential:
                self.norms.append(state["shared_head.norm.weight"].to(dtype))
                self.enorms.append(state["enorm.weight"].to(dtype))
                self.hnorms.append(state["hnorm.weight"].to(dtype))
                self.projections.append(llama.matrix(state["eh_proj.weight"], dtype))
                module_head = self.head
            else:
                module_head = llama.matrix(head, dtype, state["norm.weight"])
            self.heads.append(module_head)
            self.cores.append(llama.drafter_core(config_for_core(config), embed, [layer], module_head, dtype))

    @property
    def depth(self) -> int:
        return len(self.cores)

    def inputs(self, index: int, tokens: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """[B * n, H]: sequential, eh_proj(cat(enorm(e(tokens)), hnorm(previous))); parallel, the trunk."""
        previous = previous.reshape(-1, previous.shape[-1]).to(self.dtype).contiguous()
        if not self.sequential:
            return previous
        eps = self.config.rms_norm_eps
        emb = torch.nn.functional.embedding(tokens.reshape(-1), self.cores[index].embed)
        fused = torch.cat([kernels.rms_norm(emb, self.enorms[index], eps),
                           kernels.rms_norm(previous, self.hnorms[index], eps)], dim=1)
        return kernels.linear(fused, self.projections[index])

    def output(self, index: int, states: torch.Tensor) -> torch.Tensor:
        if not self.sequential:
            return states
        return kernels.rms_norm(states.contiguous(), self.norms[index], self.config.rms_norm_eps)

    def logits(self, index: int, out: torch.Tensor) -> torch.Tensor:
        eps = None if self.sequential else self.config.rms_norm_eps
        return kernels.linear(out.contiguous(), self.heads[index], norm_eps=eps)

    def new_cache(self, index: int, batch_size: int, capacity: int | None) -> "ModuleCache":
        return ModuleCache(self, index, batch_size, capacity)


def config_for_core(config: MtpConfig):
    import types

    return types.SimpleNamespace(rope_theta=config.rope_theta, max_position_embeddings=1 << 20,
                                 head_dim=config.head_dim, num_attention_heads=config.num_attention_heads,
                                 num_key_value_heads=config.num_key_value_heads, rms_norm_eps=config.rms_norm_eps)


class ModuleCache(NativeCache):
    """Module i's own KV cache: a NativeCache (ragged rows, one rollback primitive) whose block
    inputs are (token, previous hidden state) pairs; ``run`` returns the module's outputs [B, n, H]."""

    def __init__(self, runtime: MtpRuntime, index: int, batch_size: int, capacity: int | None = None):
        import types

        self.runtime, self.index = runtime, index
        super().__init__(types.SimpleNamespace(model=runtime.cores[index]), batch_size, capacity)
        self._previous = None

    def run(self, tokens: torch.Tensor, previous: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        self._previous = previous
        try:
            block = self.begin(tokens, valid, stop=1)
        finally:
            self._previous = None
        return self.runtime.output(self.index, block.states)

    def _inputs(self, tokens):
        return self.runtime.inputs(self.index, tokens, self._previous)


def attach(folder: str | Path, net: MtpNet) -> Path:
    """Add ``net``'s modules to a model folder (model.safetensors and config.json), atomically."""
    from safetensors.torch import load_file

    from specdec.models.files import save_folder

    folder = Path(folder)
    weights = load_file(folder / "model.safetensors")
    dtype = next(iter(weights.values())).dtype
    config = json.loads((folder / "config.json").read_text())
    config.update(net.config.config_entries())
    return save_folder(folder, config, "model.safetensors", {**weights, **net.tensors()}, dtype)
