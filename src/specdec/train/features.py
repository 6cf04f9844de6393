"""What every drafter trained on a frozen target's features shares: its data and its warning metric.

* Data: the target's own continuations of train-split prompts, generated with specdec itself in
  batches (half greedy, half sampled at temperature 1), cached on disk under a key naming the
  target's weights and the recipe. Held-out sequences are greedy continuations (128 tokens, as the
  benchmark generates) of code-completion prompts built from the validation split the way the
  benchmark's task set is built from the test split: there the target's greedy choice at every
  generated position is the next token, which is what the offline metric needs.
* Real targets (any target whose tokenizer is not the zoo's) train on ShareGPT's train split instead
  (``source``): ``sharegpt`` takes whole conversations, chat-templated, with the target's own
  distributions as labels (as EAGLE trains); ``sharegpt-self`` takes their first user turns and the
  target's own responses (greedy and sampled, as Medusa-2 and DFlash recommend). Held-out sequences
  are greedy continuations of first user turns of ShareGPT's held-out split.
* Features: the zoo's are computed on the fly by the frozen target (transformers, float32) for each
  batch. A real target's are computed once per data set by a batched bfloat16 forward pass and kept
  on disk (``FeatureCache``: the chosen layers and the final normed state, from which logits are
  one product with the head), in chunks written as they are done, so a killed run resumes.
* The offline metric: drafting as at inference (the drafter's own outputs fed back) from every
  generated position of the held-out sequences, the number of leading drafts equal to the target's
  greedy tokens gives per-position acceptance and a predicted tau = 1 + sum_j P(first j accepted),
  the acceptance length a chain of k drafts would get. It is reported at every evaluation.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from specdec.train import data

LOW_TAU = 1.3  # a predicted tau below this after training means the drafter is nearly useless
MODEST_TAU = 2.0  # below this it helps little: trained drafters of every method reach 3 or more in published results


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
    source: str = "auto"    # auto (the zoo's corpus for zoo targets, else sharegpt), corpus, sharegpt, sharegpt-self,
    #                         sharegpt-answers
    code_requests: int = 0  # chat targets: the target's answers to this many requests to complete a function
    #                         (HumanEval's form, from the standard library's train split), added to the train set


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
                  batch_size: int, seed: int, log: Callable[[str], None],
                  dtype: torch.dtype = torch.float32, parts: Path | None = None,
                  earlier: "Sequences | None" = None) -> Sequences:
    """Continue each prefix (token ids) by ``new_tokens`` of the target (specdec's own decoding, native
    backend where it runs, in ``dtype``), chunk c at temperature ``temperatures[c % len]``.

    parts: a folder where each chunk is kept as it is done (a killed run resumes from the chunks there).
    earlier: continuations made before of the first prefixes (a smaller set of the same recipe): its rows
    serve as they are, as long as their prompts are these prefixes, and generation goes on from there."""
    from specdec.backends.target import load_target

    total = len(prefixes)
    width = max(len(p) for p in prefixes) + new_tokens
    rows = reusable_rows(earlier, prefixes, batch_size)
    if rows:
        log(f"[data] {len(rows)} of {total} continuations come from the set made before")
    target = load_target(target_dir, dtype=dtype)
    for chunk, start in enumerate(range(0, total, batch_size)):
        if start < len(rows):
            continue
        prompts = prefixes[start: start + batch_size]
        part = None if parts is None else Path(parts) / f"chunk-{chunk:05d}.pt"
        if part is not None and part.is_file():
            kept = torch.load(part)
            if kept["prompts"] == prompts:  # done before the run was stopped
                rows.extend(kept["rows"])
                continue
        made = generate_chunk(target, prompts, new_tokens, temperatures[chunk % len(temperatures)], seed * 1000 + chunk)
        if part is not None:
            save_atomic(part, {"prompts": prompts, "rows": made})
        rows.extend(made)
        log(f"[data] generated {min(start + batch_size, total)}/{total} continuations")
    pad = target.pad_token_id
    return Sequences(torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=torch.long),
                     torch.tensor([len(row) for row in rows], dtype=torch.long),
                     torch.tensor([len(p) for p in prefixes], dtype=torch.long))


def generate_chunk(target, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int) -> list[list[int]]:
    """Each prompt followed by its continuation, one batch of specdec's own decoding."""
    from specdec.decode import GenerationConfig
    from specdec.drafters import NoDraft
    from specdec.engine import generate_ids
    from specdec.sampling import SamplingConfig

    config = GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(temperature), seed=seed)
    out = generate_ids(target, prompts, NoDraft(), config)
    return [prompt + generated for prompt, generated in zip(prompts, out.token_ids)]


def reusable_rows(earlier: "Sequences | None", prefixes: list[list[int]], batch_size: int) -> list[list[int]]:
    """The rows of ``earlier`` that continue the first prefixes, in whole chunks of ``batch_size``
    (so the chunks after them keep their numbering, seeds and temperatures); none when a prompt differs."""
    if earlier is None:
        return []
    count = min(earlier.tokens.shape[0], len(prefixes)) // batch_size * batch_size
    rows = []
    for row in range(count):
        prompt_len = int(earlier.prompt_len[row])
        if earlier.tokens[row, :prompt_len].tolist() != prefixes[row]:
            return []
        rows.append(earlier.tokens[row, :int(earlier.lengths[row])].tolist())
    return rows


