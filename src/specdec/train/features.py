"""What every drafter trained on a frozen target's features shares: its data and its warning metric.

* Data: the target's own continuations of train-split prompts, generated with specdec itself in
  batches (half greedy, half sampled at temperature 1), cached on disk under a key naming the
  target's weights and the recipe. Held-out sequences are greedy continuations (128 tokens, as the
  benchmark generates) of code-completion prompts built from the validation split the way the
  benchmark's task set is built from the test split: there the target's greedy choice at every
  generated position is the next token, which is what the offline metric needs.
* Features are computed on the fly by the frozen target (transformers, float32) for each batch;
  nothing but token ids is stored.
* The offline metric: drafting as at inference (the drafter's own outputs fed back) from every
  generated position of the held-out sequences, the number of leading drafts equal to the target's
  greedy tokens gives per-position acceptance and a predicted tau = 1 + sum_j P(first j accepted),
  the acceptance length a chain of k drafts would get. It is reported at every evaluation.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec.train import data

LOW_TAU = 1.3  # a predicted tau below this after training means the drafter is nearly useless


@dataclass(frozen=True)
class DataRecipe:
    """The data fields every drafter trainer's config shares (mixed into its frozen dataclass)."""

    batch_size: int = 8
    train_sequences: int = 2048
    heldout_sequences: int = 48
    prefix_len: int = 64
    generated_len: int = 192
    generation_batch: int = 64
    seed: int = 0


TINY_DATA = dict(batch_size=2, train_sequences=8, heldout_sequences=4, prefix_len=8, generated_len=16,
                 generation_batch=8)


