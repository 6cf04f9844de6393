"""Benchmark prompt sets, built deterministically from the corpus TEST split only.

* ``code-completion``: the start of a held-out function or class (decorators,
  signature, docstring and the first body lines); the model writes the rest.
* ``copy-edit``: a held-out function, then the start of the same function
  restated with one parameter renamed. The continuation is almost entirely in
  the prompt, so drafters that copy from context should shine.
* ``long-context``: consecutive lines of a held-out file, 1,000 to 1,800 zoo
  tokens, leaving room for 128+ new tokens within 2,048 positions.

Each line of ``<name>.jsonl`` is ``{"id", "prompt", "max_new_tokens"}``.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import tempfile
import textwrap
import tokenize
from pathlib import Path

from specdec.zoo import ZooError, data_dir, default_tokenizer_dir
from specdec.zoo import corpus
from specdec.zoo import tokenizer as zoo_tokenizer

TASK_NAMES = ("code-completion", "copy-edit", "long-context")
MAX_PROMPTS = 80
PER_FILE = 6
LONG_MIN_TOKENS = 1000
LONG_MAX_TOKENS = 1800
MAX_NEW_TOKENS = 128


def tasks_dir() -> Path:
    """Folder holding the committed task sets."""
    return data_dir() / "tasks"


def _rank(key: str) -> str:
    """A stable pseudo-random sort key, so selections do not favour early files."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _test_sources() -> list[tuple[str, str]]:
    """(relative path, text) of the test split, sorted by path."""
    root = corpus.stdlib_root()
    return [(p.relative_to(root).as_posix(), p.read_text(encoding="utf-8")) for p in corpus.list_split("test")]