def save_atomic(path: Path, value) -> None:
    """torch.save to ``path`` through a temporary file in its folder, renamed at the end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "wb") as handle:
        torch.save(value, handle)
    os.replace(tmp, path)


def padded(rows: list[list[int]], prompt_len: list[int], pad: int) -> Sequences:
    width = max(len(row) for row in rows)
    return Sequences(torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=torch.long),
                     torch.tensor([len(row) for row in rows], dtype=torch.long),
                     torch.tensor(prompt_len, dtype=torch.long))


def parts_folder(path: Path) -> Path:
    """Where the chunks of the set stored at ``path`` wait while it is made."""
    return path.with_name(f".{path.stem}.parts")


def largest_earlier(root: Path, prefix: str, count: int) -> Sequences | None:
    """The largest set of fewer than ``count`` sequences stored as ``<prefix><n>.pt`` in ``root`` (a set
    made before with the same recipe, whose prompts are the first of these), or None."""
    sizes = []
    for path in root.glob(f"{prefix}*.pt"):
        tail = path.stem[len(prefix):]
        if tail.isdigit() and int(tail) < count:
            sizes.append((int(tail), path))
    if not sizes:
        return None
    return load_sequences(max(sizes)[1])


def load_sequences(path: Path) -> Sequences:
    """A set stored by ``cached_sequences``."""
    state = torch.load(path, map_location="cpu")
    prompt_len = torch.as_tensor(state["prompt_len"]).expand(state["tokens"].shape[0])
    return Sequences(state["tokens"], state["lengths"], prompt_len)


def cached_sequences(path: Path, make: Callable[[], Sequences]) -> Sequences:
    """``make()`` once, stored atomically at ``path``."""
    if path.is_file():
        return load_sequences(path)
    result = make()
    save_atomic(path, {"tokens": result.tokens, "lengths": result.lengths, "prompt_len": result.prompt_len})
    return result


SOURCES = ("auto", "corpus", "sharegpt", "sharegpt-self", "sharegpt-answers")
# The temperatures of a self-generated set's chunks, in turn (chunk c at ``[c % len]``).
ANSWER_TEMPERATURES = {"sharegpt-self": [0.0, 1.0], "sharegpt-answers": [0.0]}


def data_source(source: str, tokenizer) -> str:
    """The data a target trains on: ``auto`` is the zoo's corpus for a target with the zoo's tokenizer
    (its special tokens), ShareGPT text for every other."""
    if source not in SOURCES:
        raise data.DataError(f"unknown data source {source!r}; expected one of {', '.join(SOURCES)}")
    if source != "auto":
        return source
    from specdec.zoo.tokenizer import SPECIAL_TOKENS

    zoo = tokenizer is not None and all(token in tokenizer.get_vocab() for token in SPECIAL_TOKENS)
    return "corpus" if zoo else "sharegpt"


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def opening_prompt_ids(tokenizer, split: str, count: int, max_len: int, seed: int) -> list[list[int]]:
    """Chat-templated first user turns of ShareGPT's ``split`` of at most ``max_len`` tokens, ``count``
    of them in an order fixed by ``seed``."""
    from specdec.zoo.datasets import opening_prompts, sharegpt_conversations

    return templated(tokenizer, opening_prompts(sharegpt_conversations(split)), count, max_len, seed, salt=13)


def templated(tokenizer, records: list[dict], count: int, max_len: int, seed: int, salt: int) -> list[list[int]]:
    """Chat-templated ``messages`` of the first ``count`` records of at most ``max_len`` tokens, in an order
    fixed by ``seed`` and ``salt`` (fewer where fewer fit)."""
    order = torch.randperm(len(records), generator=data.step_generator(seed, 0, salt=salt)).tolist()
    chosen = []
    for index in order:
        ids = chat_ids(tokenizer, records[index]["messages"], True)
        if len(ids) <= max_len:
            chosen.append(ids)
            if len(chosen) == count:
                break
    return chosen


def code_request_ids(tokenizer, count: int, max_len: int, seed: int) -> list[list[int]]:
    """Chat-templated requests to complete a function of the standard library's train split
    (``specdec.zoo.tasks.function_requests``) of at most ``max_len`` tokens, ``count`` of them in an order
    fixed by ``seed``."""
    from specdec.zoo import corpus
    from specdec.zoo.tasks import function_requests

    root = corpus.stdlib_root()
    requests = function_requests([(path.relative_to(root).as_posix(), path.read_text(encoding="utf-8"))
                                  for path in corpus.list_split("train")])
    chosen = templated(tokenizer, requests, count, max_len, seed, salt=19)
    if len(chosen) == count:
        return chosen
    raise data.DataError(f"the standard library's train split holds {len(chosen)} requests to complete a function "
                         f"of at most {max_len} tokens, fewer than the {count} code_requests asked for")


def sharegpt_text(tokenizer, count: int, max_len: int, seed: int, pad: int) -> Sequences:
    """``count`` train conversations that open with a user turn, whole and chat-templated, cut at
    ``max_len`` tokens; generated tokens (the answers) start after the first user turn."""
    from specdec.zoo.datasets import sharegpt_conversations

    conversations = [c["messages"] for c in sharegpt_conversations("train")
                     if c["messages"][0]["role"] == "user" and len(c["messages"]) >= 2]
    order = torch.randperm(len(conversations), generator=data.step_generator(seed, 0, salt=17)).tolist()
    rows, starts = [], []
    for index in order:
        messages = conversations[index]
        start = len(chat_ids(tokenizer, messages[:1], True))
        if start + 16 > max_len:
            continue
        rows.append(chat_ids(tokenizer, messages, False)[:max_len])
        starts.append(start)
        if len(rows) == count:
            break
    if not rows:
        raise data.DataError(f"no train conversation opens with a user turn short enough for {max_len} tokens "
                             "with 16 answer tokens after it: raise prefix_len + generated_len")
    return padded(rows, starts, pad)


def training_data(target_dir: Path, fingerprint: str, cache_dir: Path, *, train_sequences: int, heldout_sequences: int,
                  prefix_len: int, generated_len: int, generation_batch: int, seed: int,
                  log: Callable[[str], None], source: str = "auto",
                  code_requests: int = 0) -> tuple[Sequences, Sequences]:
    """(train, held-out) sequences of the target, cached in ``cache_dir``."""
    from specdec.backends.hf import load_tokenizer
    from specdec.train.target import corpus_streams

    tokenizer = load_tokenizer(target_dir)
    source = data_source(source, tokenizer)
    if source != "corpus":
        return chat_training_data(target_dir, tokenizer, fingerprint, cache_dir, source, train_sequences,
                                  heldout_sequences, prefix_len, generated_len, generation_batch, seed, log,
                                  code_requests)
    if code_requests:
        raise data.DataError("code_requests are requests to a chat target; the zoo's corpus source takes none")
    train_stream, _ = corpus_streams(target_dir)
    key = f"{fingerprint}-{prefix_len}-{generated_len}-{seed}"
    generator = data.step_generator(seed, 0, salt=11)
    train_prefixes = data.sample_windows(train_stream, train_sequences, prefix_len, generator).tolist()
    train = cached_sequences(Path(cache_dir) / f"train-{key}-{train_sequences}.pt", lambda: continuations(
        target_dir, train_prefixes, generated_len, [0.0, 1.0], generation_batch, seed, log))
    return train, heldout_data(target_dir, fingerprint, cache_dir, heldout_sequences, generation_batch, seed, log)


HELDOUT_NEW_TOKENS = 128


def chat_pad(target_dir: Path, tokenizer) -> int:
    """The pad id of a chat target's sequences: its config's pad token, else the tokenizer's EOS."""
    from specdec.backends.hf import load_config

    pad = load_config(target_dir).pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


