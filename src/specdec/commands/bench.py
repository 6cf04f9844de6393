"""`specdec bench`: specdec's methods and transformers' own implementations, interleaved in one run.

Every method decodes the same prompts greedily; the bench checks that all outputs are identical and
reports tau, alpha, tokens/s, speedup over specdec's plain decoding and the ratio over the
transformers implementation of the same method. Timings are ratios within one run: the methods
take turns on each prompt (in rotating order), so drifts in machine speed hit all of them alike.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from tqdm import tqdm

from specdec.backends import hf
from specdec.decode import GenerationConfig
from specdec.engine import generate_ids
from specdec.drafters import DraftModel, NoDraft, PromptLookup
from specdec.backends.costs import forward_time, forward_times, least_times
from specdec.drafters.base import TreeConfig
from specdec.errors import InvalidArgumentError
from specdec.sampling import SamplingConfig
from specdec.backends.target import Target

PLAIN, DRAFT_MODEL, PROMPT_LOOKUP, DFLASH, DSPARK = "plain", "draft-model", "prompt-lookup", "dflash", "dspark"
WARM_UP_TOKENS = 16  # each method's untimed first run
BLOCK_DRAFTERS = (DFLASH, DSPARK)  # chains of one block per step: k follows --block-sizes
EARLY_EXIT, MTP, LOOKAHEAD = "early-exit", "mtp", "lookahead"


@dataclass
class Engine:
    """What specdec runs on one backend: the target, optionally its draft model, and trained drafters
    ((registry name, drafter) pairs: Medusa, EAGLE, ...)."""

    target: Target
    draft: DraftModel | None = None
    drafters: tuple = ()
    variant: str = ""            # a model of its own (a self-drafting variant), named in labels; "": the target
    sampling: SamplingConfig = SamplingConfig()  # greedy, or the sampling every specdec method runs with

    @property
    def backend(self) -> str:
        return self.target.backend.description


@dataclass
class Method:
    family: str                  # plain | draft-model | prompt-lookup
    impl: str                    # specdec | transformers
    k: int | None
    batch_size: int
    run: Callable                # list[list[int]] -> (outputs, Stats | None)
    engine: Engine | None = None  # specdec's methods: the backend they run on
    tag: str = ""                # the backend (or the variant model) in labels, when a bench compares several
    model: str = ""              # the variant model it runs on ("": the target); outputs compare within a model
    tree: TreeConfig | None = None  # token trees instead of chains of k
    new_tokens: int = 0
    seconds: float = 0.0
    tau_tokens: int = 0          # tokens committed by verification steps
    tau_steps: int = 0           # verification row-steps
    drafts_accepted: int = 0
    drafts_evaluated: int = 0
    k_sum: int = 0               # drafts proposed over all row-steps (for the mean k)
    decode_seconds: float = 0.0  # specdec: time after prefill (the steps the efficiency is about)
    decode_tokens: int = 0       # specdec: tokens those steps produced
    feature_seconds: float = 0.0  # specdec: handing the target's features to the drafter
    draft_seconds: float = 0.0   # specdec: the drafter's own time (propose, accepted, observe)
    steps: int = 0               # specdec: batched verification steps
    drafting_steps: int = 0      # specdec: those that drafted (a plain step carries no lookahead window)
    note: str = ""               # what the label adds (a drafter's own static tree, the policy)
    policy: str | None = None    # specdec: the policy's text (schedule.parse_policy); None: fixed k
    accepted_at: list = field(default_factory=list)  # specdec: row-steps accepting >= j+1 drafts (depths, trees)
    proposed_at: list = field(default_factory=list)  # specdec: row-steps proposing >= j+1 drafts
    outputs: list = field(default_factory=list)
    drafter: object = field(default=None, repr=False)  # specdec: what drafts (the efficiency's draft cost)
    # task -> [new tokens, seconds, tokens committed by verification, row-steps] of the chunks of one task
    by_task: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        k = f" k={self.k}" if self.k else ""
        if self.tree is not None:
            k = f" tree={self.tree.depth}/{self.tree.topk}/{self.tree.num_nodes}"
        if self.note:
            k += f" {self.note}"
        batch = f" batch={self.batch_size}" if self.batch_size > 1 else ""
        tag = f"[{self.tag}]" if self.tag else ""
        return f"{self.impl}{tag} {self.family}{k}{batch}"

    @property
    def tau(self) -> float | None:
        return self.tau_tokens / self.tau_steps if self.tau_steps else None

    @property
    def alpha(self) -> float | None:
        return self.drafts_accepted / self.drafts_evaluated if self.drafts_evaluated else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def specdec_method(engine: Engine, family: str, drafter, k: int | None, max_new_tokens: int, batch_size: int,
                   tag: str = "", tree: TreeConfig | None = None, note: str = "", policy: str | None = None):
    """policy: a policy's text (load-aware, confidence, conf-min:X, ...): k drafts at most, as many per
    step as it chooses; labelled with it."""
    config = GenerationConfig(num_draft_tokens=k or 1, max_new_tokens=max_new_tokens, tree=tree,
                              sampling=engine.sampling)
    chooser = None
    if policy:
        from specdec.schedule import parse_policy

        chooser = parse_policy(policy)  # one per method: it profiles once and keeps learning
        note = f"{note} {policy}".strip()

    def run(prompts, max_new_tokens=None):
        out = generate_ids(engine.target, prompts, drafter,
                           config if max_new_tokens is None else replace(config, max_new_tokens=max_new_tokens),
                           chooser)
        return out.token_ids, out.stats
    return Method(family, "specdec", None if tree else k, batch_size, run, engine, tag, engine.variant, tree, note=note,
                  policy=policy, drafter=drafter)


def policy_methods(engine: Engine, family: str, drafter, k: int, policies, max_new_tokens: int, batch_size: int,
                   tag: str = "", note: str = "") -> list:
    """The drafter once more under each policy that can drive it, up to k drafts per step (the
    confidence policies need a drafter with a confidence head)."""
    from specdec.schedule import parse_policy

    return [specdec_method(engine, family, drafter, k, max_new_tokens, batch_size, tag, note=note, policy=policy)
            for policy in policies
            if not getattr(parse_policy(policy), "needs_confidence", False) or getattr(drafter, "has_confidence", False)]


class ForwardCounter:
    """Counts a model's verification passes (transformers does not report them): the passes through its
    last decoder layer, which drafting never reaches, not even an early-exit assistant of the same model."""

    def __init__(self, model):
        self.count = 0
        layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
        (layers[-1] if layers is not None and len(layers) else model).register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


def transformers_method(target: Target, model, family: str, draft_model, k: int | None, max_new_tokens: int,
                        max_ngram: int, counter: ForwardCounter, note: str = "", variant: str = "",
                        exit_layer: int | None = None):
    """transformers' generate() on ``model`` (the target's weights as a transformers model); on a
    variant, its early-exit assistant (``exit_layer``) or its MTP layers."""
    extra = {}
    if family in (DRAFT_MODEL, DFLASH):
        extra = {"assistant_model": draft_model}
    if family == DFLASH:
        extra["speculation_type"] = "dflash"
    elif family == PROMPT_LOOKUP:
        extra = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": max_ngram}
    elif family == EARLY_EXIT:  # k drafts every step, no confidence-based early stop, as specdec drafts
        extra = {"assistant_early_exit": exit_layer, "num_assistant_tokens": k,
                 "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    elif family == MTP:
        extra = {"use_mtp": True}
    eos = list(target.eos_token_ids) or None

    def run(prompts, max_tokens=None):
        (prompt,) = prompts
        if family == DRAFT_MODEL:
            # transformers reads these from the assistant's config, shared by every k: set them per run.
            # The same drafting rule as specdec's: k drafts every step, no confidence-based early stop.
            draft_model.generation_config.num_assistant_tokens = k
            draft_model.generation_config.num_assistant_tokens_schedule = "constant"
            draft_model.generation_config.assistant_confidence_threshold = 0.0
        if family == DFLASH:  # its candidate generator reads the block from the assistant's config
            draft_model.config.block_size = k + 1
        ids = torch.tensor([prompt], device=target.device)
        before = counter.count
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=max_tokens or max_new_tokens, pad_token_id=target.pad_token_id,
                                        eos_token_id=eos, **extra)
        tokens = out[0, len(prompt):].tolist()
        if eos is not None:  # transformers pads nothing at batch 1, but cut after EOS to be sure
            for i, token in enumerate(tokens):
                if token in eos:
                    tokens = tokens[: i + 1]
                    break
        return [tokens], counter.count - before
    return Method(family, "transformers", k, 1, run, tag=variant, model=variant, note=note)


def transformers_model(model: Target | DraftModel):
    """The transformers model of a target or draft model: its own, or loaded from its folder."""
    if model.model is not None:
        return model.model
    if model.path is None:
        raise InvalidArgumentError("transformers' methods need the transformers model (pass transformers_models=)")
    return hf.load_causal_lm(model.path, dtype=model.backend.dtype, device=model.backend.device)


def build_methods(engines: list[Engine], ks: list[int], max_new_tokens: int, batch_sizes: list[int],
                  max_ngram: int, min_ngram: int, reference: tuple | None, trees: tuple = (),
                  block_sizes: tuple = (), policies: tuple = (), recorded: bool = False,
                  reference_families: tuple = (DRAFT_MODEL, PROMPT_LOOKUP, DFLASH)):
    """specdec's methods on every engine; transformers' on ``reference`` = (model, draft model or None),
    and transformers' DFlash on the same weights when a DFlash drafter is measured. ``policies``: each
    chain drafter also under each policy (schedule.parse_policy's texts), up to its largest k.
    ``recorded``: the draft model and the trained drafters each at the one setting their folders record
    (own_setting) instead of every k and tree. ``reference_families``: transformers' methods beside its
    plain decoding."""
    methods = []
    lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)
    several = len([e for e in engines if not e.variant]) > 1
    for engine in engines:
        tag = engine.variant or (engine.backend if several else "")
        if engine.variant:  # a self-drafting variant: its plain decoding and its own drafter
            for batch_size in batch_sizes:
                methods.append(specdec_method(engine, PLAIN, NoDraft(), None, max_new_tokens, batch_size, tag))
                methods += drafter_methods(engine, ks, trees, max_new_tokens, batch_size, tag, block_sizes, policies)
            continue
        draft_ks, draft_trees = own_setting(engine.draft, ks) if recorded and engine.draft else (ks, trees)
        for batch_size in batch_sizes:
            methods.append(specdec_method(engine, PLAIN, NoDraft(), None, max_new_tokens, batch_size, tag))
            for k in ks:
                methods.append(specdec_method(engine, PROMPT_LOOKUP, lookup, k, max_new_tokens, batch_size, tag))
            if engine.draft is not None:
                methods += [specdec_method(engine, DRAFT_MODEL, engine.draft, k, max_new_tokens, batch_size, tag,
                                           note=draft_note(engine.draft)) for k in draft_ks]
                # up to the largest k, as many drafts per step as each policy chooses
                methods += policy_methods(engine, DRAFT_MODEL, engine.draft, max(draft_ks or ks), policies,
                                          max_new_tokens, batch_size, tag)
            methods += policy_methods(engine, PROMPT_LOOKUP, lookup, max(ks), policies, max_new_tokens, batch_size, tag)
            for tree in trees:
                methods.append(specdec_method(engine, PROMPT_LOOKUP, lookup, None, max_new_tokens, batch_size, tag,
                                              tree))
            if engine.draft is not None:
                methods += [specdec_method(engine, DRAFT_MODEL, engine.draft, None, max_new_tokens, batch_size, tag,
                                           tree, note=draft_note(engine.draft)) for tree in draft_trees]
            methods += drafter_methods(engine, ks, trees, max_new_tokens, batch_size, tag, block_sizes, policies,
                                       recorded)
    if reference is not None:
        model, draft_model = reference
        target = engines[0].target
        counter = ForwardCounter(model)
        methods.append(transformers_method(target, model, PLAIN, None, None, max_new_tokens, max_ngram, counter))
        for k in ks:
            if draft_model is not None and DRAFT_MODEL in reference_families:
                methods.append(transformers_method(target, model, DRAFT_MODEL, draft_model, k, max_new_tokens,
                                                   max_ngram, counter))
            if PROMPT_LOOKUP in reference_families:
                methods.append(transformers_method(target, model, PROMPT_LOOKUP, None, k, max_new_tokens, max_ngram,
                                                   counter))
        drafter = next((d for n, d in engines[0].drafters if n == DFLASH and DFLASH in reference_families),
                       None)  # the first DFlash named
        if drafter is not None:
            from specdec.models.dflash import hf_assistant

            assistant = hf_assistant(drafter.net, model.config, model.dtype, model.device)
            methods += [transformers_method(target, model, DFLASH, assistant, k, max_new_tokens, max_ngram,
                                            counter, drafter_note(engines[0], DFLASH, drafter))
                        for k in block_ks(drafter, block_sizes)]
    if reference is not None:
        for engine in engines:
            if engine.variant:
                methods += variant_transformers_methods(engine, ks, max_new_tokens, max_ngram)
    return methods


def variant_transformers_methods(engine: Engine, ks, max_new_tokens: int, max_ngram: int) -> list:
    """transformers' own self-speculation on a variant: plain generate, ``assistant_early_exit=E`` at the
    exit layers specdec measures, ``use_mtp=True`` (its modules, one draft each) for MTP modules."""
    from specdec.backends import hf

    target = engine.target
    model = transformers_model(target)
    counter = ForwardCounter(model)
    methods = [transformers_method(target, model, PLAIN, None, None, max_new_tokens, max_ngram, counter,
                                   variant=engine.variant)]
    for name, drafter in engine.drafters:
        if name == EARLY_EXIT and drafter.reuse_kv:
            exit_layer = drafter.exit_for(target)
            methods += [transformers_method(target, model, EARLY_EXIT, None, k, max_new_tokens, max_ngram, counter,
                                            self_note(drafter, target), engine.variant, exit_layer) for k in ks]
        elif name == MTP and hf.enable_mtp(model) and drafter.depth in (None, hf.mtp_layer_count(model.config)):
            depth = hf.mtp_layer_count(model.config)
            methods.append(transformers_method(target, model, MTP, None, depth, max_new_tokens, max_ngram, counter,
                                               self_note(drafter, target), engine.variant))
    return methods


def self_note(drafter, target) -> str:
    """What tells apart the self-drafting settings of one variant: the exit layer and the KV reuse, or the
    MTP depth."""
    if hasattr(drafter, "exit_for"):
        return f"E={drafter.exit_for(target)}" + ("" if drafter.reuse_kv else " recompute")
    return f"depth={drafter.depth}" if drafter.depth else ""


def draft_note(drafter) -> str:
    """A draft model's quantized weight types, when it runs quantized (a GGUF file, or --draft-quantize), and
    the size of its draft vocabulary, when it has one, and its own settings (p_min)."""
    kinds = "+".join(getattr(drafter.backend, "quantized_types", ()))
    vocabulary = getattr(drafter, "vocabulary", None)
    parts = [kinds] + ([f"vocab {vocabulary.numel()}"] if vocabulary is not None else [])
    note = f"({', '.join(filter(None, parts))})" if any(parts) else ""
    return f"{note} {getattr(drafter, 'setting', '')}".strip()  # its own settings (p_min)


def block_ks(drafter, block_sizes) -> list[int]:
    """Drafts per step of each block size measured (default: the drafter's own block): DFlash's block of B
    drafts B - 1 (its anchor slot predicts nothing), DSpark's B (every slot drafts)."""
    smallest = 1 if drafter.name == DSPARK else 2
    sizes = [b for b in block_sizes if smallest <= b <= drafter.config.block_size] or [drafter.block_size]
    return [b - (drafter.name != DSPARK) for b in sizes]


def drafter_note(engine: Engine, name: str, drafter) -> str:
    """Tells apart two drafters of one method measured together by their folders' names (one folder at
    several cuts: their settings, which the labels carry, tell them apart)."""
    same = [d for other, d in engine.drafters if other == name]
    keys = [(Path(getattr(d, "path", "") or getattr(d, "modules", "") or name).name, getattr(d, "setting", ""))
            for d in same]  # MTP modules kept apart from their target: their folder
    if len({folder for folder, _ in keys}) < 2 and len(set(keys)) == len(keys):
        return ""
    index = next(i for i, d in enumerate(same) if d is drafter)
    folder = keys[index][0]
    return f"({folder})" if keys.count(keys[index]) == 1 else f"({folder} #{index + 1})"


def own_setting(drafter, ks) -> tuple[list[int], tuple]:
    """(chain ks, trees) of the one setting ``drafter`` records as its fastest (``bench --record``): its
    tree when it records one, else its k (DFlash, DSpark: their block's; none recorded: the largest of
    ``ks``)."""
    tree = getattr(drafter, "default_tree", None)
    if tree is not None:
        return [], (tree,)
    if drafter.name in BLOCK_DRAFTERS:
        return [drafter.default_draft_tokens], ()
    return [getattr(drafter, "default_draft_tokens", None) or max(ks)], ()


def drafter_methods(engine: Engine, ks, trees, max_new_tokens: int, batch_size: int, tag: str,
                    block_sizes=(), policies=(), recorded: bool = False) -> list:
    """The methods of an engine's trained drafters, as the registry says each drafts (DFlash, DSpark: one
    chain per block size, block_ks), chains also under each of ``policies`` at the largest k.
    ``recorded``: each drafter at the one setting its folder records instead (own_setting)."""
    from specdec.drafters.registry import REGISTRY

    methods = []
    for name, drafter in engine.drafters:
        entry = REGISTRY[name]
        if not entry.chains:  # its own static tree
            note = f"tree={getattr(drafter, 'tree_nodes', '?')} nodes"
            methods.append(specdec_method(engine, name, drafter, None, max_new_tokens, batch_size, tag, note=note))
            continue
        chain_ks = block_ks(drafter, block_sizes) if name in BLOCK_DRAFTERS else ks
        drafter_trees = trees if entry.trees else ()
        if recorded:
            chain_ks, drafter_trees = own_setting(drafter, ks)
        note = self_note(drafter, engine.target) if engine.variant else drafter_note(engine, name, drafter)
        if name == DRAFT_MODEL:
            note = f"{note} {draft_note(drafter)}".strip()  # its settings included
        else:
            note = f"{note} {getattr(drafter, 'setting', '')}".strip()  # a drafter's own settings (lookahead's W/N/G)
        methods += [specdec_method(engine, name, drafter, k, max_new_tokens, batch_size, tag, note=note)
                    for k in chain_ks]
        if chain_ks:
            methods += policy_methods(engine, name, drafter, max(chain_ks), policies, max_new_tokens, batch_size,
                                      tag, note)
        methods += [specdec_method(engine, name, drafter, None, max_new_tokens, batch_size, tag, tree, note=note)
                    for tree in drafter_trees]
    return methods


def _run_timed(method: Method, prompts: list[list[int]]):
    start = time.perf_counter()
    outputs, info = method.run(prompts)
    elapsed = time.perf_counter() - start
    return outputs, info, elapsed


def run_bench(target: Target, prompts: list[list[int]], draft: DraftModel | None = None, ks=(4,),
              max_new_tokens: int = 64, batch_sizes=(1,), repeats: int = 1, max_ngram: int = 3,
              min_ngram: int = 1, with_transformers: bool = True, progress: bool = True,
              more_engines: tuple[Engine, ...] = (), transformers_models: tuple | None = None,
              trees: tuple[TreeConfig, ...] = (), drafters: tuple = (), block_sizes: tuple = (),
              policies: tuple = (), sampling: SamplingConfig | None = None, recorded: bool = False,
              reference_families: tuple = (DRAFT_MODEL, PROMPT_LOOKUP, DFLASH), tasks: list[str] | None = None) -> dict:
    """Run every method on every prompt, interleaved; return the table as a dict.

    ``more_engines`` adds specdec on other backends (e.g. the same model on "hf" beside "native").
    transformers' methods run on ``transformers_models`` = (model, draft model or None), by default
    the target's and draft's own transformers models. ``drafters``: (registry name, drafter) pairs of
    trained drafters measured beside them on the target's engine. ``block_sizes``: DFlash blocks to
    measure (default: each DFlash drafter's own). ``policies``: every chain drafter also under each
    policy (schedule.parse_policy's texts: load-aware, confidence, conf-min:X, ...) that can drive it,
    up to its largest k. ``sampling``: every specdec method samples (the table then reports tau,
    acceptance and speed; the outputs are draws, compared with nothing, and transformers is not run).
    ``recorded``, ``reference_families``: as build_methods takes them. ``tasks``: the task set of each
    prompt; with two or more, each row also reports tau and speed per task (``by_task``: chunks of one task).
    """

    sampling = sampling or SamplingConfig()
    if not sampling.greedy:
        with_transformers = False
    if not prompts:
        raise InvalidArgumentError("no prompts to benchmark")
    if tasks is not None and len(tasks) != len(prompts):
        raise InvalidArgumentError(f"{len(tasks)} task names for {len(prompts)} prompts")
    if any(k < 1 for k in ks):
        raise InvalidArgumentError("every k must be >= 1")
    if any(b < 1 for b in batch_sizes):
        raise InvalidArgumentError("every batch size must be >= 1")
    engines = [replace(engine, sampling=sampling) for engine in (Engine(target, draft, tuple(drafters)), *more_engines)]
    reference = None
    if with_transformers:
        reference = transformers_models or (transformers_model(target), draft and transformers_model(draft))
    if any(b < 1 for b in block_sizes):
        raise InvalidArgumentError("every block size must be >= 1 (DFlash: >= 2, the pending token and a draft)")
    methods = build_methods(engines, list(ks), max_new_tokens, list(batch_sizes), max_ngram, min_ngram, reference,
                            tuple(trees), tuple(block_sizes), tuple(policies), recorded, tuple(reference_families))
    idle = [policy for policy in policies if not any(m.policy == policy for m in methods)]
    if idle:
        raise InvalidArgumentError(f"policy {idle[0]} can drive none of the drafters measured (the confidence "
                                   "policies need a drafter with a confidence head: dspark)")
    for method in methods:  # warm-up, untimed and short
        method.run(prompts[: method.batch_size][:1] if method.impl == "transformers" else prompts[: method.batch_size],
                   min(WARM_UP_TOKENS, max_new_tokens))

    results = []  # (method, prompt index, output) of every run
    jobs = [(m, start) for m in methods for start in range(0, len(prompts), m.batch_size)]
    # Interleave: for each prompt chunk, every method takes a turn, in an order rotated per chunk.
    order = sorted(range(len(jobs)), key=lambda j: (jobs[j][1], (j + jobs[j][1]) % len(methods)))
    bar = tqdm(total=len(jobs) * repeats, desc="bench", unit="run", disable=not progress, file=sys.stderr)
    best_run = {}  # job -> (new tokens, seconds, committed tokens, row-steps) of its fastest repeat
    for _ in range(repeats):
        for j in order:
            method, start = jobs[j]
            chunk = prompts[start: start + method.batch_size]
            outputs, info, elapsed = _run_timed(method, chunk)
            produced = sum(len(o) for o in outputs)
            # tokens committed by verification and row-steps (transformers' first pass verifies its first
            # drafts together with the prompt)
            committed, steps = ((info.tokens_from_steps, info.verify_steps) if method.impl == "specdec"
                                else (len(outputs[0]), info))
            if j not in best_run or elapsed < best_run[j][1]:
                best_run[j] = (produced, elapsed, committed, steps)
            method.tau_tokens += committed
            method.tau_steps += steps
            if method.impl == "specdec":
                method.drafts_accepted += info.drafts_accepted
                method.drafts_evaluated += info.drafts_evaluated
                method.k_sum += info.k_sum
                method.decode_seconds += info.total_time - info.prefill_time
                method.decode_tokens += info.new_tokens - len(outputs)  # the first token comes from prefill
                method.feature_seconds += info.feature_time
                method.draft_seconds += info.draft_time
                for name in ("accepted_at", "proposed_at"):
                    totals, counts = getattr(method, name), getattr(info, name)
                    totals.extend([0] * (len(counts) - len(totals)))
                    for j, count in enumerate(counts):
                        totals[j] += count
                method.steps += info.target_forwards - 1
                method.drafting_steps += sum(1 for k in info.k_history if k)
            results += [(method, start + offset, output) for offset, output in enumerate(outputs)]
            bar.update(1)
    bar.close()
    # Speeds from each chunk's fastest repeat: a slow spell of the host that lands on one method's turn
    # (plain decoding's, say) then moves the ratios only if it lands on every repeat of that turn.
    for j, (produced, elapsed, committed, steps) in best_run.items():
        method, start = jobs[j]
        method.seconds += elapsed
        method.new_tokens += produced
        task = set(tasks[start: start + method.batch_size]) if tasks else ()
        if len(task) == 1:
            totals = method.by_task.setdefault(task.pop(), [0, 0.0, 0, 0])
            for i, value in enumerate((produced, elapsed, committed, steps)):
                totals[i] += value
    mismatches, differences = compare_outputs(results) if sampling.greedy else ([], [])
    # Implementations are compared for identity in float32 only: half precision and quantized weights
    # (int8 activations here, a dequantized float product in transformers) round each their own way.
    strict = target.backend.dtype == torch.float32 and not getattr(target.backend, "quantized_types", ())
    context = decode_context(results, prompts)
    widest = max((m.k or 1) + getattr(m.drafter, "branch_tokens", 0) for m in methods)
    sizes = sorted({*range(1, widest + 2), *(t.num_nodes + 1 for t in trees)})  # chains and each tree's size
    costs = {id(engine): model_costs(engine, sizes, context) for engine in engines}
    result = _table(methods, mismatches, len(prompts), max_new_tokens, repeats, costs,
                    by_task=tasks is not None and len(set(tasks)) > 1)
    result["feature_costs"] = {name: feature_cost(engines[0].target.backend, drafter.features.hidden_layers,
                                                  max(ks) + 1, context)
                               for name, drafter in engines[0].drafters if getattr(drafter, "features", None)}
    result["implementation_differences"] = differences
    from specdec.models.kernels import cpu_summary
    result["cpu"], result["threads"] = cpu_summary(), torch.get_num_threads()
    result["implementations_compared_exactly"] = strict
    result["outputs_identical"] = not mismatches and not (strict and differences) if sampling.greedy else None
    if not sampling.greedy:
        result["sampling"] = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    return result


def decode_context(results: list, prompts: list[list[int]]) -> int:
    """The mean context of the decoding steps plain decoding ran (each generated token after the first
    is one step over its prompt and the tokens before it): where the forward-pass costs that bound
    the efficiency are measured, so bound and measurement see the same context lengths."""
    contexts = [len(prompts[index]) + t for method, index, output in results
                if method.family == PLAIN and method.impl == "specdec" for t in range(1, len(output))]
    if not contexts:
        return sum(map(len, prompts)) // len(prompts)
    return round(sum(contexts) / len(contexts))


def compare_outputs(results: list) -> tuple[list, list]:
    """(lossless mismatches, differences between implementations) of (method, prompt, output) runs.

    Lossless: every method's output equals plain decoding of the same implementation (specdec on one
    backend, or transformers). Between implementations outputs agree only where both compute the
    same bits: float32 so far; in half precision two implementations round differently, which says
    nothing about speculation.
    """
    def group(method):
        return method.model, method.impl, method.tag

    plain, first = {}, {}
    for method, index, output in results:
        first.setdefault((group(method), index), output)
        if method.family == PLAIN:
            plain.setdefault((group(method), index), output)
    reference = {key: plain.get(key, output) for key, output in first.items()}
    mismatches = [{"prompt": index, "method": method.label} for method, index, output in results
                  if output != reference[group(method), index]]
    groups = list(dict.fromkeys(group(method) for method, _, _ in results))
    first_of = {}
    for g in groups:
        first_of.setdefault(g[0], g)  # each model's first implementation, the one the others are compared with
    differences = [{"prompt": index, "implementations": [" ".join(filter(None, first_of[g[0]])),
                                                         " ".join(filter(None, g))]}
                   for g in groups if g != first_of[g[0]] for (h, index), output in reference.items()
                   if h == g and output != reference[first_of[g[0]], index]]
    return mismatches, differences


COST_ROUNDS = 7  # rounds of the passes a bench's bounds are timed over (each pass's least time)


def feature_cost(backend, layers: tuple[int, ...], n: int, context: int) -> dict:
    """What returning a drafter's target features costs a verification pass of n tokens (ms): the pass
    with and without them timed in turn, each one's least time."""
    times = least_times(backend, {"plain": (n, ()), "carried": (n, layers)}, context, COST_ROUNDS)
    return {"tokens": n, "hidden_layers": list(layers), "verify_ms": 1e3 * times["plain"],
            "with_features_ms": 1e3 * times["carried"]}


def model_costs(engine: Engine, sizes, context: int) -> dict:
    """Forward-pass times of an engine's target (n new tokens) and draft models (1 token): each width
    timed in turn, its least time (the pass's own cost: a slow spell of the machine while they were timed
    made a bound below the speed measured, plain decoding's efficiency reading 1.14)."""
    costs = {"target": forward_times(engine.target.backend, sizes, context, COST_ROUNDS)}
    # every draft model's own pass (one in --drafters beside --draft: the demo's quantized file)
    drafts = [d for d in [engine.draft] + [d for name, d in engine.drafters if name == DRAFT_MODEL] if d is not None]
    costs["draft_models"] = {id(d): forward_times(d.backend, [1], context, COST_ROUNDS)[1] for d in drafts}
    if engine.draft is not None:
        costs["draft"] = costs["draft_models"][id(engine.draft)]
    return costs


def branch_tokens(method: Method) -> float:
    """Tokens a method's verification pass carries besides [pending, drafts] (what its drafter declares:
    lookahead's window), on average over its steps (a policy's plain steps carry none)."""
    share = method.drafting_steps / method.steps if method.steps else 1.0
    return getattr(method.drafter, "branch_tokens", 0) * share


def model_time_bound(method: Method, costs: dict) -> float | None:
    """Tokens/s if a step cost only its forward passes: tau / (T_draft + T_verify(k + 1)).

    The efficiency compares it with the tokens/s of the steps after prefill (prefill is one pass of
    the prompt, the same in every method, and not engine overhead per step).

    Plain decoding: 1 / T(1). The draft model drafts k tokens at T_draft(1) each (its catch-up pass
    of one or two tokens is counted as one). Prompt lookup's drafting counts as engine time; lookahead's
    pass verifies k + 1 tokens and its branch's W (N - 1) more.
    """
    if method.impl != "specdec" or method.batch_size != 1 or method.tree is not None:
        return None  # trees: drafting costs depth passes of topk tokens, not measured here
    if method.family not in (PLAIN, DRAFT_MODEL, PROMPT_LOOKUP, LOOKAHEAD):
        return None  # trained drafters: their passes are not timed separately
    target = costs["target"]
    if method.family == PLAIN:
        return 1.0 / target[1]
    if not method.tau_steps or method.tau is None:
        return None
    k = method.k_sum / method.tau_steps  # drafts actually proposed per step
    width = k + 1 + branch_tokens(method)
    n = min(target, key=lambda size: abs(size - width))
    verify = target[n] + (target[n] - target[1]) * ((width - n) / max(n - 1, 1))
    draft = 0.0
    if method.family == DRAFT_MODEL:
        draft_pass = costs.get("draft_models", {}).get(id(method.drafter))
        if draft_pass is None:
            return None
        draft = k * draft_pass
    return method.tau / (draft + verify)


def _table(methods: list[Method], mismatches: list, num_prompts: int, max_new_tokens: int, repeats: int,
           costs: dict | None = None, by_task: bool = False) -> dict:
    def find(impl, tag, family, k, batch_size, tree=None, note=""):
        for m in methods:
            if (m.impl, m.tag, m.family, m.k, m.batch_size, m.tree, m.note) == (impl, tag, family, k, batch_size,
                                                                                tree, note):
                return m
        return None

    rows = []
    for m in methods:
        plain = find("specdec", m.tag, PLAIN, None, m.batch_size) if m.impl == "specdec" else \
            find("transformers", m.tag, PLAIN, None, 1)
        peer = find("transformers", m.model, m.family, m.k, 1, note=m.note) if m.impl == "specdec" \
            and m.batch_size == 1 and m.tree is None else None
        single = find("specdec", m.tag, m.family, m.k, 1, m.tree, m.note) if m.impl == "specdec" \
            and m.batch_size > 1 else None
        bound = model_time_bound(m, costs[id(m.engine)]) if costs and m.engine is not None else None
        rows.append({
            "method": m.label, "impl": m.impl, "backend": m.engine.backend if m.engine else "transformers",
            "family": m.family, "k": m.k, "batch_size": m.batch_size,
            "policy": m.policy, "tau": m.tau, "alpha": m.alpha, "tokens_per_second": m.tokens_per_second,
            "new_tokens": m.new_tokens, "seconds": m.seconds,
            "tree": None if m.tree is None else [m.tree.depth, m.tree.topk, m.tree.num_nodes],
            "p_min": getattr(m.drafter, "p_min", None),
            **staged_fields(m.drafter),
            "mean_nodes": m.k_sum / m.tau_steps if m.tau_steps else None,
            "speedup_vs_plain": m.tokens_per_second / plain.tokens_per_second if plain and plain.seconds else None,
            "ratio_vs_transformers": (m.tokens_per_second / peer.tokens_per_second
                                      if peer and peer.seconds else None),
            "ratio_vs_batch_1": (m.tokens_per_second / single.tokens_per_second
                                 if single and single.seconds else None),
            "model_time_bound": bound,
            "efficiency": m.decode_tokens / m.decode_seconds / bound if bound and m.decode_seconds else None,
            "feature_ms_per_step": 1e3 * m.feature_seconds / m.steps if m.steps and m.feature_seconds else None,
            "draft_ms_per_step": 1e3 * m.draft_seconds / m.steps if m.steps and m.draft_seconds else None,
            "acceptance_by_position": [a / p if p else None for a, p in zip(m.accepted_at, m.proposed_at)] or None,
        })
        if by_task:
            rows[-1]["by_task"] = task_rows(m, plain)
    forward_costs = None
    if costs:
        forward_costs = {}
        for m in methods:
            if m.engine is not None and m.engine.backend not in forward_costs:
                c = costs[id(m.engine)]
                forward_costs[m.engine.backend] = {"target": {str(n): t for n, t in c["target"].items()},
                                                   "draft_1": c.get("draft")}
    return {"prompts": num_prompts, "max_new_tokens": max_new_tokens, "repeats": repeats,
            "outputs_identical": not mismatches, "mismatches": mismatches, "rows": rows,
            "forward_costs": forward_costs}


def task_rows(method: Method, plain: Method | None) -> dict:
    """{task: tau, tokens/s and speed over plain decoding on that task's prompts}."""
    out = {}
    for task, (tokens, seconds, committed, steps) in method.by_task.items():
        rate = tokens / seconds if seconds else 0.0
        base = plain.by_task.get(task) if plain else None
        out[task] = {"tau": committed / steps if steps else None, "tokens_per_second": rate,
                     "speedup_vs_plain": rate / (base[0] / base[1]) if base and base[1] and base[0] else None}
    return out


def format_table(result: dict) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = (f"{'method':<44} {'tau':>6} {'alpha':>6} {'tok/s':>8} {'vs plain':>9} {'vs HF':>7} {'vs b=1':>7} "
              f"{'effic.':>7}")
    lines = [header, "-" * len(header)]
    if result.get("cpu"):
        lines.insert(0, f"CPU: {result['cpu']}, {result['threads']} thread{'s' if result['threads'] > 1 else ''}")
    for row in result["rows"]:
        lines.append(f"{row['method']:<44} {cell(row['tau'], '.2f'):>6} {cell(row['alpha'], '.2f'):>6} "
                     f"{row['tokens_per_second']:>8.1f} {cell(row['speedup_vs_plain'], '.2f'):>9} "
                     f"{cell(row['ratio_vs_transformers'], '.2f'):>7} {cell(row['ratio_vs_batch_1'], '.2f'):>7} "
                     f"{cell(row.get('efficiency'), '.2f'):>7}")
    task_names = list(dict.fromkeys(task for row in result["rows"] for task in row.get("by_task") or {}))
    if task_names:
        lines.append("per task, tau / speed over plain decoding on the task's prompts: " + ", ".join(task_names))
        for row in result["rows"]:
            cells = [row["by_task"].get(task) for task in task_names]
            lines.append(f"  {row['method']:<42} " + "  ".join(
                "-" if c is None else f"{cell(c['tau'], '.2f')} / {cell(c['speedup_vs_plain'], '.2f')}x"
                for c in cells))
    mismatches, differences = result["mismatches"], result.get("implementation_differences") or []
    sampled = result.get("sampling")
    if sampled:
        verdict = (f"sampled at temperature {sampled['temperature']}"
                   + (f", top-k {sampled['top_k']}" if sampled["top_k"] else "")
                   + (f", top-p {sampled['top_p']}" if sampled["top_p"] else "")
                   + ": outputs are draws, compared with nothing (the sampling tests check the distribution)")
    elif mismatches:
        verdict = (f"OUTPUTS DIFFER FROM PLAIN DECODING in {len(mismatches)} runs: " +
                   ", ".join(f"prompt {m['prompt']} ({m['method']})" for m in mismatches[:5]))
    elif differences:
        verdict = "every greedy output equals plain decoding of its implementation"
    else:
        verdict = "all greedy outputs identical"
    if differences and result.get("implementations_compared_exactly", True):
        verdict += (f"; IMPLEMENTATIONS DIFFER on {len(differences)} prompts in float32: " +
                    ", ".join(f"prompt {d['prompt']} ({' vs '.join(d['implementations'])})" for d in differences[:5]))
    elif differences:
        verdict += (f"; plain decoding differs between implementations on {len(differences)} prompts "
                    "(half precision or quantized weights: each rounds its own way, so they are not compared "
                    "for identity)")
    timed = ", each prompt's fastest repeat timed" if result["repeats"] > 1 else ""
    lines.append(f"{result['prompts']} prompts x {result['repeats']} repeats{timed}, "
                 f"max {result['max_new_tokens']} new tokens; {verdict}")
    lines.append("efficiency: tokens/s after prefill over the model-time bound tau / (T_draft + T_verify(k+1)), "
                 "1 / T(1) for plain; forward times measured in this run")
    for name, cost in (result.get("feature_costs") or {}).items():
        steps = [row["feature_ms_per_step"] for row in result["rows"]
                 if row["family"] == name and row.get("feature_ms_per_step")]
        lines.append(f"features for {name} (hidden_states {cost['hidden_layers']}): verifying {cost['tokens']} tokens "
                     f"{cost['verify_ms']:.3f} ms, with features {cost['with_features_ms']:.3f} ms"
                     + (f"; handing them on {min(steps):.3f}-{max(steps):.3f} ms per step" if steps else ""))
    drafting = [row for row in result["rows"] if row["family"] in BLOCK_DRAFTERS and row.get("draft_ms_per_step")]
    if drafting:
        lines.append("block drafting per step (one pass per block): " + ", ".join(
            f"{row['method'].removeprefix('specdec ')} {row['draft_ms_per_step']:.3f} ms" for row in drafting))
    for backend, curve in (result.get("cost_curve") or {}).items():
        lines.append(f"T(n)/T(1) on {backend} at context {curve['context']}: " + ", ".join(
            f"{n}: {ratio:.2f}" for n, ratio in curve["ratio"].items()) + f" (T(1) = {curve['ms']['1']:.2f} ms)")
        limit = curve.get("limit")
        if limit:
            lines.append(
                f"  the machine's limit ({curve['weights']} weights, {limit['weight_bytes'] / 2**20:.0f} MiB read at "
                f"{limit['bandwidth_gb_s']:.1f} GB/s = {limit['stream_ms']:.2f} ms; vector peak "
                f"{limit['peak_float_gmac_s']:.0f} GFMA/s float32" + (f", {limit['peak_int8_gmac_s']:.0f} GMAC/s int8"
                                                                       if limit["peak_int8_gmac_s"] else "")
                + (f", {limit['peak_tiles_gmac_s']:.0f} GMAC/s bfloat16 on AMX tiles" if limit.get("peak_tiles_gmac_s")
                   else "") + "):")
            lines.append("  n      T(n) ms   limit ms   T/limit")
            for n, ms in curve["ms"].items():
                lines.append(f"  {n:<6} {ms:9.2f} {limit['ms'][n]:10.2f} {ms / limit['ms'][n]:9.2f}")
    return "\n".join(lines)


def add_bench_command(commands) -> None:
    from specdec.commands.clitools import add_model_arguments, policy_text

    bench = commands.add_parser("bench", help="compare plain, draft-model and prompt-lookup decoding, "
                                              "specdec against transformers, in one run")
    add_model_arguments(bench, several=True)
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", metavar="FILE.jsonl")
    source.add_argument("--tasks", metavar="NAME", nargs="+",
                        help="task sets (the zoo's code-completion, copy-edit, long-context; humaneval, sharegpt, "
                             "sharegpt-edit: chat, rendered by --target's template); --num-prompts applies to each")
    bench.add_argument("-k", nargs="+", type=int, default=[4], help="draft lengths to measure (default 4)")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts (of each task set)")
    bench.add_argument("--batch-sizes", nargs="+", type=int, default=[1],
                       help="batch sizes for specdec's methods (transformers' run at batch 1)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="run every prompt R times; speeds count each prompt's fastest run (default 1)")
    bench.add_argument("--no-transformers", action="store_true", help="skip transformers' implementations")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="sample at this temperature (default 0: greedy); sampled runs report tau and speed, "
                            "compare no outputs and run no transformers methods")
    bench.add_argument("--top-k", type=int, default=None, help="sampling: keep the k likeliest tokens")
    bench.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass")
    bench.add_argument("--drafters", nargs="+", default=[], metavar="NAME[=DIR]",
                       help="trained drafters to measure too (medusa, eagle, eagle3, dflash; SGLang/vLLM names accepted) "
                            "and lookahead (its --lookahead-* settings); "
                            "without =DIR the zoo's, trained for the zoo target. Self-drafting models: early-exit=DIR, "
                            "mtp=DIR (without =DIR the zoo's variants), each beside its own plain decoding")
    bench.add_argument("--block-sizes", nargs="+", type=int, default=[], metavar="B",
                       help="DFlash and DSpark: block sizes to measure (DFlash's block includes the pending token, "
                            "k = B - 1; every DSpark slot drafts, k = B; default: each drafter's own block)")
    bench.add_argument("--exit-layers", nargs="+", type=int, default=[], metavar="E",
                       help="early-exit: exit layers to measure, each with and without reusing the drafted layers "
                            "(default: the one the model's folder records)")
    bench.add_argument("--mtp-depths", nargs="+", type=int, default=[], metavar="D",
                       help="mtp: module depths to measure (default: all the model has)")
    bench.add_argument("--trees", nargs="+", default=[], metavar="D/K/N",
                       help="token trees to measure beside the chains: depth/topk/num_nodes, e.g. 5/4/16")
    bench.add_argument("--policies", nargs="+", default=[], metavar="POLICY", type=policy_text,
                       help="also every chain drafter under each policy, up to its largest k, labelled with it: "
                            "load-aware (profiles the target, chooses the drafts per step), static:1=4,8=2, and for "
                            "drafters with a confidence head (dspark) confidence and conf-min:X")
    bench.add_argument("--load-aware", action="store_true", help="the same as --policies load-aware")
    bench.add_argument("--cost-curve", action="store_true",
                       help="also print T(n)/T(1), the target's forward time for n new tokens, n = 1..64")
    bench.add_argument("--record", action="store_true",
                       help="write each --drafters folder's fastest setting (k or tree, batch 1) into its config.json, "
                            "which the drafter then uses when a generation asks for neither")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE")
    bench.set_defaults(func=run_bench_command)


def load_bench_prompts(args) -> tuple[list, list[str] | None]:
    """(the prompts, the task set of each: None for a prompts file)."""
    from specdec.prompts import read_prompts

    if args.prompts:
        return read_prompts(args.prompts), None
    try:
        from specdec.zoo.tasks import load_tasks
    except ImportError:
        raise InvalidArgumentError("task sets need the zoo, which is not installed") from None
    from specdec.backends.hf import load_tokenizer
    from specdec.backends.target import resolve_model
    tokenizer = load_tokenizer(resolve_model(args.target))
    chosen = [(p, name) for name in args.tasks for p in load_tasks(name, tokenizer=tokenizer)[: args.num_prompts]]
    return [p for p, _ in chosen], [name for _, name in chosen]


def check_repeats(repeats: int) -> None:
    """--repeats of bench and demo: one line below 1."""
    if repeats < 1:
        raise InvalidArgumentError(f"repeats must be >= 1, got {repeats}")


def run_bench_command(args) -> int:
    from specdec.commands.clitools import check_draft_quantize, check_staged, make_drafter
    from specdec.models.files import check_output_path, write_atomic
    from specdec.backends.target import load_target

    check_output_path(args.output)

    if args.max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    check_repeats(args.repeats)
    trees = [parse_tree(text) for text in args.trees]
    if args.num_prompts is not None and args.num_prompts < 1:
        raise InvalidArgumentError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    prompts, tasks = load_bench_prompts(args)
    if args.prompts and args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    requested = [parse_drafter(text, args.target) for text in args.drafters]
    check_draft_quantize(args, [name for name, _ in requested] + ["draft-model"])
    check_staged(args, ["draft-model"])
    from specdec.drafters.registry import REGISTRY
    from specdec.drafters.mtp import is_modules_folder

    def self_drafting(name, folder):  # a model of its own; MTP modules kept apart draft for the target itself
        return REGISTRY[name].zoo_variant and not (name == "mtp" and is_modules_folder(folder))

    own = [(name, folder) for name, folder in requested if self_drafting(name, folder)]
    requested = [(name, folder) for name, folder in requested if not self_drafting(name, folder)]
    p_mins = p_min_values(args.draft_p_min, [name for name, _ in requested + own] + [DRAFT_MODEL] * bool(args.draft))

    def drafters(name, folder, backend):  # one per cut when the method takes --draft-p-min (and per --draft-staged)
        cuts = p_mins if REGISTRY[name].p_min else [None]
        stages = list(dict.fromkeys(args.draft_staged or [None])) if name == DRAFT_MODEL else [None]
        return [make_drafter(name, args, backend=backend, folder=folder, draft_p_min=p, draft_staged=staged)
                for p in cuts for staged in stages]

    engines, variants = [], []
    for backend in dict.fromkeys(args.backend):
        target = load_target(args.target, dtype=args.dtype, backend=backend,
                             quantize=args.quantize if backend != "hf" else None)
        draft, *more = drafters(DRAFT_MODEL, args.draft, backend) if args.draft else [None]
        if draft is not None:
            draft.check_compatible(target)
        trained = tuple((name, drafter) for name, folder in requested for drafter in drafters(name, folder, backend))
        engines.append(Engine(target, draft, tuple((DRAFT_MODEL, d) for d in more) + trained))
        for name, folder in own:
            variants.append(variant_engine(name, folder, args.dtype, backend, args.exit_layers, args.mtp_depths,
                                           len(args.backend) > 1, p_mins=p_mins))
    first = engines[0]
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    result = run_bench(first.target, first.target.encode(prompts), draft=first.draft, ks=args.k,
                       max_new_tokens=args.max_new_tokens, batch_sizes=args.batch_sizes, repeats=args.repeats,
                       max_ngram=args.max_ngram, min_ngram=args.min_ngram, with_transformers=not args.no_transformers,
                       more_engines=tuple(engines[1:] + variants), trees=tuple(trees), drafters=first.drafters,
                       block_sizes=tuple(args.block_sizes),
                       policies=tuple(dict.fromkeys(args.policies + ["load-aware"] * args.load_aware)),
                       sampling=SamplingConfig(args.temperature, args.top_k, args.top_p), tasks=tasks)
    if args.cost_curve:
        result["cost_curve"] = {e.backend: cost_curve(e.target.backend) for e in engines}
    if args.output:
        write_atomic(args.output, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else format_table(result))
    if args.record and result["outputs_identical"]:  # greedy runs only: a sampled run compares nothing
        # A drafter quantized at load is not what its folder holds: nothing is recorded there for it.
        entries = [] if args.draft_quantize else requested + ([(DRAFT_MODEL, str(args.draft))] if args.draft else [])
        measured_on = (f"{' + '.join(args.tasks or [args.prompts])}, {result['prompts']} prompts, "
                       f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, {args.dtype}")
        for name, folder in entries:
            record_fastest(result, name, folder, measured_on, several=sum(other == name for other, _ in entries) > 1)
    return 0 if result["outputs_identical"] is not False else 1


def p_min_values(given: list[float] | None, names: list[str]) -> list[float | None]:
    """The cuts bench measures (--draft-p-min's values; none given: each folder's own, [None]); one line when
    none of the drafters measured takes a cut."""
    from specdec.drafters.registry import REGISTRY, p_min_takers

    if not given:
        return [None]
    if not any(REGISTRY[name].p_min for name in names):
        raise InvalidArgumentError(f"{p_min_takers()}; none of the drafters measured takes it")
    return list(dict.fromkeys(given))


def staged_fields(drafter) -> dict:
    """A staged draft model's row fields: the guesser's name, its guesses a pass and, for retrieval, the
    datastore it reads (as --record names it)."""
    if not getattr(drafter, "staged_name", None):
        return {}
    fields = {"staged": drafter.staged_name, "staged_guesses": drafter.staged_guesses}
    if drafter.staged_name == "retrieval":
        from specdec.zoo.datastores import datastore_name
        fields["staged_datastore"] = datastore_name(drafter.staged.path)
    return fields


def record_fastest(result: dict, name: str, folder: str, measured_on: str, several: bool = False) -> dict | None:
    """Store the fastest batch-1 setting of drafter ``name`` in ``folder``/config.json (specdec.defaults).
    ``several``: other folders of the method were measured too; only this folder's rows (their labels name
    it, ``drafter_note``) count."""
    from specdec.models.kernels import cpu_summary

    rows = [r for r in result["rows"] if r["impl"] == "specdec" and r["family"] == name and r["batch_size"] == 1
            and r["speedup_vs_plain"] and (not several or f"({Path(folder).name}" in r["method"])]
    best = max(rows, key=lambda r: r["speedup_vs_plain"], default=None)
    if best is None:
        return None
    from specdec.backends.target import resolve_model
    from specdec.drafters.base import record_setting

    choice = {"num_draft_tokens": best["k"], "tree": best["tree"], "tau": round(best["tau"], 3),
              **({"p_min": best["p_min"]} if best.get("p_min") else {}),
              **{key: best[key] for key in ("staged", "staged_guesses", "staged_datastore") if best.get(key)},
              "speedup_vs_plain": round(best["speedup_vs_plain"], 3), "measured_on": measured_on,
              "cpu": cpu_summary()}
    path = record_setting(resolve_model(folder), choice)  # a real model's name or a GGUF file: its folder
    print(f"recorded in {path}: {best['method']} ({choice['speedup_vs_plain']:.2f}x plain)", file=sys.stderr)
    return choice


def parse_drafter(text: str, target: str | None = None) -> tuple[str, str]:
    """'eagle3=DIR' -> ('eagle3', DIR); 'eagle3' -> the eagle3 folder trained for ``target`` when it names
    a real model (``smollm2-135m/eagle3``), else the zoo's. Self-drafting methods (early-exit, mtp) name
    the model that drafts for itself: 'mtp=DIR', or the zoo's variant."""
    from specdec.drafters.registry import REGISTRY, resolve

    name, _, folder = text.partition("=")
    name = resolve(name)
    entry = REGISTRY[name]
    if name == LOOKAHEAD and not folder:  # needs no model: its settings come from --lookahead-*
        return name, None
    if not (entry.folder or entry.zoo_variant) or name == "draft-model":
        raise InvalidArgumentError(f"--drafters takes trained drafters (medusa, eagle, eagle3, dflash), "
                                   f"self-drafting models (early-exit=DIR, mtp=DIR) and lookahead, got {name!r}"
                                   + (" (lookahead takes no folder)" if name == LOOKAHEAD else ""))
    if not folder:
        from specdec.drafters.registry import default_folder
        from specdec.zoo import REAL_MODELS, zoo_path
        # A real target's MTP modules were trained on its frozen trunk and kept apart (smollm2-135m/mtp).
        if str(target) in REAL_MODELS and (not entry.zoo_variant or name == "mtp"):
            folder = default_folder(name, target)
        elif entry.zoo or entry.zoo_variant:
            folder = str(zoo_path(entry.zoo or entry.zoo_variant))
        if not folder:
            raise InvalidArgumentError(f"--drafters {name} needs a folder here ({name}=DIR): the zoo has none for "
                                       f"this target" + (" (build a datastore with specdec datastore)"
                                                         if name == "retrieval" else ""))
    return name, folder


def variant_engine(name: str, folder, dtype="float32", backend: str = "auto", exit_layers=(), depths=(),
                   tagged: bool = False, recompute: bool = True, p_mins=(None,)) -> Engine:
    """A self-drafting model as an engine of its own: its plain decoding and its drafter, at every exit
    layer asked for (each with and, when ``recompute``, without reusing the drafted layers) or every
    MTP depth (default: the folder's exit layer, all its modules), MTP at each cut of ``p_mins``."""
    from specdec.backends.target import load_target
    from specdec.drafters import MTP, EarlyExit

    target = load_target(folder, dtype=dtype, backend=backend)
    if name == EARLY_EXIT:
        drafters = [(name, EarlyExit(exit_layer, reuse_kv=reuse)) for exit_layer in (exit_layers or [None])
                    for reuse in ((True, False) if recompute else (True,))]
        for _, drafter in drafters:
            drafter.exit_for(target)  # an exit layer outside [1, L): one line before any work
    else:
        drafters = [(name, MTP(depth, p_min=p_min)) for depth in (depths or [None]) for p_min in p_mins]
    label = Path(folder).name + (f"/{target.backend.description}" if tagged else "")
    return Engine(target, None, tuple(drafters), variant=label)


def parse_tree(text: str) -> TreeConfig:
    """'5/4/16' -> TreeConfig(depth=5, topk=4, num_nodes=16)."""
    try:
        depth, topk, nodes = (int(part) for part in text.split("/"))
    except ValueError:
        raise InvalidArgumentError(f"a tree is depth/topk/num_nodes, e.g. 5/4/16; got {text!r}") from None
    return TreeConfig(depth, topk, nodes)


COST_SIZES = (1, 2, 4, 5, 8, 16, 17, 32, 64)  # 5 and 17: verifying k = 4 and k = 16 drafts


def cost_curve(backend, context: int = 200) -> dict:
    """T(n) for n new tokens at batch 1 after ``context`` tokens, and T(n)/T(1): the verification cost;
    on the native backend also this machine's limit for each n (``costs.machine_limit``)."""
    from specdec.backends.costs import machine_limit

    times = {n: forward_time(backend, n, context) for n in COST_SIZES}
    curve = {"context": context, "ms": {str(n): 1e3 * t for n, t in times.items()},
             "ratio": {str(n): t / times[1] for n, t in times.items()}}
    if hasattr(backend, "quantized_types"):
        curve["limit"] = machine_limit(backend, COST_SIZES, context)
        curve["weights"] = ", ".join(backend.quantized_types) or str(backend.dtype).removeprefix("torch.")
    return curve
