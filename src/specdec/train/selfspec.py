"""Train a target to draft for itself: LayerSkip (layer dropout + early-exit loss) and MTP modules.

Both continue training the zoo target (all its weights move) on the corpus windows it was
pre-trained on, with the shared loop (progress bar, atomic checkpoints, bit-identical ``--resume``,
``--max-minutes``), and export a variant folder: the model (an ordinary Llama checkpoint) plus what
the method adds.

LayerSkip (specdec's choices, recorded in the summary):
* layer dropout p_l = p_max * (2^{l/(L-1)} - 1): 0 at the first layer, p_max at the last, a
  Bernoulli draw per sequence and layer; no time schedule (S(t) = 1, continual training);
* early-exit loss: the final layer's cross-entropy, plus ``exit_weight`` times a mean of the early
  exits' cross-entropies (each exit: the shared final norm and LM head), exit l weighted by l
  (deeper exits count more: they are the ones that draft);
* curriculum ``gradual``: exit l joins once step / steps >= 0.5 (L - l) / L, deep exits first, all
  of them by half of training. Why: every exit starts far from the final layer (an untrained exit
  at layer 1 has a loss several nats above it); bringing them in from the top lets the model adapt
  its upper layers before the shallow exits pull on the early ones, and the final layer's loss is
  what must not degrade. ``rotational`` (one early exit per step, in turn) is the alternative.

MTP: the main next-token loss plus ``mtp_weight`` times the mean of the modules' (heads')
cross-entropies (DeepSeek-V3 uses 0.3, then 0.1). Sequential module k is fed the true next
tokens (teacher forcing), as in DeepSeek-V3's training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.train import data
from specdec.train.config import TrainConfigError
from specdec.train.loop import OptimConfig, optim_from_dict, run_folders, run_loop

METHODS = ("layerskip", "mtp")
CURRICULA = ("gradual", "rotational", "none")


@dataclass(frozen=True)
class SelfSpecConfig:
    """Everything that determines a LayerSkip or MTP run (stored in checkpoints)."""

    method: str = "layerskip"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(
        steps=500, lr=5e-4, warmup_steps=25, eval_every=100, ckpt_every_steps=50, weight_decay=0.1))
    seq_len: int = 512
    batch_size: int = 4
    eval_windows: int = 32
    seed: int = 0
    # LayerSkip
    dropout_max: float = 0.1
    exit_weight: float = 1.0
    curriculum: str = "gradual"
    # MTP
    design: str = "sequential"
    depth: int = 3
    mtp_weight: float = 0.3

    def __post_init__(self):
        if self.method not in METHODS:
            raise TrainConfigError(f"unknown method {self.method!r}; expected one of {', '.join(METHODS)}")
        if self.curriculum not in CURRICULA:
            raise TrainConfigError(f"unknown curriculum {self.curriculum!r}; expected one of {', '.join(CURRICULA)}")
        from specdec.models.mtp import DESIGNS
        if self.design not in DESIGNS:
            raise TrainConfigError(f"--design must be one of {', '.join(DESIGNS)}, got {self.design!r}")
        if self.depth < 1:
            raise TrainConfigError(f"--depth must be >= 1, got {self.depth}")
        if not 0 <= self.dropout_max < 1:
            raise TrainConfigError(f"dropout_max must be in [0, 1), got {self.dropout_max}")


TINY = dict(optim=OptimConfig(steps=12, lr=5e-4, warmup_steps=2, eval_every=6, ckpt_every_steps=6),
            seq_len=32, batch_size=2, eval_windows=4)
PRESETS: dict[str, SelfSpecConfig] = {
    "layerskip": SelfSpecConfig(),
    "mtp": SelfSpecConfig(method="mtp"),
    "tiny": SelfSpecConfig(**TINY),
}


def config_from_dict(values: dict[str, Any]) -> SelfSpecConfig:
    values = dict(values)
    try:
        optim = optim_from_dict({**asdict(SelfSpecConfig().optim), **values.pop("optim", {})})
        return SelfSpecConfig(optim=optim, **values)
    except TypeError as exc:
        raise TrainConfigError(f"invalid self-speculation configuration: {exc}") from None


def load_config(path: str | None, preset: str) -> SelfSpecConfig:
    if preset not in PRESETS:
        raise TrainConfigError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    values = asdict(PRESETS[preset])
    if path is not None:
        try:
            override = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise TrainConfigError(f"cannot read config {path}: {exc}") from None
        values["optim"] = {**values["optim"], **override.pop("optim", {})}
        values.update(override)
    return config_from_dict(values)


# ---------------------------------------------------------------------------------------------
# The model being trained.

def dropout_rates(layers: int, p_max: float) -> list[float]:
    """p_l = p_max (2^{l/(L-1)} - 1) for l = 0 .. L-1."""
    if layers == 1:
        return [0.0]
    return [p_max * (2 ** (l / (layers - 1)) - 1) for l in range(layers)]


def enabled_exits(config: SelfSpecConfig, layers: int, step: int) -> list[int]:
    """The early exits (1-based layer counts, 1 .. L-1) whose loss counts at ``step``."""
    exits = list(range(1, layers))
    if config.curriculum == "gradual":
        progress = step / max(1, config.optim.steps)
        return [l for l in exits if progress >= 0.5 * (layers - l) / layers]
    if config.curriculum == "rotational":
        return [exits[step % len(exits)]] if exits else []
    return exits


class SelfSpecModel(nn.Module):
    """The main model (transformers Llama, trainable) and, for MTP, its modules."""

    def __init__(self, main, mtp=None):
        super().__init__()
        self.main = main
        self.mtp = mtp

    def layer_states(self, tokens: torch.Tensor, drop: list[float] | None = None,
                     generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """[h_0 (embedding), h_1 .. h_L] residual streams [B, T, H]; ``drop``: per-layer dropout rates."""
        model = self.main.model
        h = model.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
        rope = model.rotary_emb(h, positions)
        states = [h]
        for index, layer in enumerate(model.layers):
            out = layer(h, position_embeddings=rope, position_ids=positions)
            if drop is not None and drop[index] > 0:
                keep = torch.rand(tokens.shape[0], generator=generator) >= drop[index]  # [B]
                out = torch.where(keep[:, None, None], out, h)
            h = out
            states.append(h)
        return states

    def exit_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Logits through the shared final norm and head [B, T, V]."""
        return self.main.lm_head(self.main.model.norm(state))

    def mtp_outputs(self, tokens: torch.Tensor, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per module k (1-based): its normed output at every index i [B, T, H], predicting i + k + 1."""
        config = self.mtp.config
        batch, length = tokens.shape
        positions = torch.arange(length)[None].expand(batch, -1)
        outputs = []
        if config.design == "parallel":
            for head in self.mtp.modules_:
                outputs.append(head(states[-2], positions))
            return outputs
        embed = self.main.model.embed_tokens
        previous = self.main.model.norm(states[-1])
        for k, module in enumerate(self.mtp.modules_, 1):
            following = torch.cat([tokens[:, k:], tokens.new_zeros(batch, k)], dim=1)  # token i + k
            previous = module(embed(following), previous, positions + k)
            outputs.append(previous)
        return outputs


def shifted_ce(logits: torch.Tensor, tokens: torch.Tensor, ahead: int, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits [B, T, V] at i against tokens [B, T] at i + ahead (the last ``ahead``
    columns have no label)."""
    length = tokens.shape[1] - ahead
    part = logits[:, :length].float()
    return F.cross_entropy(part.reshape(-1, part.shape[-1]), tokens[:, ahead:].reshape(-1), reduction=reduction)


def objective(config: SelfSpecConfig, model: SelfSpecModel):
    """loss_fn(model, (step, tokens)) of the shared loop."""
    layers = model.main.config.num_hidden_layers
    rates = dropout_rates(layers, config.dropout_max)

    def loss_fn(net: SelfSpecModel, batch) -> torch.Tensor:
        step, tokens = batch
        if config.method == "layerskip":
            generator = data.step_generator(config.seed, step, salt=23)
            states = net.layer_states(tokens, rates, generator)
            loss = shifted_ce(net.exit_logits(states[-1]), tokens, 1)
            exits = enabled_exits(config, layers, step)
            if exits and config.exit_weight > 0:
                weights = torch.tensor(exits, dtype=torch.float32)
                weights = weights / weights.sum()
                early = sum(w * shifted_ce(net.exit_logits(states[l]), tokens, 1) for w, l in zip(weights.tolist(), exits))
                loss = loss + config.exit_weight * early
            return loss
        states = net.layer_states(tokens)
        loss = shifted_ce(net.exit_logits(states[-1]), tokens, 1)
        outs = net.mtp_outputs(tokens, states)
        extra = sum(shifted_ce(net.main.lm_head(out), tokens, k + 1) for k, out in enumerate(outs, 1)) / len(outs)
        return loss + config.mtp_weight * extra

    return loss_fn


@torch.no_grad()
def evaluate(model: SelfSpecModel, windows: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    """Validation metrics: the final layer's loss; per early exit its loss and how often its greedy
    token equals the final layer's (``exit{l}_loss``, ``exit{l}_agree``); per MTP module its loss and
    top-1 accuracy on the true token (``mtp{k}_loss``, ``mtp{k}_acc``)."""
    model.eval()
    layers = model.main.config.num_hidden_layers
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(key: str, value: float, count: int) -> None:
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + count

    for start in range(0, windows.shape[0], batch_size):
        tokens = windows[start: start + batch_size]
        states = model.layer_states(tokens)
        final = model.exit_logits(states[-1])
        n = tokens[:, 1:].numel()
        add("val_loss", float(shifted_ce(final, tokens, 1, "sum")), n)
        top = final.argmax(-1)
        if model.mtp is None:
            for l in range(1, layers):
                logits = model.exit_logits(states[l])
                add(f"exit{l}_loss", float(shifted_ce(logits, tokens, 1, "sum")), n)
                add(f"exit{l}_agree", float((logits.argmax(-1) == top).sum()), top.numel())
        else:
            for k, out in enumerate(model.mtp_outputs(tokens, states), 1):
                logits = model.main.lm_head(out)
                m = tokens[:, k + 1:].numel()
                add(f"mtp{k}_loss", float(shifted_ce(logits, tokens, k + 1, "sum")), m)
                add(f"mtp{k}_acc", float((logits[:, :-(k + 1)].argmax(-1) == tokens[:, k + 1:]).sum()), m)
    return {key: sums[key] / max(counts[key], 1) for key in sums}


# ---------------------------------------------------------------------------------------------
# The run.

def load_main(target_dir: Path):
    """The target as a trainable float32 transformers Llama."""
    from transformers import AutoModelForCausalLM

    from specdec.backends import hf

    hf.check_model_dir(target_dir)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32, local_files_only=True)
    if getattr(model.config, "model_type", "") != "llama":
        raise SpecdecError(f"self-speculation training continues a Llama target, {target_dir} is "
                           f"{model.config.model_type!r}")
    return model


def train_selfspec(config: SelfSpecConfig, target_dir: Path, out_dir: Path, *, ckpt_dir: Path | None = None,
                   resume: bool = False, max_minutes: float | None = None,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Continue ``target_dir`` with LayerSkip or MTP training; export the variant to ``out_dir``."""
    from tqdm import tqdm

    from specdec.models.mtp import MtpConfig, MtpNet
    from specdec.train.target import corpus_streams, round_to_export_dtype_

    log = log or (lambda message: tqdm.write(message))
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    ckpt_dir, config = run_folders(out_dir, ckpt_dir, resume, "selfspec", config, config_from_dict)
    main = load_main(target_dir)
    mtp = None
    if config.method == "mtp":
        mtp = MtpNet(MtpConfig.of(main.config, config.design, config.depth))
        mtp.init_from_main(main)
    model = SelfSpecModel(main, mtp)
    train_stream, val_stream = corpus_streams(target_dir)
    val = data.eval_windows(val_stream, config.seq_len, limit=config.eval_windows)  # [n, T]
    baseline = evaluate(SelfSpecModel(load_main(target_dir), None), val)
    log(f"[{config.method}] the original model: " + " ".join(f"{k} {v:.4f}" for k, v in baseline.items()))

    def batch_for(step: int):
        generator = data.step_generator(config.seed, step, salt=17)
        return step, data.sample_windows(train_stream, config.batch_size, config.seq_len, generator)

    fingerprint = weights_fingerprint(main)
    run_config = {"kind": "selfspec", "selfspec": asdict(config), "target": fingerprint}
    result = run_loop(model=model, config=config.optim, batch_fn=batch_for, loss_fn=objective(config, model),
                      tokens_in=lambda batch: batch[1].numel(), eval_fn=lambda m: evaluate(m, val),
                      ckpt_dir=ckpt_dir, run_config=run_config, resume=resume, max_minutes=max_minutes,
                      desc=config.method if config.method == "layerskip" else f"mtp-{config.design}", log=log)
    round_to_export_dtype_(model)
    final = evaluate(model, val)
    summary = {
        "kind": config.method,
        **result.summary_fields(),
        "validation": {k: round(v, 4) for k, v in final.items()},
        "original_validation": {k: round(v, 4) for k, v in baseline.items()},
        "validation_tokens": int(val[:, 1:].numel()),
        "started_from": str(target_dir),
        "config": asdict(config),
    }
    if config.method == "layerskip":
        summary["choices"] = {"dropout": "p_max * (2^(l/(L-1)) - 1), per sequence, no time schedule",
                              "exit_loss": "final CE + exit_weight * sum over enabled exits of l/sum(l) * CE_l",
                              "curriculum": config.curriculum}
    export_variant(model, target_dir, out_dir, summary, config)
    warn_if_weak(final, log)
    return summary


def weights_fingerprint(main) -> str:
    from specdec.backends.target import weights_fingerprint as fingerprint

    return fingerprint(main.get_input_embeddings().weight, main.get_output_embeddings().weight)


def warn_if_weak(metrics: dict[str, float], log: Callable[[str], None]) -> bool:
    """Say loudly when no early exit agrees with the final layer, or the first MTP module predicts its
    token, often enough to draft; returns whether it did."""
    agreements = [v for k, v in metrics.items() if k.endswith("_agree")]
    if agreements and max(agreements) < 0.3:
        log(f"WARNING: the best early exit agrees with the final layer on {max(agreements):.0%} of tokens: "
            f"early-exit drafting will accept almost nothing. Train longer or raise exit_weight.")
        return True
    first = metrics.get("mtp1_acc")
    if first is not None and first < 0.1:
        log(f"WARNING: the first MTP module predicts {first:.0%} of its tokens on validation data: its drafts "
            f"will be accepted almost never. Train longer or raise mtp_weight.")
        return True
    return False


def export_variant(model: SelfSpecModel, target_dir: Path, out_dir: Path, summary: dict, config: SelfSpecConfig,
                   dtype: torch.dtype = torch.bfloat16) -> None:
    """The variant folder: the main model as transformers saves it, its MTP tensors beside its own in
    model.safetensors, the records in config.json; written atomically with the tokenizer files."""
    from specdec.models.files import save_folder

    main = model.main
    tensors = dict(main.state_dict())
    if main.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    entries: dict[str, Any] = {}
    if model.mtp is not None:
        tensors.update(model.mtp.tensors())
        entries.update(model.mtp.config.config_entries())
    else:
        entries["specdec_layerskip"] = {"exit_layer": default_exit(summary["validation"], main.config.num_hidden_layers),
                                        "chosen_by": "predicted from validation agreement (train.selfspec.default_exit); "
                                                     "measure with specdec bench --exit-layers"}
    config_json = main.config.to_dict()
    config_json["dtype"] = str(dtype).removeprefix("torch.")
    config_json.update(entries)
    extra = {"training_summary.json": json.dumps(summary, indent=2) + "\n"}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        source = Path(target_dir) / name
        if source.is_file():
            extra[name] = source.read_text()
    save_folder(out_dir, config_json, "model.safetensors", tensors, dtype, extra)


def default_exit(metrics: dict[str, float], layers: int, k: int = 4, fixed: float = 0.5) -> int:
    """The exit layer with the most expected tokens per unit of time, from validation agreement: a chain
    of k drafts with per-draft agreement a commits 1 + a + .. + a^k tokens per step, and costs k drafts
    of (fixed + (1 - fixed) E / L) full passes plus one verification. ``fixed``: the share of a pass that
    does not shrink with fewer layers (call overhead, the head); about half on the zoo target here,
    where the measured fastest exit (`specdec bench --exit-layers ...`) is the one this predicts."""
    best, value = max(1, layers // 2), -1.0
    for l in range(1, layers):
        a = metrics.get(f"exit{l}_agree")
        if a is None:
            continue
        score = sum(a ** j for j in range(k + 1)) / (k * (fixed + (1 - fixed) * l / layers) + 1)
        if score > value:
            best, value = l, score
    return best