def chat_training_data(target_dir: Path, tokenizer, fingerprint: str, cache_dir: Path, source: str, count: int,
                       heldout: int, prefix_len: int, generated_len: int, generation_batch: int, seed: int,
                       log: Callable[[str], None], code_requests: int = 0) -> tuple[Sequences, Sequences]:
    """ShareGPT's train split (``source``: its text; the target's answers to its first user turns, greedy and
    sampled or greedy only), then the target's answers to ``code_requests`` requests to complete a function,
    and greedy continuations of held-out first user turns."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise data.DataError(f"training on ShareGPT needs a tokenizer with a chat template; {target_dir} has none")

    pad = chat_pad(target_dir, tokenizer)
    key = f"{fingerprint}-{prefix_len}-{generated_len}-{seed}"
    root = Path(cache_dir)
    temperatures = ANSWER_TEMPERATURES.get(source, ANSWER_TEMPERATURES["sharegpt-self"])

    def answers(name: str, prompts: Callable[[], list[list[int]]], size: int, earlier=None) -> Sequences:
        """The target's answers to ``prompts()`` (made only when not cached); ``earlier(prompts)``: a set made
        before that answers the first of them."""
        path = root / f"train-{name}-{key}-{size}.pt"

        def make() -> Sequences:
            asked = prompts()
            return continuations(target_dir, asked, generated_len, temperatures, generation_batch, seed, log,
                                 dtype=torch.bfloat16, parts=parts_folder(path),
                                 earlier=(earlier(asked) if earlier else None)
                                 or largest_earlier(root, f"train-{name}-{key}-", size))

        made = cached_sequences(path, make)
        shutil.rmtree(parts_folder(path), ignore_errors=True)
        return made

    def openings() -> list[list[int]]:
        return opening_prompt_ids(tokenizer, "train", count, prefix_len, seed)

    if source == "sharegpt":
        train = cached_sequences(root / f"train-sharegpt-{key}-{count}.pt", lambda: sharegpt_text(
            tokenizer, count, prefix_len + generated_len, seed, pad))
    elif source == "sharegpt-answers":
        train = answers(source, openings, count, lambda asked: datastore_answers(target_dir, asked, prefix_len,
                                                                                  generated_len, seed, pad))
    else:
        train = answers(source, openings, count)
    if code_requests:
        code = answers(f"code-{source}", lambda: code_request_ids(tokenizer, code_requests, prefix_len, seed),
                       code_requests)
        train = joined(train, code, pad)
    held = cached_sequences(root / f"heldout-sharegpt-{fingerprint}-{prefix_len}-{heldout}-{HELDOUT_NEW_TOKENS}.pt",
                            lambda: continuations(target_dir, opening_prompt_ids(tokenizer, "heldout", heldout,
                                                                                prefix_len, seed + 1),
                                                  HELDOUT_NEW_TOKENS, [0.0], generation_batch, seed + 1, log))
    log(f"[data] {source}{f' + {code_requests} code requests' if code_requests else ''}: {train.tokens.shape[0]} "
        f"train sequences ({train.num_tokens:,} tokens), {held.tokens.shape[0]} held-out ({held.num_tokens:,} tokens)")
    return train, held


def datastore_answers(target_dir: Path, prompts: list[list[int]], prefix_len: int, generated_len: int, seed: int,
                      pad: int) -> Sequences | None:
    """The retrieval datastore's ``answers`` (the target's greedy answers to ShareGPT's first train turns,
    committed for smollm2-135m) as a set made before, where they answer these prompts under this recipe (the
    rows whose prompts differ are generated, ``reusable_rows``); None where no copy exists (nothing generated)."""
    from specdec.zoo.datastores import ANSWERS, target_answers

    if (prefix_len, generated_len, seed) != (ANSWERS["prompt_len"], ANSWERS["new_tokens"], 0):
        return None
    rows = target_answers(target_dir, progress=False, generate=False)
    if not rows:
        return None
    rows = rows[:len(prompts)]
    return padded(rows, [len(prompt) for prompt in prompts[:len(rows)]], pad)


def joined(first: Sequences, second: Sequences, pad: int) -> Sequences:
    """One set of the rows of both."""
    width = max(first.tokens.shape[1], second.tokens.shape[1])

    def wide(tokens: torch.Tensor) -> torch.Tensor:
        return F.pad(tokens, (0, width - tokens.shape[1]), value=pad)

    return Sequences(torch.cat([wide(first.tokens), wide(second.tokens)]), torch.cat([first.lengths, second.lengths]),
                     torch.cat([first.prompt_len, second.prompt_len]))


def draft_vocabulary(sequences: Sequences, size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """(the ``size`` most frequent target ids of the training tokens, sorted; the share of the training
    tokens among them): EAGLE-3's draft vocabulary, and draft_vocab.json's."""
    counts = token_counts(sequences, vocab)
    ids = counts.topk(size).indices.sort().values
    return ids, share_of(counts, ids)


def token_counts(sequences: Sequences, vocab: int) -> torch.Tensor:
    tokens, valid = sequences.tokens, torch.arange(sequences.tokens.shape[1])[None] < sequences.lengths[:, None]
    return torch.bincount(tokens[valid], minlength=vocab)


def share_of(counts: torch.Tensor, ids: torch.Tensor) -> float:
    return float(counts[ids].sum()) / max(1, int(counts.sum()))


def vocabulary_coverage(sequences: Sequences, ids: torch.Tensor, vocab: int) -> float:
    """The share of the sequences' tokens among ``ids``."""
    return share_of(token_counts(sequences, vocab), ids)


