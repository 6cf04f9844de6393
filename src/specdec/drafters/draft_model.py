"""A separate small causal LM that shares the target's vocabulary drafts k tokens autoregressively.

Its KV cache keeps, between steps, the longest prefix still valid: the committed context plus the
drafts the target accepted. Each step first feeds the tokens it has not seen (the target's
correction or bonus token, and the last draft when the whole chain was accepted), then drafts.
"""

from __future__ import annotations

import os
import sys

import torch

from specdec.backends import hf
from specdec.batch import Sequences
from specdec.errors import ContextLengthError, InvalidArgumentError, SpecdecError, VocabularyMismatchError
from specdec.backends.native import NativeBackend
from specdec.models import kernels, llama
from specdec.sampling import probabilities, sample
from specdec.drafters.base import (ConfidenceStop, DecodeContext, Proposal, check_p_min, cut_label, draft_from,
                                   over_vocabulary, read_draft_vocabulary, recorded_defaults,
                                   recorded_setting, top_probability)
from specdec.drafters.tree import dynamic_tree
from specdec.backends.target import Target, load_backend, resolve_model


STAGED_GUESSES = 3  # a staged draft model's guesses a pass (docs/real-target.md, thirty-first session: 3 > 4)


class DraftModel:
    name = "draft-model"

    def __init__(self, model: str | os.PathLike | torch.nn.Module | Target, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", backend: str = "auto", draft_vocab: bool | str | os.PathLike = True,
                 quantize: str | None = None, reuse_prompt: bool = True, p_min: float | None = None,
                 staged=None, staged_guesses: int | None = None):
        """``model``: a model directory (a GGUF file, or a real model's name, as ``load_target`` takes),
        a transformers model already loaded (runs on "hf"), or a ``Target``, which then drafts on its own
        backend (self-draft; ``target.model`` is None on native).

        ``backend`` as for ``load_target``: "native", "hf" or "auto" (native where supported);
        ``dtype``, ``device``, ``backend`` and ``quantize`` apply to directories only. ``quantize``
        ("q8_0", "q4_0", "q4_1"): block-quantize the model's matrices at load, so a float model drafts
        for itself at the cost of its quantized pass (the target's outputs stay its own: the drafts
        are only proposals). ``draft_vocab``: a directory's draft_vocab.json (``specdec train
        draft-vocab``) restricts the drafts to its tokens, and the native backend then computes only
        those rows of the model's head (a quantized model's as Q8_0 blocks); a path: that file (or the
        one in that folder) instead; False: the whole head. ``reuse_prompt``: where the draft model is a
        copy of the target (the same shape and embeddings: a quantized copy, a GGUF file of the same
        weights), it takes the keys and values the target computed for the prompt instead of reading the
        prompt again (both on the native backend); drafts stay proposals, so outputs are unchanged.
        ``p_min`` (llama.cpp's ``--draft-p-min``): a row's chain stops before its first draft whose most likely
        token the draft model gives less than this probability (``drafters.base.ConfidenceStop``); None: a
        directory's recorded one (``bench --record``), else none; 0: none.
        ``staged``: a drafter without a model (a ``PromptLookup`` or ``Retrieval``, or "prompt-lookup") that
        drafts for the draft model itself, greedy chains only (staged speculation): each of the draft model's
        passes reads the tokens it has not seen and up to ``staged_guesses`` (default 3) of that drafter's
        guesses at once, keeps the guesses its own argmax agrees with and one token of its own, so a pass can
        yield several drafts. The drafts are the ones the draft model drafts alone, token for token; sampling
        and trees draft one token a pass. None: the folder's recorded choice (``bench --record``), else none;
        "none": none.
        """
        self.vocabulary, self.head = None, None
        self.reuse_prompt = reuse_prompt
        if quantize is not None and not isinstance(model, (str, os.PathLike)):
            raise InvalidArgumentError(f"quantize={quantize!r} quantizes a model loaded from a directory or file, "
                                       f"not a {type(model).__name__} already loaded")
        if isinstance(model, Target):
            self.backend, self.model, self.tokenizer = model.backend, model.model, model.tokenizer
            self.path = model.path
        elif isinstance(model, torch.nn.Module):
            self.model, self.tokenizer, self.path = model.eval(), None, None
            self.backend = hf.HFBackend.for_model(self.model)
        elif isinstance(model, (str, os.PathLike)):
            model = resolve_model(model)
            self.backend, self.model = load_backend(model, dtype, device, backend, quantize=quantize)
            self.tokenizer = hf.load_tokenizer(model)
            self.path = str(model)
            self.default_draft_tokens, self.default_tree = recorded_defaults(self.path)  # bench --record's fastest
            if draft_vocab is not False and isinstance(self.backend, NativeBackend):
                where = self.path if draft_vocab is True else draft_vocab
                self.vocabulary = read_draft_vocabulary(where, self.backend.vocab_size, required=draft_vocab is not True)
        else:  # None is typically target.model of a native target
            hint = " (target.model is None on the native backend: pass the Target itself)" if model is None else ""
            raise InvalidArgumentError(f"DraftModel takes a model directory, a transformers model or a Target, "
                                       f"got {type(model).__name__}{hint}")
        self.p_min = check_p_min(p_min, self.path)  # a folder's recorded cut (a file or a loaded model: none)
        self.staged, self.staged_guesses = staged_setting(staged, staged_guesses, self.path)

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def staged_name(self) -> str | None:
        """The staged drafter's registry name, or None (bench's rows and --record)."""
        return None if self.staged is None else self.staged.name

    @property
    def setting(self) -> str:
        """What bench's labels show of this drafter's own settings."""
        staged = f"staged {self.staged_name} G={self.staged_guesses}" if self.staged is not None else ""
        return " ".join(part for part in (staged, cut_label(self.p_min)) if part)

    def check_compatible(self, target) -> None:
        """Same token ids must mean the same strings, or drafts are meaningless to the target."""
        if getattr(self, "_compatible_with", None) is target:
            return  # checked already (comparing vocabularies costs milliseconds per generation)
        if self.tokenizer is not None and target.tokenizer is not None:
            if self.tokenizer.get_vocab() != target.tokenizer.get_vocab():
                raise VocabularyMismatchError(
                    f"draft vocabulary ({len(self.tokenizer)} tokens) differs from the target's "
                    f"({len(target.tokenizer)} tokens)")
        elif self.vocab_size != target.vocab_size:
            raise VocabularyMismatchError(
                f"draft vocabulary size {self.vocab_size} differs from the target's {target.vocab_size}")
        self.copies_target = self.reuse_prompt and copies(self.backend, target.backend)
        self._compatible_with = target

    def start(self, context: DecodeContext, seqs: Sequences) -> "DraftModelSession":
        self.check_compatible(context.target)
        window = hf.max_positions(self.backend.config)
        needed = int(seqs.lengths.max()) + context.max_new_tokens
        if window is not None and needed > window:
            raise ContextLengthError(
                f"the draft model's context window is {window} tokens, this generation needs up to {needed}")
        if self.vocabulary is not None and self.head is None:
            model = self.backend.model
            # a quantized model's head rows stay quantized (Q8_0 blocks of its dequantized rows: a Q8_0 head's own)
            self.head = llama.head_matrix(model.head_weight(), model.dtype, model.norm, llama.drafter_qtype(self),
                                          rows=self.vocabulary)
        staged = self.staged.start(context, seqs) if self.staged is not None and context.sampling.greedy \
            and context.tree is None else None
        session = DraftModelSession(self.backend, context, seqs.batch_size, context.target.vocab_size,
                                    self.vocabulary, adopts_prompt=self.copies_target, p_min=self.p_min,
                                    staged=staged, staged_guesses=self.staged_guesses)
        if self.vocabulary is not None:
            session.cache.logit_head = self.head
        return session


