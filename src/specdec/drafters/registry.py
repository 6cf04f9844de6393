"""Every drafter specdec ships, in one table: the CLI, bench and demo read it, never a chain of ifs.

An entry says how to build the drafter from the command line's options, the names serving
engines use for the same method (SGLang's ``--speculative-algorithm``, vLLM's
``speculative_config["method"]``), whether it needs a folder (``--draft DIR``) and which zoo model
is trained for the zoo target.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from specdec.errors import InvalidArgumentError


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    summary: str
    aliases: tuple[str, ...] = ()   # SGLang / vLLM names, matched case-insensitively
    folder: bool = False            # built from a folder (--draft DIR)
    zoo: str | None = None          # the zoo model trained for the zoo target
    zoo_variant: str | None = None  # self-drafting: the zoo target's variant trained to draft for itself
    chains: bool = True             # drafts chains of k (else its own static tree)
    trees: bool = False             # builds dynamic trees (TreeConfig)
    p_min: bool = False             # takes --draft-p-min (drafts one token at a time, each from its own softmax)
    quantize: bool = False          # a network --draft-quantize block-quantizes at load (the draft model: its --draft)
    build: Callable = None          # (folder or None, options namespace) -> Drafter


def _none(folder, options):
    from specdec.drafters.none import NoDraft
    return NoDraft()


def _draft_model(folder, options):
    from specdec.backends.target import parse_dtype
    from specdec.drafters.draft_model import DraftModel
    return DraftModel(folder, dtype=parse_dtype(getattr(options, "dtype", "float32")),
                      backend=getattr(options, "backend", None) or "auto",
                      quantize=getattr(options, "draft_quantize", None), p_min=getattr(options, "draft_p_min", None),
                      staged=_staged(options), staged_guesses=getattr(options, "staged_guesses", None))


def _staged(options):
    """--draft-staged: None (the folder's record), "none", "prompt-lookup", or retrieval over a datastore
    (``retrieval=DIR``; ``retrieval`` alone: a real target's own, ``smollm2-135m/retrieval``)."""
    value = getattr(options, "draft_staged", None)
    if value in (None, "none", "prompt-lookup"):
        return value
    name, _, folder = value.partition("=")
    if name != "retrieval":
        raise InvalidArgumentError(f"--draft-staged takes none, prompt-lookup or retrieval[=DIR], got {value!r}")
    if not folder:
        from specdec.zoo import REAL_MODELS
        target = str(getattr(options, "target", None))
        if target not in REAL_MODELS:
            raise InvalidArgumentError("--draft-staged retrieval needs a datastore here: retrieval=DIR "
                                       "(specdec datastore builds one)")
        folder = f"{target}/retrieval"
    return _retrieval(folder, options)


def _prompt_lookup(folder, options):
    from specdec.drafters.prompt_lookup import PromptLookup
    return PromptLookup(max_ngram=getattr(options, "max_ngram", 3), min_ngram=getattr(options, "min_ngram", 1))


def _lookahead(folder, options):
    from specdec.drafters.lookahead import Lookahead
    given = {field: getattr(options, f"lookahead_{field}", None) for field in ("window", "ngram", "guesses")}
    return Lookahead(**{field: value for field, value in given.items() if value is not None})


def _retrieval(folder, options):
    from specdec.drafters.retrieval import Retrieval
    return Retrieval(folder)  # a folder, or a real model's datastore by name: smollm2-135m/retrieval


def _medusa(folder, options):
    from specdec.drafters.medusa import Medusa
    return Medusa(folder, choices=getattr(options, "medusa_choices", None))


def _eagle(version):
    def build(folder, options):
        from specdec.drafters.eagle import Eagle
        return Eagle(folder, version=version, p_min=getattr(options, "draft_p_min", None),
                     quantize=getattr(options, "draft_quantize", None))
    return build


def _dflash(folder, options):
    from specdec.drafters.dflash import DFlash
    return DFlash(folder, block_size=getattr(options, "block_size", None),
                  quantize=getattr(options, "draft_quantize", None))


def _dspark(folder, options):
    from specdec.drafters.dspark import DSpark
    return DSpark(folder, block_size=getattr(options, "block_size", None),
                  quantize=getattr(options, "draft_quantize", None))


def _early_exit(folder, options):
    from specdec.drafters.early_exit import EarlyExit
    return EarlyExit(getattr(options, "exit_layer", None), reuse_kv=not getattr(options, "no_kv_reuse", False))


def _mtp(folder, options):
    from specdec.drafters.mtp import MTP
    return MTP(getattr(options, "mtp_depth", None), modules=folder,  # folder: modules trained on a frozen target
               p_min=getattr(options, "draft_p_min", None))


REGISTRY: dict[str, DrafterEntry] = {entry.name: entry for entry in (
    DrafterEntry("none", "plain decoding, no drafts", ("NONE",), build=_none),
    DrafterEntry("draft-model", "a small causal LM with the target's vocabulary", ("STANDALONE", "draft_model"),
                 folder=True, zoo="draft", trees=True, p_min=True, build=_draft_model),
    DrafterEntry("prompt-lookup", "n-gram matches in the prompt and output", ("NGRAM",), trees=True,
                 build=_prompt_lookup),
    DrafterEntry("lookahead", "lookahead decoding: n-grams from Jacobi iterations run inside the verification "
                 "pass, no model", trees=True, build=_lookahead),
    DrafterEntry("retrieval", "REST: continuations of the context's tail in a datastore of text, and in the "
                 "context", folder=True, trees=True, build=_retrieval),
    DrafterEntry("medusa", "Medusa heads on the target's last feature, a static tree", ("MEDUSA",), folder=True,
                 zoo="medusa", chains=False, build=_medusa),
    DrafterEntry("eagle", "EAGLE-1: one layer over the target's last feature", ("EAGLE",), folder=True,
                 zoo="eagle", trees=True, p_min=True, quantize=True, build=_eagle(1)),
    DrafterEntry("eagle3", "EAGLE-3: one layer over fused low/mid/high target features", ("EAGLE3",), folder=True,
                 zoo="eagle3", trees=True, p_min=True, quantize=True, build=_eagle(3)),
    DrafterEntry("dflash", "DFlash: a block of drafts in one pass over fused target features", ("DFLASH",),
                 folder=True, zoo="dflash", quantize=True, build=_dflash),
    DrafterEntry("dspark", "DSpark: DFlash's block with a Markov head and a confidence head", ("DSPARK",),
                 folder=True, trees=True, quantize=True, build=_dspark),
    DrafterEntry("early-exit", "LayerSkip: the target's own first layers, final norm and head", ("LAYERSKIP",),
                 zoo_variant="layerskip", build=_early_exit),
    DrafterEntry("mtp", "the target's own multi-token-prediction modules or heads", ("NEXTN", "deepseek_mtp"),
                 zoo_variant="mtp", p_min=True, build=_mtp),
)}


def p_min_takers() -> str:
    """The start of the one-line error for --draft-p-min where no drafter takes it: which do."""
    return "--draft-p-min cuts the chains of " + ", ".join(e.name for e in REGISTRY.values() if e.p_min)


def quantized_networks() -> tuple[str, ...]:
    """The drafters whose networks --draft-quantize block-quantizes at load."""
    return tuple(entry.name for entry in REGISTRY.values() if entry.quantize)


def resolve(value: str) -> str:
    """A drafter's name from its own name or an engine's alias (any case)."""
    if value in REGISTRY:
        return value
    for entry in REGISTRY.values():
        if value.lower() == entry.name or value.lower() in (alias.lower() for alias in entry.aliases):
            return entry.name
    known = ", ".join(REGISTRY)
    aliases = ", ".join(a for e in REGISTRY.values() for a in e.aliases if a.isupper())
    raise InvalidArgumentError(f"unknown drafter {value!r}; choose from {known} (or SGLang's {aliases})")


def argument_type(value: str) -> str:
    """argparse ``type=`` for --drafter: the resolved name, or a usage error."""
    try:
        return resolve(value)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_folder(name: str, target) -> str | None:
    """The folder ``--drafter name`` takes when no --draft is given: the zoo's drafter trained for
    ``target`` (``zoo.trained_drafter``: a real model's own, or the zoo target's), for the methods that need
    a folder and for MTP modules kept apart from a real target; None otherwise."""
    entry = REGISTRY[resolve(name)]
    if not entry.folder and entry.name != "mtp":
        return None
    from specdec.zoo import trained_drafter

    folder = trained_drafter(target, entry.zoo or entry.name)
    return None if folder is None else str(folder)


def missing_folder(name: str, target) -> InvalidArgumentError:
    """The one line for a method that needs a folder when neither --draft nor the zoo gives one."""
    from specdec.zoo import REAL_MODELS

    entry = REGISTRY[resolve(name)]
    trained = ", ".join(name for name, model in REAL_MODELS.items() if not model.drafters)
    return InvalidArgumentError(f"--drafter {entry.name} needs --draft DIR: the zoo holds no {entry.name} trained "
                                f"for {target} (the zoo's target and {trained} have theirs)")


def build(name: str, folder=None, options=None):
    """The drafter ``name`` (an alias is fine), from ``folder`` when it needs one."""
    entry = REGISTRY[resolve(name)]
    if getattr(options, "draft_p_min", None) is not None and not entry.p_min and entry.name != "none":
        raise InvalidArgumentError(f"{p_min_takers()}; {entry.name} takes no cut")
    if entry.folder and folder is None:
        raise InvalidArgumentError(f"--drafter {entry.name} needs --draft DIR (a {entry.name} folder"
                                   + (f"; the zoo's is specdec.zoo.zoo_path({entry.zoo!r})" if entry.zoo else "") + ")")
    return entry.build(folder, options or argparse.Namespace())


def help_text() -> str:
    return " | ".join(f"{e.name}" for e in REGISTRY.values()) + " (SGLang/vLLM names accepted: " + ", ".join(
        a for e in REGISTRY.values() for a in e.aliases) + ")"