def draft_vocab_text(ids: torch.Tensor, coverage: float, counted_tokens: int, source: str) -> str:
    """draft_vocab.json's text: the ids, their number, the share of the counted tokens they cover, and
    where those tokens came from."""
    import json

    return json.dumps({"ids": ids.tolist(), "size": int(ids.numel()), "coverage": round(coverage, 4),
                       "counted_tokens": counted_tokens, "source": source})


def head_vocabulary(init_from: str, size: int, train: Sequences, vocab: int, source: str, log: Callable[[str], None],
                    kind: str) -> tuple[torch.Tensor, float, dict[str, str]]:
    """(ids, coverage of the training tokens, {draft_vocab.json: its text}) of a run whose drafts read rows of
    the target's head (EAGLE-1, Medusa): ``init_from``'s file where it has one (the drafter learnt those rows),
    else the ``size`` most frequent tokens of the training data (``source`` names them)."""
    from specdec.drafters.base import DRAFT_VOCAB_FILE, read_draft_vocabulary
    from specdec.train.config import TrainConfigError

    ids = read_draft_vocabulary(init_from, vocab) if init_from else None
    if ids is not None:
        coverage, source = vocabulary_coverage(train, ids, vocab), f"the draft vocabulary of {init_from}"
    else:
        if not 0 < size < vocab:
            raise TrainConfigError(f"head_vocab must be in 1..{vocab - 1}, got {size}")
        ids, coverage = draft_vocabulary(train, size, vocab)
        source = f"the {kind} training data ({source}), {train.tokens.shape[0]} sequences"
    log(f"[{kind}] next-token loss over {ids.numel()} of {vocab} tokens ({coverage:.1%} of the training tokens)")
    return ids, coverage, {DRAFT_VOCAB_FILE: draft_vocab_text(ids, coverage, train.num_tokens, source)}


def start_from(net: torch.nn.Module, source: torch.nn.Module, folder: str, target, what: str,
               error: type[Exception]) -> None:
    """Load the weights of ``source`` (``folder``'s trained ``what``, e.g. "an EAGLE drafter") into ``net``:
    the same shape, made for this target; refused in one line otherwise."""
    config = source.config
    warning = config.target.check(target, f"{what} in {folder}", config.hidden_size, config.vocab_size,
                                  config.hidden_layers())
    if warning:
        raise error(warning)
    mine, theirs = net.state_dict(), source.state_dict()
    different = [name for name in mine if name not in theirs or theirs[name].shape != mine[name].shape]
    if different or len(mine) != len(theirs):
        raise error(f"{folder} holds {what} of another shape than this run's "
                    f"({', '.join(different[:3]) or 'other tensors'}); init_from needs the same shape")
    net.load_state_dict({name: theirs[name].float() for name in mine})
    net.train()