def staged_setting(staged, guesses: int | None, folder: str | None):
    """(the staged drafter or None, guesses a pass) from DraftModel's ``staged`` and ``staged_guesses``:
    a drafter, "prompt-lookup", "retrieval" (over the datastore the folder records), "none", or None for
    what ``folder`` records (its config.json's ``specdec.defaults``: ``staged``, ``staged_guesses`` and,
    for retrieval, ``staged_datastore``, written by ``bench --record``); one line for anything else."""
    from specdec.drafters.prompt_lookup import PromptLookup

    recorded = recorded_setting(folder) if folder else {}
    from_record = staged is None
    if from_record:
        staged = recorded.get("staged") or "none"
        guesses = guesses if guesses is not None else recorded.get("staged_guesses")
    guesses = STAGED_GUESSES if guesses is None else guesses
    if not isinstance(guesses, int) or isinstance(guesses, bool) or guesses < 1:
        raise InvalidArgumentError(f"staged guesses must be a whole number >= 1, got {guesses!r}")
    if staged == "retrieval":
        try:
            return staged_retrieval(recorded.get("staged_datastore")), guesses
        except SpecdecError as error:
            if not from_record:
                raise
            # the guesser only saves passes (the drafts are the same): a record's that cannot be had gives way
            print(f"[specdec] the recorded staged guesser, retrieval, is unavailable ({error}); guessing with "
                  f"prompt lookup instead (the same drafts)", file=sys.stderr, flush=True)
            staged = PromptLookup()
    if isinstance(staged, str):
        named = {"none": None, "prompt-lookup": PromptLookup()}
        if staged not in named:
            raise InvalidArgumentError(f"a staged draft model guesses with {', '.join(named)} or retrieval by name, "
                                       f"got {staged!r}")
        staged = named[staged]
    elif not (hasattr(staged, "start") and hasattr(staged, "name")):
        raise InvalidArgumentError(f"staged takes a drafter without a model (PromptLookup, Retrieval) or its name, "
                                   f"got {type(staged).__name__}")
    return staged, guesses


