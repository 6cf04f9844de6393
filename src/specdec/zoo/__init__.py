"""The model zoo: a tokenizer, a target, a distilled draft and task sets, all built offline.

``zoo_path("target")`` / ``zoo_path("draft")`` give folders that load with
``transformers.AutoModelForCausalLM.from_pretrained``; ``zoo_path("medusa")``, ``zoo_path("eagle")``,
``zoo_path("eagle3")`` and ``zoo_path("dflash")`` are drafters trained for the zoo target, in the
layouts serving engines load; ``zoo_path("layerskip")``, ``zoo_path("mtp")`` (DeepSeek-V3-style
modules) and ``zoo_path("mtp-parallel")`` are the target trained further to draft for itself
(causal LMs too). See docs/zoo.md.
"""

from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecdecError

MODEL_NAMES = ("target", "draft")          # causal LMs (load with transformers)
DRAFTER_NAMES = ("medusa", "eagle", "eagle3", "dflash")  # trained drafters for the zoo target (their own layouts)
VARIANT_NAMES = ("layerskip", "mtp", "mtp-parallel")  # the zoo target trained further to draft for itself
_DATA_DIR = Path(__file__).resolve().parent / "data"


class ZooError(SpecdecError):
    """A zoo model or file is unknown or has not been built."""


def data_dir() -> Path:
    """The package's zoo folder (``src/specdec/zoo/data``)."""
    return _DATA_DIR


def default_tokenizer_dir() -> Path:
    """Where ``specdec zoo build`` puts the shared tokenizer."""
    return _DATA_DIR / "tokenizer"


def zoo_path(name: str) -> Path:
    """Folder of the zoo model ``name`` (a causal LM or a drafter); raises ZooError if unknown or missing."""
    known = MODEL_NAMES + DRAFTER_NAMES + VARIANT_NAMES
    if name not in known:
        raise ZooError(f"unknown zoo model {name!r}; expected one of {', '.join(known)}")
    path = _DATA_DIR / name
    if not (path / "config.json").is_file():
        raise ZooError(f"zoo model {name!r} is not built ({path} has no config.json); run `specdec zoo build`")
    return path