def _definitions(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(qualified name, node) of every function and class, outermost first."""
    found: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                found.append((name, child))
                visit(child, name + ".")

    visit(tree, "")
    return found


def _segment(lines: list[str], node: ast.AST) -> list[str]:
    """Dedented source lines of a definition, decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return textwrap.dedent("".join(lines[first - 1 : node.end_lineno])).splitlines(keepends=True)


def _body_offset(node: ast.AST, first_line: int) -> int:
    """Index (in the segment) of the first body line after the docstring."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
        return body[0].end_lineno - first_line + 1
    return body[0].lineno - first_line


def _parsed(sources: list[tuple[str, str]]):
    for rel, text in sources:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        yield rel, text.splitlines(keepends=True), tree


def _pick(candidates: list[tuple[str, str, dict]], per_file_cap: int = PER_FILE) -> list[dict]:
    """Up to MAX_PROMPTS records, at most ``per_file_cap`` per file, in a stable hashed order."""
    per_file: dict[str, int] = {}
    chosen = []
    for rel, key, record in sorted(candidates, key=lambda item: _rank(item[1])):
        if per_file.get(rel, 0) >= per_file_cap:
            continue
        per_file[rel] = per_file.get(rel, 0) + 1
        chosen.append(record)
        if len(chosen) == MAX_PROMPTS:
            break
    return sorted(chosen, key=lambda r: r["id"])


def code_completion_tasks(sources: list[tuple[str, str]]) -> list[dict]:
    """Prompts that open a held-out definition: header, docstring, first two body lines."""
    candidates = []
    for rel, lines, tree in _parsed(sources):
        for name, node in _definitions(tree):
            segment = _segment(lines, node)
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            cut = _body_offset(node, first) + 2
            if len(segment) - cut < 4 or cut > 60:
                continue
            key = f"{rel}:{name}"
            candidates.append((rel, key, {"id": key, "prompt": "".join(segment[:cut]), "max_new_tokens": MAX_NEW_TOKENS}))
    return _pick(candidates)


def rename_identifier(source: str, old: str, new: str) -> str:
    """Rename every NAME token ``old`` (not attribute accesses) in ``source``."""
    lines = source.splitlines(keepends=True)
    edits = []
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string == old and not (previous is not None and previous.string == "."):
            edits.append(tok.start)
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            previous = tok
    for row, col in reversed(edits):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    return "".join(lines)


def copy_edit_tasks(sources: list[tuple[str, str]]) -> list[dict]:
    """Prompts: a held-out function, then the first lines of a copy with one parameter renamed."""
    candidates = []
    for rel, lines, tree in _parsed(sources):
        for name, node in _definitions(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            segment = _segment(lines, node)
            if not 6 <= len(segment) <= 40:
                continue
            params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
            source = "".join(segment)
            uses = {p: sum(1 for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == p) for p in params if len(p) >= 2}
            usable = [p for p, count in uses.items() if count >= 2]
            if not usable:
                continue
            old = max(usable, key=lambda p: (uses[p], p))
            new = f"{old}_value" if not old.endswith("_value") else f"new_{old}"
            try:
                renamed = rename_identifier(source, old, new)
            except (tokenize.TokenError, IndentationError, SyntaxError):
                continue
            header = f"\n\n# Same function, with `{old}` renamed to `{new}`:\n"
            start = "".join(renamed.splitlines(keepends=True)[:2])
            key = f"{rel}:{name}"
            candidates.append((rel, key, {"id": key, "prompt": source.rstrip("\n") + header + start, "max_new_tokens": MAX_NEW_TOKENS}))
    return _pick(candidates)


def long_context_tasks(sources: list[tuple[str, str]], count_tokens) -> list[dict]:
    """Prompts of consecutive whole lines of one held-out file, LONG_MIN..LONG_MAX tokens."""
    candidates = []
    for rel, text in sources:
        lines = text.splitlines(keepends=True)
        start = 0
        while start < len(lines):
            # Per-line counts only approximate the joined text's count, so grow
            # by the estimate, then check and extend with the exact count.
            end, estimate = start, 0
            while end < len(lines) and estimate < LONG_MIN_TOKENS + 50:
                estimate += count_tokens(lines[end])
                end += 1
            while end < len(lines) and count_tokens("".join(lines[start:end])) < LONG_MIN_TOKENS:
                end += 1
            prompt = "".join(lines[start:end])
            while end > start + 1 and count_tokens(prompt) > LONG_MAX_TOKENS:
                end -= 1
                prompt = "".join(lines[start:end])
            if not LONG_MIN_TOKENS <= count_tokens(prompt) <= LONG_MAX_TOKENS:
                break
            key = f"{rel}:{start + 1}-{end}"
            candidates.append((rel, key, {"id": key, "prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS}))
            start = end
    return _pick(candidates, per_file_cap=2 * PER_FILE)


def build_task_sets(tokenizer_dir: Path | None = None) -> dict[str, list[dict]]:
    """All three task sets as lists of records (pure function of stdlib + tokenizer)."""
    tok = zoo_tokenizer.load_tokenizer(tokenizer_dir or default_tokenizer_dir())
    sources = _test_sources()

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return {
        "code-completion": code_completion_tasks(sources),
        "copy-edit": copy_edit_tasks(sources),
        "long-context": long_context_tasks(sources, count_tokens),
    }


def write_task_sets(out_dir: Path | None = None, tokenizer_dir: Path | None = None) -> dict[str, int]:
    """Write ``<name>.jsonl`` files atomically; returns prompt counts."""
    out_dir = Path(out_dir) if out_dir is not None else tasks_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, records in build_task_sets(tokenizer_dir).items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=out_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, out_dir / f"{name}.jsonl")
        counts[name] = len(records)
    return counts


def load_task_records(name: str, directory: Path | None = None) -> list[dict]:
    """Records of the task set ``name``; raises ZooError for unknown or missing sets."""
    if name not in TASK_NAMES:
        raise ZooError(f"unknown task set {name!r}; expected one of {', '.join(TASK_NAMES)}")
    path = (Path(directory) if directory is not None else tasks_dir()) / f"{name}.jsonl"
    if not path.is_file():
        raise ZooError(f"task set {name!r} is not built ({path} missing); run `specdec zoo tasks`")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_tasks(name: str, directory: Path | None = None) -> list[str]:
    """Prompts of the task set ``name`` ("code-completion", "copy-edit" or "long-context")."""
    return [record["prompt"] for record in load_task_records(name, directory)]
