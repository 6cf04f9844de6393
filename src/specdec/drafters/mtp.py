"""Multi-token prediction: the target drafts with its own MTP modules (DeepSeek-V3) or extra heads.

Sequential modules (one KV cache per module, native backend). Slot i of module k reads h^{k-1}_i
and token i + k and predicts token i + k + 1; module 1 reads the target's final-normed hidden
state. After each verification ``observe`` enters the newly committed slots of every module: the
tokens are the same for every module (the last m committed tokens, pending one included), and
module k's previous states are module k-1's outputs one slot earlier (its last committed output
from the step before, then this step's). Drafting then runs, for module k, the k - 1 slots whose
tokens are drafts, each module's last output giving the next draft; past the last module it is
reused autoregressively, fed its own output (as vLLM runs one MTP layer for k > 1). Every drafted
slot is dropped afterwards: the caches hold committed slots only.

Parallel heads: head i reads the trunk (the input of the target's last layer) at the last
committed position and predicts i tokens past the pending one, so a step drafts min(k, heads)
tokens, all from one position, with nothing to roll back.

On the transformers backend the modules are recomputed over each row's committed context at every
step (transformers' own ``MtpModel`` layers for sequential modules, so any checkpoint it reads
works, DeepSeek-V3's included; specdec's heads for the parallel design): the same drafts without
their caches.
"""

from __future__ import annotations

import torch

from specdec.backends.target import resolve_model
from specdec.batch import Sequences
from specdec.drafters.base import (ConfidenceStop, DecodeContext, DeferredObserve, FeatureSpec, Proposal,
                                   TargetFeatures, check_p_min, cut_label, draft_from, read_draft_vocabulary,
                                   recorded_defaults)
from specdec.errors import DrafterMismatchError, UnsupportedModelError


class MTP:
    """Draft with the target's own MTP modules or heads (the first ``depth`` of them; None: all), or with
    sequential modules trained on the unchanged target and kept in a folder of their own (``modules``:
    ``specdec train mtp`` on a real target; native backend). ``p_min`` (llama.cpp's ``--draft-p-min``): a
    row's chain stops before its first draft whose most likely token the modules give less than ``p_min``
    (``ConfidenceStop``; on the transformers backend the drafts are computed to k and the proposal cut);
    None: the one the modules' folder records (``bench --record``), else no cut; 0: no cut."""

    name = "mtp"

    def __init__(self, depth: int | None = None, modules: str | None = None, p_min: float | None = None):
        if depth is not None and int(depth) < 1:
            raise DrafterMismatchError(f"MTP depth must be >= 1, got {depth}")
        self.depth = None if depth is None else int(depth)
        self.modules = None if modules is None else str(resolve_model(modules))  # or by name: smollm2-135m/mtp
        if self.modules is not None:
            self._record, self._config = modules_record(self.modules)
            self.default_draft_tokens, _ = recorded_defaults(self.modules)  # bench --record's fastest k
        self.p_min = check_p_min(p_min, self.modules)
        self.features = FeatureSpec()
        self._loaded: dict = {}

    @property
    def setting(self) -> str:
        """What bench labels tell apart: the cut."""
        return cut_label(self.p_min)

    def modules_for(self, target):
        """(MtpConfig or None for transformers' modules, the modules in the form the backend runs)."""
        key = (id(target), target.backend.dtype)
        if key not in self._loaded:
            self._loaded = {key: self._load(target)}
        return self._loaded[key]

    def _load(self, target):
        from specdec.backends import hf
        from specdec.models import mtp

        native = getattr(target.backend, "name", "") == "native"
        if self.modules is not None:  # modules kept apart: read from their folder, checked against the record
            folder, config = self.modules, self._config
            self._check_record(target, native)
        elif target.path is None:
            raise UnsupportedModelError("MTP drafting reads the modules from the target's folder; load the target "
                                        "with specdec.load_target(DIR)")
        else:
            folder, config = target.path, mtp.MtpConfig.from_config(target.config, f"{target.path}/config.json")
        if config is None and not hf.mtp_layer_count(target.config):
            raise DrafterMismatchError(f"{target.name} has no MTP modules or heads (its config.json declares "
                                       f"neither num_nextn_predict_layers nor specdec_mtp): use another drafter, "
                                       f"or train them with `specdec train mtp`")
        if config is None or (not native and config.design == "sequential"):
            if native:  # a foreign Llama-family checkpoint with DeepSeek-style modules
                config = mtp.MtpConfig.of(target.config, "sequential", hf.mtp_layer_count(target.config))
            else:
                modules = hf.mtp_model(target.model)
                depth = self._depth(len(modules.layers), target)
                return "sequential", depth, modules
        net = mtp.read_mtp(folder, self._depth(config.depth, target))
        if native:
            from specdec.drafters.eagle import require_kernels

            require_kernels(target, "MTP modules")
            vocabulary = None if self.modules is None else read_draft_vocabulary(self.modules, target.vocab_size)
            runtime = mtp.MtpRuntime(net, target.input_embeddings(), target.output_head(), target.backend.dtype,
                                     vocabulary)
            return config.design, runtime.depth, runtime
        return config.design, net.config.depth, net.to(target.backend.dtype)

    def _check_record(self, target, native: bool) -> None:
        """Modules kept apart fit ``target`` (else one line) and run natively; a warning when only the
        target's weights differ from those they were trained beside."""
        import warnings

        if not native:
            raise UnsupportedModelError(f"MTP modules kept apart from the target ({self.modules}) run on the native "
                                        "backend; load the target with backend='native'")
        warning = self._record.check(target, f"the MTP modules in {self.modules}", self._config.hidden_size,
                                     target.vocab_size)
        if warning:
            warnings.warn(warning, stacklevel=4)

    def _depth(self, available: int, target) -> int:
        if self.depth is None:
            return available
        if self.depth > available:
            raise DrafterMismatchError(f"{target.name} has {available} MTP modules, asked for depth {self.depth}")
        return self.depth

    def start(self, context: DecodeContext, seqs: Sequences):
        target = context.target
        if context.tree is not None:
            raise UnsupportedModelError("MTP drafting builds chains, not token trees; drop --tree")
        design, depth, modules = self.modules_for(target)
        layers = int(target.num_layers)
        self.features = FeatureSpec(hidden_layers=(layers,) if design == "sequential" else (layers - 1,))
        if getattr(target.backend, "name", "") == "native":
            kind = NativeSequential if design == "sequential" else NativeParallel
            # steps that do not draft run no module
            return DeferredObserve(kind(modules, context, seqs.batch_size, self.p_min), seqs.batch_size)
        return RecomputeSession(design, depth, modules, target, context, seqs.batch_size, self.p_min)


