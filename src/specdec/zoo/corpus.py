"""The zoo's training corpus: the running interpreter's own standard library.

It is on every machine that can run this package, so the zoo can be rebuilt
offline. Files are split by a hash of their path relative to the stdlib root,
so the split does not depend on directory listing order or on which other
files exist.

What is left out, and why:
  * ``site-packages`` and anything that is not ``.py``: third-party or binary.
  * Test packages (any path component ``test``, ``tests`` or ``idle_test``):
    in CPython 3.11 they are more than half of the stdlib's bytes, are highly
    repetitive and include deliberately malformed files (bad encodings, bad
    syntax). The compute budget buys about one pass over the rest anyway.
  * Generated data: the charmap codec tables made by ``gencodec.py`` and
    ``pydoc_data/topics.py`` (a 750 kB string literal). They are long
    tables, not code, and would make losses look better than they are.
  * Files that are not valid UTF-8.
``idlelib``, ``tkinter``, ``turtledemo``, ``lib2to3`` and ``distutils`` are
kept: they are ordinary hand-written Python.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

from specdec.errors import SpecdecError

SPLITS = ("train", "validation", "test")
# Per-mille thresholds of the path hash: [0, 900) train, [900, 950) validation, rest test.
_TRAIN_CUT = 900
_VALIDATION_CUT = 950
_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
_EXCLUDED_FILES = frozenset({"pydoc_data/topics.py"})


class CorpusError(SpecdecError):
    """The corpus split name is unknown or the stdlib cannot be read."""


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def split_of(relative_path: str) -> str:
    """Split a file belongs to, from the sha256 of its POSIX relative path."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 1000
    if bucket < _TRAIN_CUT:
        return "train"
    if bucket < _VALIDATION_CUT:
        return "validation"
    return "test"


def _is_generated(text: str) -> bool:
    return "gencodec.py" in text[:1000]


def _read_source(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _included(root: Path, path: Path) -> bool:
    rel = path.relative_to(root)
    if set(rel.parts[:-1]) & _EXCLUDED_DIRS or rel.as_posix() in _EXCLUDED_FILES:
        return False
    text = _read_source(path)
    return text is not None and not _is_generated(text)


@functools.lru_cache(maxsize=4)
def _classified(root: Path) -> dict[str, tuple[Path, ...]]:
    """Every included file of ``root`` by split; cached because the stdlib does not change."""
    table: dict[str, list[Path]] = {name: [] for name in SPLITS}
    for path in sorted(root.rglob("*.py")):
        if path.is_file() and _included(root, path):
            table[split_of(path.relative_to(root).as_posix())].append(path)
    return {name: tuple(paths) for name, paths in table.items()}


def list_split(split: str, root: Path | None = None) -> list[Path]:
    """Sorted absolute paths of the corpus files in ``split``."""
    if split not in SPLITS:
        raise CorpusError(f"unknown corpus split {split!r}; expected one of {', '.join(SPLITS)}")
    root = stdlib_root() if root is None else Path(root).resolve()
    if not root.is_dir():
        raise CorpusError(f"standard library directory not found: {root}")
    return list(_classified(root)[split])


def read_split(split: str, root: Path | None = None) -> list[str]:
    """Texts of the files in ``split``, in the order of :func:`list_split`."""
    return [_read_source(path) or "" for path in list_split(split, root)]