def staged_retrieval(datastore):
    """Retrieval over ``datastore`` (a folder, or a real model's by name: ``smollm2-135m/retrieval``, built on
    first use) for a draft model staged on retrieval by name; one line where no datastore is recorded."""
    from specdec.drafters.retrieval import Retrieval

    if not datastore:
        raise InvalidArgumentError("a draft model staged on retrieval by name needs its folder to record a datastore "
                                   "(bench --record writes staged_datastore): pass a Retrieval with its datastore")
    return Retrieval(datastore)


def copies(draft, target, rows: int = 256) -> bool:
    """Whether a native draft model is a copy of a native target: the same layers, heads, RoPE and
    attention windows, and token embeddings that agree (mean cosine above 0.99 over ``rows`` rows spread
    over the vocabulary; a quantized copy's are about 0.995, another model's about 0), so the target's
    keys and values stand for the draft's own."""
    if not (isinstance(draft, NativeBackend) and isinstance(target, NativeBackend)):
        return False
    a, b = draft.model, target.model
    shape = lambda m: (len(m.layers), m.heads, m.kv_heads, m.head_dim, m.hidden_size, tuple(m.embed.shape),
                       tuple(layer.window for layer in m.layers))
    if shape(a) != shape(b) or not torch.equal(a.inv_freq, b.inv_freq):
        return False
    index = torch.linspace(0, a.embed.shape[0] - 1, rows).long()
    agree = torch.nn.functional.cosine_similarity(a.embed[index].float(), b.embed[index].float(), dim=1)
    return bool(agree.mean() > 0.99)


CATCH_UP = 2  # a copy of the target further behind than this takes the target's cache (drafting: at most 2)