class Drafting:
    """Draft tokens (and distributions when sampling) from logits [B, V], each row's chain cut before its
    first unsure draft (``p_min``, ConfidenceStop)."""

    def __init__(self, context: DecodeContext, p_min: float | None = None):
        self.sampling, self.generator = context.sampling, context.generator
        self.pad, self.vocab = context.target.pad_token_id, context.target.vocab_size
        self.p_min = p_min

    def take(self, chain: ConfidenceStop, logits: torch.Tensor, ids: torch.Tensor | None) -> bool:
        """Draft from ``logits`` [B, V] (``ids``: the target id of each logit's slot, a draft vocabulary;
        None: the whole vocabulary) into ``chain``; False when no row is sure enough of it."""
        token, probs = draft_from(logits, ids, self.vocab, self.sampling, self.generator)
        return chain.take(token, probs, logits)


def shift_in(last: torch.Tensor, out: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Right-aligned outputs [B, m, H] moved one slot later: each row's first valid column gets ``last``
    [B, H] (the output of the slot before it), column j the output of column j - 1."""
    shifted = out.roll(1, dims=1)
    first = (valid.shape[1] - valid.sum(1)).clamp(max=valid.shape[1] - 1)  # [B] each row's first valid column
    shifted[torch.arange(out.shape[0], device=out.device), first] = last.to(shifted.dtype)
    return shifted


class NativeModules(Drafting):
    """What both native designs keep: one KV cache per module or head, and each one's output at its
    last committed slot."""

    def __init__(self, runtime, context: DecodeContext, batch_size: int, p_min: float | None = None):
        super().__init__(context, p_min)
        self.runtime = runtime
        self.caches = [runtime.new_cache(i, batch_size, context.cache_capacity) for i in range(runtime.depth)]
        self.last: list[torch.Tensor] = []   # per module [B, H]

    def select_rows(self, index: torch.Tensor) -> None:
        for cache in self.caches:
            cache.select_rows(index)
        self.last = [value.index_select(0, index) for value in self.last]

    def extend(self, other: "NativeModules") -> None:
        for cache, theirs in zip(self.caches, other.caches):
            cache.extend(theirs)
        self.last = [torch.cat([mine, theirs]) for mine, theirs in zip(self.last, other.last)]


class NativeSequential(NativeModules):
    def __init__(self, runtime, context: DecodeContext, batch_size: int, p_min: float | None = None):
        super().__init__(runtime, context, batch_size, p_min)
        self.base: list[torch.Tensor] | None = None

    def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
        width = features.states.shape[1]
        tokens, _ = seqs.window(seqs.lengths - width, seqs.lengths, self.pad)  # token i + k of every module's slot
        column = torch.arange(width, device=tokens.device)
        previous = features.states[:, :, 0]
        last = []
        for index, cache in enumerate(self.caches):
            if index:
                stale = self.last[index - 1] if self.last else torch.zeros_like(previous[:, 0])
                previous = shift_in(stale, previous, features.valid)
            # slot of column j: lengths - width + j - index (1-based); slots before the first token do not exist
            valid = features.valid & (seqs.lengths[:, None] - width + column[None, :] - index >= 1)
            previous = cache.run(tokens, previous, valid)
            last.append(previous[:, -1])
        self.last = last

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        runtime = self.runtime
        self.base = [cache.lengths.clone() for cache in self.caches]
        chain = ConfidenceStop(self.p_min, self.last[0].shape[0], self.last[0].device)
        if not self.take(chain, runtime.logits(0, self.last[0]), runtime.draft_ids):
            return chain.proposal()
        # Module i drafts at slots n + 1 - i .. n (n: the last committed position): their tokens are
        # drafts 1 .. i, their previous states module i - 1's last committed output and drafted outputs.
        outputs = self.last[0][:, :0, None].expand(-1, 0, self.last[0].shape[1])  # module 0 drafts no slot
        for index in range(1, min(k, runtime.depth)):
            previous = torch.cat([self.last[index - 1][:, None], outputs], dim=1)  # [B, index, H]
            outputs = self.caches[index].run(torch.stack(chain.drafts, dim=1), previous)
            if not self.take(chain, runtime.logits(index, outputs[:, -1]), runtime.draft_ids):
                return chain.proposal()
        final = self.caches[runtime.depth - 1]
        out = outputs[:, -1] if outputs.shape[1] else self.last[runtime.depth - 1]
        while len(chain.drafts) < k:  # past the last module: reuse it, fed its own output
            out = final.run(chain.drafts[-1][:, None], out[:, None])[:, -1]
            if not self.take(chain, runtime.logits(runtime.depth - 1, out), runtime.draft_ids):
                break
        return chain.proposal()

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        if self.base is not None:
            for cache, base in zip(self.caches, self.base):
                cache.truncate(base)
                cache.compact()
            self.base = None


class NativeParallel(NativeModules):
    def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
        trunk = features.states[:, :, 0]
        dummy = torch.zeros(trunk.shape[:2], dtype=torch.long, device=trunk.device)
        self.last = [cache.run(dummy, trunk, features.valid)[:, -1] for cache in self.caches]

    def propose(self, seqs: Sequences, k: int) -> Proposal:
        chain = ConfidenceStop(self.p_min, self.last[0].shape[0], self.last[0].device)
        for index in range(min(k, self.runtime.depth)):
            if not self.take(chain, self.runtime.logits(index, self.last[index]), self.runtime.draft_ids):
                break
        return chain.proposal()

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass  # drafting adds nothing to the heads' caches


class RecomputeSession(Drafting):
    """Transformers backend: per row, the modules over its whole committed context at every step."""

    def __init__(self, design: str, depth: int, modules, target, context: DecodeContext, batch_size: int,
                 p_min: float | None = None):
        super().__init__(context, p_min)
        self.design, self.depth, self.modules = design, depth, modules
        self.head = target.model.get_output_embeddings()
        self.states: list[torch.Tensor] = [None] * batch_size  # per row [n, H]: features of committed tokens

    def observe(self, seqs: Sequences, features: TargetFeatures) -> None:
        for row in range(features.states.shape[0]):
            new = features.states[row, features.valid[row], 0]
            old = self.states[row]
            self.states[row] = new if old is None else torch.cat([old, new], dim=0)

    @torch.inference_mode()
    def propose(self, seqs: Sequences, k: int) -> Proposal:
        rows = []
        for row, states in enumerate(self.states):
            tokens = seqs.tokens[row, : int(seqs.lengths[row])]
            rows.append(self._row(states, tokens, k))
        # every row drafted to k; the cut then reads each draft's distribution, position by position
        stop = ConfidenceStop(self.p_min, len(rows), seqs.tokens.device)
        for j in range(len(rows[0][0])):
            probs = None if self.sampling.greedy else torch.stack([r[1][j] for r in rows])
            if not stop.take(torch.stack([r[0][j] for r in rows]), probs, torch.stack([r[2][j] for r in rows])):
                break
        return stop.proposal()

    def _row(self, states: torch.Tensor, tokens: torch.Tensor, k: int):
        """(drafts, their distributions when sampling, their logits) of one row: states [n, H] of tokens
        1..n, tokens [n + 1] (the pending one last)."""
        n = states.shape[0]
        positions = torch.arange(1, n + 1, device=states.device)[None]
        drafts, dists, scores = [], [], []

        def take(logits):
            token, probs = draft_from(logits[None], None, self.vocab, self.sampling, self.generator)
            drafts.append(token[0])
            dists.append(None if probs is None else probs[0])
            scores.append(logits)

        if self.design == "parallel":
            for head in self.modules.modules_[: min(k, self.depth)]:
                take(self.head(head(states[None], positions))[0, -1].float())
            return drafts, dists, scores
        previous, following = states[None], tokens[1:][None]  # slot i: h^{k-1}_i and token i + k
        for index in range(min(k, self.depth)):
            out = self.modules.forward_layer(index, previous, positions + index, None, input_ids=following)
            take(self.modules._project_to_logits(out[:, -1]).float()[0])
            if len(drafts) < min(k, self.depth):
                previous, following = out, torch.cat([following[:, 1:], drafts[-1][None, None]], dim=1)
        while len(drafts) < k:  # past the last module: one slot further, fed its own output
            previous = torch.cat([previous, out[:, -1:]], dim=1)
            following = torch.cat([following, drafts[-1][None, None]], dim=1)
            positions = torch.arange(1, previous.shape[1] + 1, device=states.device)[None]
            out = self.modules.forward_layer(self.depth - 1, previous, positions + self.depth - 1, None,
                                             input_ids=following)
            take(self.modules._project_to_logits(out[:, -1]).float()[0])
        return drafts, dists, scores

    def accepted(self, seqs: Sequences, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, index: torch.Tensor) -> None:
        self.states = [self.states[i] for i in index.tolist()]

    def extend(self, other: "RecomputeSession") -> None:
        self.states = self.states + other.states


def modules_record(folder: str):
    """(target record, MtpConfig) of a folder of MTP modules trained on a frozen target; one line when the
    folder is missing, unreadable or not such a folder."""
    import json
    from pathlib import Path

    from specdec.errors import ModelLoadError
    from specdec.models.eagle import TargetRecord
    from specdec.models.mtp import MODULES_KEY as MTP_MODULES_KEY, MtpConfig

    file = Path(folder) / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from None
    record = data.get(MTP_MODULES_KEY) if isinstance(data, dict) else None
    if not isinstance(record, dict) or "specdec_mtp" not in data:
        raise ModelLoadError(f"{folder} is not a folder of MTP modules (its config.json lacks specdec_mtp and "
                             f"{MTP_MODULES_KEY}; `specdec train mtp --target <real model>` writes one)")
    try:
        return TargetRecord(**record), MtpConfig.from_config(data, str(file))
    except TypeError as exc:
        raise ModelLoadError(f"malformed {MTP_MODULES_KEY} in {file}: {exc}") from None


def is_modules_folder(folder) -> bool:
    """Whether ``folder`` holds MTP modules apart from their target (else: a model with modules of its own)."""
    import json
    from pathlib import Path

    from specdec.models.mtp import MODULES_KEY

    try:
        return MODULES_KEY in json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