def write_draft_vocabulary(drafter_dir: Path, target_dir: Path, size: int, count: int = 1536, max_len: int = 512,
                           seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Restrict a drafter that ends in a head over the whole vocabulary (EAGLE-1, DFlash, DSpark, MTP modules
    kept apart and Medusa heads ending in the target's head, a draft model's own head) to the ``size`` most
    frequent tokens of the ShareGPT text its presets train on (``count`` train conversations cut at ``max_len``
    tokens, in the order of ``seed``: the ``*-sharegpt`` presets' train set), written to DRAFT_VOCAB_FILE
    in its folder. Returns what the file records."""
    import json

    from specdec.backends.hf import load_config, load_tokenizer
    from specdec.drafters.base import DRAFT_VOCAB_FILE
    from specdec.drafters.mtp import is_modules_folder
    from specdec.models.dflash import ARCH as DFLASH_ARCH
    from specdec.models.eagle import EAGLE1_ARCH, method_of, read_config_json

    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    config = read_config_json(drafter_dir)
    arch = (config.get("architectures") or [""])[0]
    if drafter_dir.resolve() == target_dir.resolve():
        raise data.DataError(f"{drafter_dir} is the target itself, not a drafter beside it")
    reads_head = (is_modules_folder(drafter_dir) or arch in (EAGLE1_ARCH, DFLASH_ARCH)
                  or arch.endswith("ForCausalLM") or ("medusa_num_heads" in config and config.get("original_lm_head")))
    if not reads_head:
        raise data.DataError(f"{drafter_dir}: a draft vocabulary serves drafters that end in a head over the whole "
                             f"vocabulary (EAGLE-1, DFlash, DSpark, MTP modules kept apart, Medusa heads ending in "
                             f"the target's head, a draft model); this folder holds {method_of(config)}")
    vocab = int(load_config(target_dir).vocab_size)
    if int(config.get("vocab_size", vocab)) != vocab:
        raise data.DataError(f"{drafter_dir} drafts over {config['vocab_size']} tokens, the target has {vocab}")
    if not 0 < size < vocab:
        raise data.DataError(f"the draft vocabulary's size must be in 1..{vocab - 1}, got {size}")
    tokenizer = load_tokenizer(target_dir)
    text = sharegpt_text(tokenizer, count, max_len, seed, chat_pad(target_dir, tokenizer))
    ids, coverage = draft_vocabulary(text, size, vocab)
    written = draft_vocab_text(ids, coverage, text.num_tokens, f"ShareGPT train text, {text.tokens.shape[0]} "
                               f"conversations cut at {max_len} tokens, seed {seed}")
    write_text_atomic(drafter_dir / DRAFT_VOCAB_FILE, written)
    record = json.loads(written)
    log(f"[draft-vocab] {size} of {vocab} tokens cover {record['coverage']:.1%} of {record['counted_tokens']:,} "
        f"training tokens; written to {drafter_dir / DRAFT_VOCAB_FILE}")
    return record


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
    """The target in transformers, float32, no gradients: features and logits of a batch, read from a
    ``FeatureCache`` when one holds the batch's sequences (looked up by their tokens: the result is a
    function of them), else computed."""

    def __init__(self, target_dir: Path, cache: FeatureCache | None = None):
        from specdec.train.distill import load_frozen_target

        self.model = load_frozen_target(target_dir)
        self.embed = self.model.get_input_embeddings().weight.detach()     # [V, H]
        self.head = self.model.get_output_embeddings().weight.detach()     # [V, H]
        self._rows: tuple[torch.Tensor | None, torch.Tensor] = (None, self.head)  # the last rows asked, their head
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.cache = cache

    def head_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Those rows of the head (all: None), gathered once for a run that asks for the same rows each step."""
        kept = self._rows[0]
        if not (rows is kept or (rows is not None and kept is not None and torch.equal(rows, kept))):
            self._rows = (rows, self.head if rows is None else self.head[rows].contiguous())
        return self._rows[1]

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, valid: torch.Tensor, layers: tuple[int, ...], at: torch.Tensor | None = None,
            rows: torch.Tensor | None = None, choice: bool = False):
        """(features [B, T, len(layers) * H] concatenated in order, logits [B, T, V]); with ``at`` [B, M]
        (positions, < T) the logits there only, [B, M, V] (a cached batch then skips the others' products);
        with ``rows`` (token ids) only those logits, [B, T, len(rows)]; ``choice``: a third item, the
        target's argmax over its whole vocabulary [B, T] (a cache's ``choices``: no product with the
        rows left out)."""
        found = self.cache.lookup(tokens, layers) if self.cache is not None else None
        if found is not None:
            features, final = found
            chosen = self.cache.choice(tokens) if choice else None
            if choice and chosen is None:  # a cache built without them
                chosen = (final @ self.head.t()).argmax(-1)
            if at is not None:
                final = final.gather(1, at[:, :, None].expand(-1, -1, final.shape[2]))
            logits = final @ self.head_rows(rows).t()
            return (features, logits, chosen) if choice else (features, logits)
        out = self.model(input_ids=tokens, attention_mask=valid.long(), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        chosen = out.logits.argmax(-1) if choice else None
        logits = out.logits.float() if rows is None else out.logits[..., rows].float()
        if at is not None:
            logits = logits.gather(1, at[:, :, None].expand(-1, -1, logits.shape[2]))
        return (features, logits, chosen) if choice else (features, logits)

    @torch.no_grad()
    def log_probs(self, tokens: torch.Tensor, valid: torch.Tensor, layers: tuple[int, ...], at: torch.Tensor,
                  rows: torch.Tensor | None = None):
        """(features [B, T, len(layers) * H], the target's log-probabilities at positions ``at`` [B, M] over
        ``rows`` [B, M, len(rows)] (all: None)): from a cache with its log-normalizers
        (``FeatureCache.normalizers``) the product with those rows of the head only, less the normalizer;
        else the log-softmax of the whole vocabulary's logits."""
        lse = self.cache.normalizer(tokens) if self.cache is not None and rows is not None else None
        if lse is not None:
            features, logits = self.run(tokens, valid, layers, at=at, rows=rows)
            return features, logits - lse.gather(1, at)[:, :, None]
        features, logits = self.run(tokens, valid, layers, at=at)
        logp = torch.log_softmax(logits.float(), -1)
        return features, logp if rows is None else logp[..., rows]


class FeatureCache:
    """Hidden states of fixed sequence sets, computed once by a batched bfloat16 forward pass (the
    fastest there is; training need not be shape-invariant) and kept on disk as bfloat16.

    Each set is one file [N, T, len(layers), H] written chunk by chunk; ``<set>.done`` lists the
    finished chunks (rewritten atomically after each), so a killed build resumes where it stopped;
    ``<set>.tokens`` is a digest of the set's tokens, so a folder left by other sequences is computed
    again, not read as if it held these. The final layer (normed, as transformers returns it) is always
    kept: logits are one product with the head. Rows are found by their tokens."""

    CHUNK_TOKENS = 8192

    def __init__(self, folder: Path, sets: dict[str, Sequences], layers: tuple[int, ...], num_layers: int,
                 hidden: int, earlier: tuple[Path, ...] = ()):
        """earlier: folders of the same layers holding sets whose sequences are the first of these (a
        smaller data set of the same recipe): their rows are copied, not computed again."""
        self.folder, self.sets, self.hidden, self.earlier = Path(folder), sets, hidden, tuple(earlier)
        self.layers = tuple(sorted(set(layers) | {num_layers}))
        self.final = self.layers.index(num_layers)
        self.arrays: dict[str, "np.memmap"] = {}
        self.choices: dict[str, torch.Tensor] = {}  # the target's argmax per set [N, T] (build)
        self.log_normalizers: dict[str, torch.Tensor] = {}  # its logsumexp per set [N, T] (normalizers)
        self.rows = {seqs.tokens[row].numpy().tobytes(): (name, row)
                     for name, seqs in sets.items() for row in range(seqs.tokens.shape[0])}

    def _shape(self, name: str) -> tuple[int, ...]:
        tokens = self.sets[name].tokens
        return (tokens.shape[0], tokens.shape[1], len(self.layers), self.hidden)

    def size_bytes(self) -> int:
        return sum(2 * int(np.prod(self._shape(name))) for name in self.sets)

    def chunks(self, name: str) -> range:
        """Starting rows of set ``name``'s chunks."""
        rows, width = self.sets[name].tokens.shape
        return range(0, rows, max(1, self.CHUNK_TOKENS // width))

    def digest(self, name: str, rows: int | None = None) -> str:
        """Of the set's tokens (its first ``rows`` rows)."""
        import hashlib

        tokens = self.sets[name].tokens[:rows]
        return hashlib.sha256(str(tuple(tokens.shape)).encode() + tokens.numpy().tobytes()).hexdigest()

    def copy_earlier(self, name: str, array, done: set[int], log: Callable[[str], None]) -> None:
        """Copy into ``array`` the rows of set ``name`` that a finished earlier folder holds (the one
        holding the most), marking the chunks they fill as done."""
        import json

        row_bytes, step = 2 * int(np.prod(self._shape(name)[1:])), self.chunks(name).step
        found = []
        for folder in self.earlier:
            path, done_path, tokens_path = (folder / f"{name}.{suffix}" for suffix in ("bin", "done", "tokens"))
            if folder == self.folder or not (path.is_file() and done_path.is_file() and tokens_path.is_file()):
                continue
            rows, extra = divmod(path.stat().st_size, row_bytes)
            if (not extra and 0 < rows <= self.sets[name].tokens.shape[0]
                    and tokens_path.read_text() == self.digest(name, rows)
                    and set(json.loads(done_path.read_text())) == set(range(0, rows, step))):
                found.append((rows, path))
        if not found:
            return
        rows, path = max(found)
        total = self.sets[name].tokens.shape[0]
        filled = [start for start in self.chunks(name) if start not in done and min(start + step, total) <= rows]
        if not filled:
            return
        source = np.memmap(path, dtype=np.int16, mode="r", shape=(rows, *self._shape(name)[1:]))
        for start in filled:
            array[start: start + step] = source[start: start + step]
        array.flush()
        done.update(filled)
        log(f"[features] {name}: {sum(min(step, total - start) for start in filled)} rows copied from {path.parent}")

    def finished(self, name: str) -> set[int]:
        """The chunks of set ``name`` already in the folder (none when it holds other sequences)."""
        import json

        path, done_path, tokens_path = (self.folder / f"{name}.{suffix}" for suffix in ("bin", "done", "tokens"))
        if not (path.is_file() and done_path.is_file() and tokens_path.is_file()) \
                or tokens_path.read_text() != self.digest(name):
            return set()
        return set(json.loads(done_path.read_text()))

    def missing(self) -> int:
        """Chunks still to compute, over every set."""
        return sum(len(set(self.chunks(name)) - self.finished(name)) for name in self.sets)

    def build(self, target_dir: Path, log: Callable[[str], None]) -> float:
        """Compute what is missing; returns the seconds spent."""
        import json
        import time

        from tqdm import tqdm

        started = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        model = None
        for name, seqs in self.sets.items():
            path, done_path = self.folder / f"{name}.bin", self.folder / f"{name}.done"
            chunks = self.chunks(name)
            per_chunk = chunks.step
            # The finished chunks are of the sequences whose digest <set>.tokens holds (none: an older cache).
            tokens_path = self.folder / f"{name}.tokens"
            digest = self.digest(name)
            if tokens_path.is_file() and tokens_path.read_text() != digest:
                done_path.unlink(missing_ok=True)
                path.unlink(missing_ok=True)
            write_text_atomic(tokens_path, digest)
            done = self.finished(name)
            todo = [start for start in chunks if start not in done]
            array = np.memmap(path, dtype=np.int16, mode="r+" if path.is_file() else "w+", shape=self._shape(name))
            if todo and self.earlier:
                self.copy_earlier(name, array, done, log)
                write_text_atomic(done_path, json.dumps(sorted(done)))
                todo = [start for start in chunks if start not in done]
            if todo:
                log(f"[features] {name}: {len(self.layers)} layers x {seqs.tokens.shape[0]} sequences x "
                    f"{seqs.tokens.shape[1]} positions, {2 * np.prod(self._shape(name)) / 2**30:.2f} GiB "
                    f"in {self.folder}; {len(todo)} of {len(chunks)} chunks to compute")
            for start in tqdm(todo, desc=f"features {name}", unit="chunk", disable=not todo):
                if model is None:
                    model = load_fast_target(target_dir)
                rows = torch.arange(start, min(start + per_chunk, seqs.tokens.shape[0]))
                states = layer_states(model, *seqs.batch(rows), self.layers)
                array[start: start + len(rows)] = states.view(torch.int16).numpy()
                array.flush()
                done.add(start)
                write_text_atomic(done_path, json.dumps(sorted(done)))
            self.arrays[name] = np.memmap(path, dtype=np.int16, mode="r", shape=self._shape(name))
            self.choices[name] = self._choices(name, target_dir, log)
        return time.monotonic() - started

    def _choices(self, name: str, target_dir: Path, log: Callable[[str], None]) -> torch.Tensor:
        """The target's choice (argmax over its whole vocabulary) at every real position of set ``name``
        [N, T] (-1 at padding), from the cached final states and the head, computed once and kept in
        ``<set>.choices.npy`` with the digest of the set's tokens it was computed for: objectives that learn
        over a draft vocabulary then take the target's logits over that vocabulary only, yet know its choice."""
        from specdec.models.kernels import fast_bfloat16
        from specdec.train.distill import load_frozen_target

        def head() -> torch.Tensor:
            dtype = torch.bfloat16 if fast_bfloat16() else torch.float32
            return load_frozen_target(target_dir).get_output_embeddings().weight.detach().to(dtype)

        return self._per_position(name, "choices", head, lambda states, w: (states.to(w.dtype) @ w.t()).argmax(-1),
                                  torch.int32, -1, log, "the target's choices").long()

    def normalizers(self, head: torch.Tensor, log: Callable[[str], None]) -> None:
        """The log-normalizer of the target's distribution (logsumexp of its whole vocabulary's logits, the
        final states times ``head`` in float32 as ``FrozenTarget.run`` takes them) at every real position of
        every set, computed once into ``<set>.lse.npy`` (0 at padding): an objective that needs the target's
        probabilities over a draft vocabulary then takes those rows' logits only (``normalizer``)."""
        head = head.float()
        for name in self.sets:
            self.log_normalizers[name] = self._per_position(
                name, "lse", lambda: head, lambda states, w: log_normalizer(states.float() @ w.t()),
                torch.float32, 0.0, log, "the target's log-normalizers")

    def _per_position(self, name: str, suffix: str, head: Callable[[], torch.Tensor],
                      value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype, fill,
                      log: Callable[[str], None], what: str) -> torch.Tensor:
        """[N, T] ``value(final states [n, H], head)`` at every real position of set ``name`` (``fill`` at
        padding), kept in ``<set>.<suffix>.npy`` beside the digest of the tokens it was computed for."""
        from tqdm import tqdm

        path, digest = self.folder / f"{name}.{suffix}.npy", self.folder / f"{name}.{suffix}.tokens"
        if path.is_file() and digest.is_file() and digest.read_text() == self.digest(name):
            return torch.from_numpy(np.load(path))
        seqs, final, weights = self.sets[name], self.arrays[name], head()
        out = torch.full(tuple(seqs.tokens.shape), fill, dtype=dtype)
        step, positions = max(1, self.CHUNK_TOKENS // seqs.tokens.shape[1]), 0
        for start in tqdm(range(0, seqs.tokens.shape[0], step), desc=f"{suffix} {name}", unit="chunk"):
            rows = slice(start, start + step)
            real = seqs.batch(torch.arange(seqs.tokens.shape[0])[rows])[1]         # [n, T] bool
            states = torch.from_numpy(np.array(final[rows, :, self.final])).view(torch.bfloat16)[real]
            with torch.no_grad():
                out[rows][real] = value(states, weights).to(dtype)
            positions += int(real.sum())
        np.save(path.with_suffix(".tmp.npy"), out.numpy())
        os.replace(path.with_suffix(".tmp.npy"), path)
        write_text_atomic(digest, self.digest(name))
        log(f"[features] {name}: {what} at {positions} positions -> {path.name}")
        return out

    def lookup(self, tokens: torch.Tensor, layers: tuple[int, ...]):
        """(features [B, T, len(layers) * H], final normed state [B, T, H]) in float32, or None when a
        row is not cached."""
        found = [self.rows.get(row.numpy().tobytes()) for row in tokens]
        if any(item is None for item in found) or any(layer not in self.layers for layer in layers):
            return None
        stacked = torch.stack([torch.from_numpy(np.array(self.arrays[name][row])) for name, row in found])
        stacked = stacked.view(torch.bfloat16).float()                       # [B, T, L, H]
        picked = [self.layers.index(layer) for layer in layers]
        features = stacked[:, :, picked].flatten(2)
        return features, stacked[:, :, self.final]

    def choice(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The target's argmax over its vocabulary [B, T] at the rows' positions (-1 at padding), or None
        when a row is not cached."""
        return self._rows_of(self.choices, tokens)

    def normalizer(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The target's log-normalizer [B, T] at the rows' positions, or None when a row is not cached or
        ``normalizers`` was not run."""
        return self._rows_of(self.log_normalizers, tokens)

    def _rows_of(self, per_set: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor | None:
        found = [self.rows.get(row.numpy().tobytes()) for row in tokens]
        if any(item is None or item[0] not in per_set for item in found):
            return None
        return torch.stack([per_set[name][row] for name, row in found])


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last axis as the largest logit less the log of its softmax probability: the
    softmax is one fused pass (torch's logsumexp took 7x as long on these CPUs)."""
    probs = torch.softmax(logits, -1)
    return logits.max(-1).values - probs.max(-1).values.log()


def layer_states(model, tokens: torch.Tensor, valid: torch.Tensor, layers: tuple[int, ...],
                 budget: int = 2048) -> torch.Tensor:
    """The hidden states [B, T, len(layers), H] (bfloat16) of ``layers`` for a batch of right-padded rows,
    computed in groups of rows of similar length, each cut to its longest row and of about ``budget``
    positions (about half of a padded chunk's positions were padding); a padded position's states are
    zeros (nothing reads them: every loss and metric masks them)."""
    lengths = valid.sum(1)
    order = lengths.argsort(descending=True, stable=True)
    out, first = None, 0
    while first < len(order):
        width = max(1, int(lengths[order[first]]))
        group = order[first: first + max(1, budget // width)]
        with torch.no_grad():
            result = model(input_ids=tokens[group, :width], attention_mask=valid[group, :width].long(),
                           output_hidden_states=True, logits_to_keep=1)
        states = torch.stack([result.hidden_states[i] for i in layers], dim=2).to(torch.bfloat16)
        if out is None:
            out = states.new_zeros(tokens.shape[0], tokens.shape[1], *states.shape[2:])
        out[group, :width] = states * valid[group, :width, None, None]
        first += len(group)
    return out


def load_fast_target(target_dir: Path):
    """The target in transformers for computing features in bulk: bfloat16 where the CPU has bfloat16
    dot products, else float32 (kernels.fast_bfloat16); the features are kept as bfloat16 either way."""
    from specdec.models.kernels import fast_bfloat16
    from specdec.train.distill import load_frozen_target

    return load_frozen_target(target_dir, dtype=torch.bfloat16 if fast_bfloat16() else torch.float32)


def write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


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


def soft_cross_entropy(student_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """Mean over ``mask`` [B, T] of the cross-entropy from the target's distribution to the student's
    (KL(target || student) plus the target's entropy, which does not depend on the student), at ``temperature``.

    In the student's logits' dtype: bfloat16 under autocast, where the fused loss over a vocabulary of 49,152
    takes 1.5 s for 4,096 positions on 2 cores against 9 s for a float32 KL."""
    with torch.no_grad():
        probs = torch.softmax(target_logits.float() / temperature, dim=-1).to(student_logits.dtype)   # [B, T, V]
    with torch.autocast("cpu", enabled=False):
        ce = F.cross_entropy((student_logits / temperature).flatten(0, 1), probs.flatten(0, 1), reduction="none")
    weight = mask.flatten().float()
    return (ce.float() * weight).sum() / weight.sum().clamp(min=1) * temperature**2


def warn_if_useless(metrics: dict[str, float], key: str, log: Callable[[str], None], what: str) -> bool:
    """Say loudly when the predicted tau shows the drafter barely helps; returns whether it did. Without
    ``key`` (a run that measured fewer positions) the deepest chain it measured (``tau_k<j>``) decides."""
    if key not in metrics:
        measured = sorted((int(name[5:]), name) for name in metrics if name.startswith("tau_k") and name[5:].isdigit())
        key = measured[-1][1] if measured else key
    tau = metrics.get(key)
    if tau is not None and tau < LOW_TAU:
        log(f"WARNING: {what} predicts tau {tau:.2f} on held-out data (below {LOW_TAU}): it will accept almost "
            f"nothing against this target. Check the target, the feature layers and the data before serving it.")
        return True
    if tau is not None and tau < MODEST_TAU:
        log(f"NOTE: {what} predicts tau {tau:.2f} on held-out data ({key}), far below the 3 or more that drafters "
            f"of this kind reach in published results: expect a small speedup at best. More training tokens "
            f"(the target's own answers) and steps raise it; `specdec bench` measures what it gains.")
    return False


def carried_vocabulary(init_from: str, log: Callable[[str], None], kind: str) -> dict[str, str]:
    """The continued folder's draft vocabulary file, for the new folder: the rows of the target's head the
    drafter drafts from are the target's, not the weights', and without them every draft reads all of it."""
    from specdec.drafters.base import DRAFT_VOCAB_FILE

    source = Path(init_from) / DRAFT_VOCAB_FILE if init_from else None
    if source is None or not source.is_file():
        return {}
    log(f"[{kind}] {DRAFT_VOCAB_FILE} carried over from {init_from}")
    return {DRAFT_VOCAB_FILE: source.read_text()}


class DataReady(Exception):
    """A data-only run's end: its token ids and feature cache are on disk, nothing was trained or exported."""

    def __init__(self, fields: dict):
        super().__init__(f"data ready in {fields['data_dir']}")
        self.fields = fields


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
    target_dir: Path
    source: str             # where the data came from (data_source)
    data_dir: Path          # token ids and feature caches (shared between runs on the same data)
    feature_seconds: float = 0.0
    data_only: bool = False   # stop once the ids and features are on disk (DataReady), nothing trained

    def frozen(self, layers: tuple[int, ...]) -> FrozenTarget:
        """The frozen target for an objective reading ``layers``: with a feature cache of the train and
        held-out sets when the data are real (computed here on first use), computing on the fly for the zoo."""
        cache = None
        if self.source != "corpus":
            config = self.target.config
            key = f"{self.target.fingerprint()}-{self.data_name}-{self.train.tokens.shape[0]}x{self.train.tokens.shape[1]}"
            wanted = set(layers) | {self.target.num_layers}

            def cache_of(chosen: set[int]) -> FeatureCache:
                layer_key = "-".join(str(i) for i in sorted(chosen))
                # Folders of a smaller set of the same recipe and layers lend the rows they share.
                earlier = sorted(self.data_dir.glob(f"features-{self.target.fingerprint()}-{self.source}-*x"
                                                    f"{self.train.tokens.shape[1]}-L{layer_key}"))
                return FeatureCache(self.data_dir / f"features-{key}-L{layer_key}",
                                    {"train": self.train, "heldout": self.held}, tuple(chosen),
                                    self.target.num_layers, int(config.hidden_size), tuple(earlier))

            # A cache of these sequences holding more layers serves too (EAGLE-3, DFlash, Medusa and
            # EAGLE-1 can share one folder): the one with the fewest chunks left to compute, then the
            # fewest layers; else one of exactly the layers asked for.
            stored = [cache_of(found) for found in (set(int(i) for i in folder.name.rsplit("-L", 1)[1].split("-"))
                                                    for folder in self.data_dir.glob(f"features-{key}-L*")
                                                    if folder.is_dir()) if wanted <= found]
            cache = min(stored, key=lambda c: (c.missing(), len(c.layers)), default=None) or cache_of(wanted)
            self.feature_seconds = cache.build(self.target_dir, self.log)
        if self.data_only:
            raise DataReady({**self.data_fields(), "data_dir": str(self.data_dir),
                             "feature_cache": str(cache.folder) if cache is not None else None})
        return FrozenTarget(self.target_dir, cache)

    @property
    def data_name(self) -> str:
        """The source, and the code requests added to it."""
        code = getattr(self.config, "code_requests", 0)
        return f"{self.source}+code{code}" if code else self.source

    def data_fields(self) -> dict:
        """What every trainer's summary says of its data."""
        return {"data_source": self.data_name, "data_minutes": round(self.data_seconds / 60, 2),
                "feature_minutes": round(self.feature_seconds / 60, 2), "train_tokens": self.train.num_tokens,
                "train_sequences": int(self.train.tokens.shape[0]), "heldout_tokens": self.held.num_tokens,
                "features": ("computed once (bfloat16 forward), cached on disk" if self.source != "corpus"
                             else "computed on the fly by the frozen target (nothing cached but token ids)")}

    def fit(self, net, objective, kind: str, salt: int, resume: bool, max_minutes: float | None, warn_key: str,
              what: str):
        """The shared loop over this run's batches (``objective``: loss and evaluate), then the weights rounded
        to the exported dtype and evaluated once more: (loop result, final offline metrics, whether the
        low-acceptance warning fired)."""
        from specdec.train.config import config_to_dict
        from specdec.train.loop import run_loop
        from specdec.train.target import round_to_export_dtype_

        run_config = {"kind": kind, kind: config_to_dict(self.config), "target": self.target.fingerprint()}
        result = run_loop(model=net, config=self.config.optim, batch_fn=self.batch_fn(salt), loss_fn=objective.loss,
                          tokens_in=lambda batch: int(batch[1].sum()), eval_fn=lambda m: objective.evaluate(m, self.held),
                          ckpt_dir=self.ckpt_dir, run_config=run_config, resume=resume, max_minutes=max_minutes,
                          desc=kind, log=self.log)
        round_to_export_dtype_(net)
        final = objective.evaluate(net, self.held)
        return result, final, warn_if_useless(final, warn_key, self.log, what)

    def batch_fn(self, salt: int):
        """Batches of training sequences as a pure function of the step (resumable)."""
        def batch_for(step: int):
            generator = data.step_generator(self.config.seed, step, salt=salt)
            rows = torch.randint(0, self.train.tokens.shape[0], (self.config.batch_size,), generator=generator)
            return self.train.batch(rows)
        return batch_for


def prepare_run(kind: str, config, target_dir: Path, out_dir: Path, ckpt_dir: Path | None, resume: bool,
                config_from_dict: Callable, log: Callable[[str], None] | None,
                data_dir: Path | None = None, data_only: bool = False) -> DrafterRun:
    """Resolve folders, take the configuration from the checkpoint on resume, load the target and make
    (or read) its continuation data; token ids and features live in ``data_dir`` (default: the
    checkpoint folder). ``data_only``: the run stops with DataReady once its data are on disk."""
    import time

    from tqdm import tqdm

    from specdec.backends.target import load_target
    from specdec.train.loop import load_latest_checkpoint

    log = log or (lambda message: tqdm.write(message))
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else Path(out_dir) / "checkpoints"
    data_dir = Path(data_dir) if data_dir is not None else ckpt_dir
    if resume:
        config = config_from_dict(load_latest_checkpoint(ckpt_dir)["run_config"][kind])
    target = load_target(target_dir)
    started = time.monotonic()
    source = data_source(config.source, target.tokenizer)
    train, held = training_data(Path(target_dir), target.fingerprint(), data_dir,
                                train_sequences=config.train_sequences, heldout_sequences=config.heldout_sequences,
                                prefix_len=config.prefix_len, generated_len=config.generated_len,
                                generation_batch=config.generation_batch, seed=config.seed, log=log, source=source,
                                code_requests=config.code_requests)
    return DrafterRun(config, target, train, held, ckpt_dir, time.monotonic() - started, log, Path(target_dir), source,
                      data_dir, data_only=data_only)