class DraftModelSession:
    def __init__(self, backend, context: DecodeContext, batch_size: int, target_vocab: int,
                 vocabulary: torch.Tensor | None = None, adopts_prompt: bool = False, p_min: float | None = None,
                 staged=None, staged_guesses: int = STAGED_GUESSES):
        self.p_min = p_min
        self.staged, self.staged_guesses = staged, staged_guesses  # a session of the drafter drafting for this one
        self.vocabulary = vocabulary  # the target ids of the head's rows, or None: the whole head
        self.adopts_prompt = adopts_prompt  # a copy of the target: the target's keys and values of the prompt
        self.sampling = context.sampling
        self.generator = context.generator
        self.pad = context.target.pad_token_id
        self.target_vocab = target_vocab
        self.cache = backend.new_cache(batch_size, context.cache_capacity)
        self.tree = context.tree
        self.tree_base: torch.Tensor | None = None  # [B] committed tokens in the cache below a tree
        self.target_cache = None  # a copy's: the target's cache of these rows, taken again to catch up

    def adopt_prompt(self, cache) -> None:
        """After the target's prefill: its cache of the prompt becomes this cache's (a copy of the target).
        ``cache`` becomes the batch's: rows that join or leave join or leave it as they do this session."""
        if self.adopts_prompt:
            self.cache.adopt(cache)
            self.target_cache = cache

    def _catch_up(self, seqs: Sequences) -> None:
        """A copy of the target that fell behind by more than ``CATCH_UP`` tokens (steps that did not
        draft: a load-aware policy decoding plainly under load) takes the target's cache, which holds
        every committed token but the pending one, instead of reading the tokens it missed: one copy of
        the cache instead of a pass of the quantized products over every missed token of every row
        (measured: 16 rows 17 tokens behind, 280 ms for the pass)."""
        if self.target_cache is not None and int((seqs.lengths - self.cache.lengths).max()) > CATCH_UP:
            self.cache.adopt(self.target_cache)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary width (padded embeddings may differ in size; a draft
        vocabulary's logits go to their tokens, -inf elsewhere)."""
        if self.vocabulary is not None:
            return over_vocabulary(logits, self.vocabulary, self.target_vocab)
        width = logits.shape[-1]
        if width == self.target_vocab:
            return logits
        if width > self.target_vocab:
            return logits[..., : self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _next(self, logits: torch.Tensor):
        """Draft token and (when sampling) its distribution from logits [B, V]."""
        if self.vocabulary is not None:
            return draft_from(logits, self.vocabulary, self.target_vocab, self.sampling, self.generator)
        logits = self._fit_vocab(logits.float())
        if self.sampling.greedy:
            return kernels.argmax(logits), None
        probs = probabilities(logits, self.sampling)
        return sample(probs, self.generator), probs

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        self._catch_up(seqs)
        if self.staged is not None and self.tree is None:
            return self._propose_staged(seqs, k)
        # Catch up on committed tokens this cache has not seen (ragged: left-padded with holes).
        tokens, valid = seqs.window(self.cache.lengths, seqs.lengths, self.pad)
        logits, _ = self.cache.forward(tokens, valid, logits_to_keep=1)
        if self.tree is not None:
            return self._propose_tree(logits[:, -1])
        stop = ConfidenceStop(self.p_min, seqs.batch_size, tokens.device)
        for step in range(k):
            if step:  # None: every row live
                logits, _ = self.cache.forward(stop.drafts[-1][:, None], None, logits_to_keep=1)
            token, probs = self._next(logits[:, -1])
            if not stop.take(token, probs, logits[:, -1]):
                break
        return stop.proposal()

    def _propose_staged(self, seqs: Sequences, k: int) -> Proposal:
        """Greedy chains of k, several drafts a pass where the staged drafter guesses them (see DraftModel).

        Each pass reads, per row, the tokens this cache has not seen (left-padded) and then that row's
        guesses (right-padded with holes). Its argmax after the last unseen token and after each guess is
        what drafting one token a pass drafts there as long as the guesses before it agree, so a row keeps
        its leading agreeing guesses and the argmax after them; the cache keeps those guesses, and that
        last argmax is the next pass's unseen token. ``p_min`` cuts each draft as the one-token loop does."""
        batch, device = seqs.batch_size, seqs.tokens.device
        # the committed tokens and the drafts so far, what the guesser reads (room for a pass past k)
        context = Sequences.widened(seqs, k + self.staged_guesses + 1, self.pad)
        # per row in Python lists (a few rows; after a pass streams the weights, every small tensor operation
        # costs tens of microseconds): the drafts so far and whether the row drafts on (below k, not cut)
        drafts: list[list[int]] = [[] for _ in range(batch)]
        going = [True] * batch
        unseen, unseen_valid = seqs.window(self.cache.lengths, seqs.lengths, self.pad)
        while True:
            room = [k - len(row) if on else 0 for row, on in zip(drafts, going)]
            width = min(self.staged_guesses, max(room) - 1)  # no guess past k
            guesses, lengths = unseen.new_zeros(batch, 0), [0] * batch
            if width > 0:
                guess = self.staged.propose(context, width)
                guesses = guess.tokens[:, :width]
                lengths = [min(n, width) if on else 0 for n, on in zip(guess.lengths.tolist(), going)]
            width = guesses.shape[1]
            guessed = torch.tensor([[j < n for j in range(width)] for n in lengths], dtype=torch.bool,
                                   device=device).view(batch, width)
            before = self.cache.lengths.clone()
            logits, _ = self.cache.forward(torch.cat([unseen, guesses], 1), torch.cat([unseen_valid, guessed], 1),
                                           logits_to_keep=width + 1)
            kept, chosen = self._agreeing(logits, guesses, torch.tensor(lengths, device=device))
            new = [min(n + 1, left) for n, left in zip(kept.tolist(), room)]
            if self.p_min is not None:  # each draft's own top probability, as ConfidenceStop reads it
                sure = (top_probability(logits) >= self.p_min).long().cumprod(1).sum(1).tolist()
                going = [on and s >= n for on, s, n in zip(going, sure, new)]
                new = [min(n, s) for n, s in zip(new, sure)]
            for row, (tokens, n) in enumerate(zip(chosen.tolist(), new)):
                drafts[row] += tokens[:n]
            context.append(chosen, torch.tensor(new, device=device))
            going = [on and len(row) < k for on, row in zip(going, drafts)]
            self.cache.truncate(before + unseen_valid.sum(1) + kept)
            if not any(going):
                counts = [len(row) for row in drafts]
                width = max(counts)
                return Proposal(torch.tensor([row + [0] * (width - len(row)) for row in drafts], dtype=torch.long,
                                             device=device).view(batch, width), torch.tensor(counts, device=device))
            unseen = chosen.gather(1, kept[:, None])
            unseen_valid = torch.tensor(going, device=device)[:, None]

    def _agreeing(self, logits: torch.Tensor, guesses: torch.Tensor, lengths: torch.Tensor):
        """A staged pass's outcome from its logits [B, W + 1, V] and the guesses [B, W] it read (a row's first
        ``lengths`` real): (kept [B], its leading guesses equal to the drafts; chosen [B, W + 1], the drafts
        after the unseen tokens and after each guess, meaningful up to column kept). Greedy over the whole
        vocabulary, one kernel call (argmax only where a row gets to); otherwise the argmax of every column."""
        batch, width = guesses.shape
        found = None
        if self.vocabulary is None and logits.shape[-1] == self.target_vocab:
            found = kernels.greedy_accept(logits, guesses, lengths)
        if found is not None:
            kept, following = found
            chosen = torch.cat([guesses, following[:, None]], 1)  # the guesses kept are the drafts there
            return kept, chosen.scatter_(1, kept[:, None], following[:, None])
        chosen = self._next(logits.reshape(batch * (width + 1), -1))[0].view(batch, width + 1)
        guessed = torch.arange(width, device=guesses.device) < lengths[:, None]
        return ((chosen[:, :width] == guesses) & guessed).long().cumprod(1).sum(1), chosen

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [..., V] that rank tree candidates (warped when sampling)."""
        logits = self._fit_vocab(logits.float())
        if self.sampling.greedy:
            return torch.log_softmax(logits, dim=-1)
        return probabilities(logits, self.sampling).log()

    def _propose_tree(self, root_logits: torch.Tensor) -> Proposal:
        """A dynamic tree as EAGLE-2 builds it (tree.py), with this draft model (root_logits: [B, V])."""
        cache = self.cache
        self.tree_base = cache.lengths.clone()

        def expand(frontier_token, parent_slot, sees, depth):
            batch, width = frontier_token.shape
            positions = (self.tree_base - 1)[:, None] + depth
            everyone = torch.ones(batch, width, dtype=torch.bool, device=frontier_token.device)
            logits, _ = cache.forward(frontier_token, everyone, logits_to_keep=width, block_mask=sees,
                                      positions=positions.expand(batch, width))
            return self._scores(logits)

        return dynamic_tree(self._scores(root_logits), expand, self.tree)

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        if self.tree_base is not None:  # drop the whole draft tree; the next step feeds the accepted path
            self.cache.truncate(self.tree_base)
            self.tree_base = None
            self.cache.compact()
            return
        # The cache holds context + the first k-1 drafts; keep what the target accepted of them.
        # seqs.lengths now counts the accepted drafts and one target token on top of the old context.
        self.cache.truncate(torch.minimum(self.cache.lengths, seqs.lengths - 1))
        self.cache.compact()

    def select_rows(self, index: torch.Tensor) -> None:
        self.cache.select_rows(index)

    def extend(self, other: "DraftModelSession") -> None:
        self.cache.extend(other.cache)
