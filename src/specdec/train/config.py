"""Run configurations shared by both trainers: presets plus a JSON override file.

A trainer's configuration is a frozen dataclass with nested ``shape`` (a
``ModelShape``) and ``optim`` (an ``OptimConfig``) dataclasses and flat scalar
fields. Both trainers build theirs with the functions here, parameterised by
the config class, its presets and a label for error messages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Mapping, TypeVar

from specdec.errors import SpecdecError
from specdec.train.loop import optim_from_dict

C = TypeVar("C")


class TrainConfigError(SpecdecError):
    """A training configuration file or option is invalid."""


class LongPhase:
    """Schedule of the final long-window phase, mixed into both trainers' configs.

    Expects ``optim.steps``, ``long_fraction``, ``batch_size``, ``seq_len`` and
    ``long_seq_len`` fields on the dataclass it is mixed into.
    """

    def long_batch_size(self) -> int:
        """Batch size of long windows, keeping the tokens per step of the short phase."""
        return max(1, self.batch_size * self.seq_len // self.long_seq_len)

    def long_start(self) -> int:
        """First step of the long-sequence phase."""
        return self.optim.steps - int(round(self.optim.steps * self.long_fraction))


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config as a JSON-ready dict (stored in checkpoints and summaries)."""
    return asdict(config)


def config_from_dict(cls: type[C], values: dict[str, Any], label: str = "training") -> C:
    """``cls`` from a (possibly partial) JSON object; unknown keys are errors.

    Missing keys take ``cls()``'s defaults; ``label`` names the kind of
    configuration in the error message.
    """
    values = dict(values)
    base = cls()
    try:
        shape = replace(base.shape, **values.pop("shape", {}))
        optim = optim_from_dict({**asdict(base.optim), **values.pop("optim", {})})
        return replace(base, shape=shape, optim=optim, **values)
    except TypeError as exc:
        raise TrainConfigError(f"invalid {label} configuration: {exc}") from exc


def load_config(cls: type[C], presets: Mapping[str, C], path: str | None, preset: str = "zoo", label: str = "training") -> C:
    """A preset, optionally overridden by a JSON file of the same structure.

    Nested objects (``shape``, ``optim``) are merged key by key into the
    preset's; other values replace the preset's.
    """
    if preset not in presets:
        raise TrainConfigError(f"unknown preset {preset!r}; expected one of {', '.join(presets)}")
    if path is None:
        return presets[preset]
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrainConfigError(f"cannot read config {path}: {exc}") from exc
    merged = config_to_dict(presets[preset])
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return config_from_dict(cls, merged, label)