@dataclass(frozen=True)
class Sequences:
    tokens: torch.Tensor   # [N, T] long, padded with the pad id after ``lengths``
    lengths: torch.Tensor  # [N] tokens per sequence
    prompt_len: torch.Tensor  # [N] generated tokens start here

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [b, T], valid [b, T]) of rows."""
        tokens = self.tokens[rows]
        valid = torch.arange(tokens.shape[1])[None, :] < self.lengths[rows][:, None]
        return tokens, valid

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def continuations(target_dir: Path, prefixes: list[list[int]], new_tokens: int, temperatures: list[float],
                  batch_size: int, seed: int, log: Callable[[str], None]) -> Sequences:
    """Continue each prefix (token ids) by ``new_tokens`` of the target (specdec's own decoding, native
    backend where it runs), chunk c at temperature ``temperatures[c % len]``."""
    from specdec.decode import GenerationConfig, generate_ids
    from specdec.drafters import NoDraft
    from specdec.sampling import SamplingConfig
    from specdec.backends.target import load_target

    target = load_target(target_dir)
    rows, lengths = [], []
    total = len(prefixes)
    width = max(len(p) for p in prefixes) + new_tokens
    for chunk, start in enumerate(range(0, total, batch_size)):
        prompts = prefixes[start: start + batch_size]
        temperature = temperatures[chunk % len(temperatures)]
        config = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(temperature),
                                  seed=seed * 1000 + chunk)
        out = generate_ids(target, prompts, NoDraft(), config)
        for prompt, generated in zip(prompts, out.token_ids):
            row = prompt + generated
            lengths.append(len(row))
            rows.append(row + [target.pad_token_id] * (width - len(row)))
        log(f"[data] generated {min(start + batch_size, total)}/{total} continuations")
    return Sequences(torch.tensor(rows, dtype=torch.long), torch.tensor(lengths, dtype=torch.long),
                     torch.tensor([len(p) for p in prefixes], dtype=torch.long))


def cached_sequences(path: Path, make: Callable[[], Sequences]) -> Sequences:
    """``make()`` once, stored atomically at ``path``."""
    if path.is_file():
        state = torch.load(path, map_location="cpu")
        prompt_len = torch.as_tensor(state["prompt_len"]).expand(state["tokens"].shape[0])
        return Sequences(state["tokens"], state["lengths"], prompt_len)
    result = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".seq-", dir=path.parent)
    with os.fdopen(fd, "wb") as handle:
        torch.save({"tokens": result.tokens, "lengths": result.lengths, "prompt_len": result.prompt_len}, handle)
    os.replace(tmp, path)
    return result


def training_data(target_dir: Path, fingerprint: str, cache_dir: Path, *, train_sequences: int, heldout_sequences: int,
                  prefix_len: int, generated_len: int, generation_batch: int, seed: int,
                  log: Callable[[str], None]) -> tuple[Sequences, Sequences]:
    """(train, held-out) continuation sets of the target, cached in ``cache_dir``."""
    from specdec.train.target import corpus_streams

    train_stream, _ = corpus_streams(target_dir)
    key = f"{fingerprint}-{prefix_len}-{generated_len}-{seed}"
    generator = data.step_generator(seed, 0, salt=11)
    train_prefixes = data.sample_windows(train_stream, train_sequences, prefix_len, generator).tolist()
    train = cached_sequences(Path(cache_dir) / f"train-{key}-{train_sequences}.pt", lambda: continuations(
        target_dir, train_prefixes, generated_len, [0.0, 1.0], generation_batch, seed, log))
    return train, heldout_data(target_dir, fingerprint, cache_dir, heldout_sequences, generation_batch, seed, log)


HELDOUT_NEW_TOKENS = 128


def heldout_prompts(target_dir: Path, count: int) -> list[list[int]]:
    """Code-completion prompts (a definition's header, docstring and first lines) from the validation
    split, built as the benchmark's task set is built from the test split; token ids."""
    from specdec.zoo import corpus
    from specdec.zoo import tokenizer as zoo_tokenizer
    from specdec.zoo.tasks import code_completion_tasks

    root = corpus.stdlib_root()
    sources = [(p.relative_to(root).as_posix(), p.read_text(encoding="utf-8")) for p in corpus.list_split("validation")]
    tokenizer = zoo_tokenizer.load_tokenizer(target_dir)
    prompts = [tokenizer.encode(task["prompt"], add_special_tokens=False).ids for task in code_completion_tasks(sources)]
    return [p for p in prompts if p][:count]


def heldout_data(target_dir: Path, fingerprint: str, cache_dir: Path, count: int, generation_batch: int, seed: int,
                 log: Callable[[str], None]) -> Sequences:
    """Greedy continuations of the held-out prompts, cached in ``cache_dir``."""
    path = Path(cache_dir) / f"heldout-code-{fingerprint}-{count}-{HELDOUT_NEW_TOKENS}.pt"
    return cached_sequences(path, lambda: continuations(target_dir, heldout_prompts(target_dir, count),
                                                        HELDOUT_NEW_TOKENS, [0.0], generation_batch, seed + 1, log))


class FrozenTarget:
    """The target in transformers, float32, no gradients: features and logits of a batch."""

    def __init__(self, target_dir: Path):
        from specdec.train.distill import load_frozen_target

        self.model = load_frozen_target(target_dir)
        self.embed = self.model.get_input_embeddings().weight.detach()     # [V, H]
        self.head = self.model.get_output_embeddings().weight.detach()     # [V, H]
        self.num_layers = int(self.model.config.num_hidden_layers)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, valid: torch.Tensor, layers: tuple[int, ...]):
        """(features [B, T, len(layers) * H] concatenated in order, logits [B, T, V])."""
        out = self.model(input_ids=tokens, attention_mask=valid.long(), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        return features, out.logits.float()


def shifted(x: torch.Tensor, shift: int, length: int, fill=0) -> torch.Tensor:
    """x[:, shift: shift + length] padded with ``fill`` at the end to ``length`` columns."""
    part = x[:, shift: shift + length]
    if part.shape[1] < length:
        pad = x.new_full((x.shape[0], length - part.shape[1], *x.shape[2:]), fill)
        part = torch.cat([part, pad], dim=1)
    return part


def acceptance_summary(accepted: torch.Tensor, depth: int, walks=None) -> dict[str, float]:
    """From accepted drafts per anchor [A] (each 0..depth): per-position acceptance P(first j accepted);
    with ``walks`` ([(accepted per position [N], first anchor, length)] per sequence) the predicted tau
    of chains of k, from decoding each sequence as the loop does (``walk``)."""
    accepted = accepted.float()
    out = {}
    reach = [(accepted >= j).float().mean().item() for j in range(1, depth + 1)]  # P(first j all accepted)
    for j, value in enumerate(reach, 1):
        out[f"accept_{j}"] = value
    for k in range(1, depth + 1):
        if walks is None:
            out[f"tau_k{k}"] = 1.0 + sum(reach[:k])
        else:
            tokens, steps = map(sum, zip(*(walk(a, start, length, k) for a, start, length in walks)))
            out[f"tau_k{k}"] = tokens / max(steps, 1)
    out["anchors"] = float(accepted.numel())
    return out


def walk(accepted: torch.Tensor, start: int, length: int, k: int) -> tuple[int, int]:
    """(tokens, steps) of decoding one held-out sequence with chains of k, as the loop does.

    accepted[t]: leading drafts equal to the target's tokens when drafting from position t (the
    feature of t, the pending token t + 1). From the first anchor, each step commits
    min(accepted[t], k, what still fits) + 1 tokens and the next step starts after them. This, not the
    mean over all positions, is what a generation measures: a run of easy positions is crossed in a
    few long steps, so averaging per position would overweight it.
    """
    values = accepted.tolist()
    tokens = steps = 0
    t = start
    while t <= length - 2:
        got = min(values[t], k, length - 2 - t)
        tokens, steps, t = tokens + got + 1, steps + 1, t + got + 1
    return tokens, steps


def leading_matches(matches: torch.Tensor) -> torch.Tensor:
    """matches [..., depth] bool -> accepted count per anchor: the leading run of True."""
    return matches.long().cumprod(dim=-1).sum(dim=-1)


def anchor_mask(valid: torch.Tensor, prompt_len, pairs: int, depth: int) -> torch.Tensor:
    """[B, N] anchors t whose next ``depth`` target tokens exist and follow the target's greedy choices:
    t + 1 >= prompt_len (the token fed at t is generated) and t + depth < length (the target's logits
    at t + 1 .. t + depth, which score the drafts, are of real tokens)."""
    index = torch.arange(pairs)[None, :]
    lengths = valid.sum(1)[:, None]
    prompt_len = torch.as_tensor(prompt_len).reshape(-1, 1)
    return (index + 1 >= prompt_len) & (index + depth < lengths)


def drafter_training(name: str, config_path: str | None, preset: str):
    """(configuration, train function) of the drafter method ``name`` (medusa, eagle, eagle3, dflash):
    its preset, or a JSON file over it; EAGLE's version follows the name."""
    from dataclasses import replace

    from specdec.train import dflash, eagle, medusa

    module, train = {"medusa": (medusa, medusa.train_medusa), "dflash": (dflash, dflash.train_dflash)}.get(
        name, (eagle, eagle.train_eagle))
    config = module.load_config(config_path, preset)
    if module is eagle:
        config = replace(config, version=3 if name == "eagle3" else 1)
    return config, train


def warn_if_useless(metrics: dict[str, float], key: str, log: Callable[[str], None], what: str) -> bool:
    """Say loudly when the predicted tau shows the drafter barely helps; returns whether it did."""
    tau = metrics.get(key)
    if tau is not None and tau < LOW_TAU:
        log(f"WARNING: {what} predicts tau {tau:.2f} on held-out data (below {LOW_TAU}): it will accept almost "
            f"nothing against this target. Check the target, the feature layers and the data before serving it.")
        return True
    return False


@dataclass
class DrafterRun:
    """What every drafter trainer sets up before its loop: the run's folders, the target and the data."""

    config: object
    target: object
    train: Sequences
    held: Sequences
    ckpt_dir: Path
    data_seconds: float
    log: Callable[[str], None]

    def batch_fn(self, salt: int):
        """Batches of training sequences as a pure function of the step (resumable)."""
        def batch_for(step: int):
            generator = data.step_generator(self.config.seed, step, salt=salt)
            rows = torch.randint(0, self.train.tokens.shape[0], (self.config.batch_size,), generator=generator)
            return self.train.batch(rows)
        return batch_for


def prepare_run(kind: str, config, target_dir: Path, out_dir: Path, ckpt_dir: Path | None, resume: bool,
                config_from_dict: Callable, log: Callable[[str], None] | None) -> DrafterRun:
    """Resolve folders, take the configuration from the checkpoint on resume, load the target and make
    (or read) its continuation data."""
    import time

    from tqdm import tqdm

    from specdec.backends.target import load_target
    from specdec.train.loop import load_latest_checkpoint

    log = log or (lambda message: tqdm.write(message))
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else Path(out_dir) / "checkpoints"
    if resume:
        config = config_from_dict(load_latest_checkpoint(ckpt_dir)["run_config"][kind])
    target = load_target(target_dir)
    started = time.monotonic()
    train, held = training_data(Path(target_dir), target.fingerprint(), ckpt_dir,
                                train_sequences=config.train_sequences, heldout_sequences=config.heldout_sequences,
                                prefix_len=config.prefix_len, generated_len=config.generated_len,
                                generation_batch=config.generation_batch, seed=config.seed, log=log)
    return DrafterRun(config, target, train, held, ckpt_dir, time.monotonic() - started, log)
