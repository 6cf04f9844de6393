"""Reading prompt files: one JSON value per line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specdec.errors import PromptFileError

PROMPT_KEYS = ("prompt", "text")
ID_KEYS = ("prompt_ids", "input_ids")


def read_prompts(path: str | os.PathLike) -> list:
    """Prompts from a JSONL file: each line a string, {"prompt": str} or {"prompt_ids": [int, ...]}.

    Blank lines are skipped; anything else malformed is an error naming its line.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptFileError(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompts file {path}: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: not valid JSON ({exc.msg})") from None
        prompts.append(_prompt_of(value, where))
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts")
    return prompts


def _prompt_of(value, where: str):
    if isinstance(value, str):
        prompt = value
    elif isinstance(value, dict):
        found = [key for key in PROMPT_KEYS + ID_KEYS if key in value]
        if not found:
            raise PromptFileError(f"{where}: expected a key {' or '.join(PROMPT_KEYS + ID_KEYS)}")
        prompt = value[found[0]]
        if found[0] in ID_KEYS and not (isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise PromptFileError(f"{where}: {found[0]} must be a list of integers")
    else:
        raise PromptFileError(f"{where}: expected a string or an object, got {type(value).__name__}")
    if isinstance(prompt, str) or isinstance(prompt, list):
        if len(prompt) == 0:
            raise PromptFileError(f"{where}: empty prompt")
        return prompt
    raise PromptFileError(f"{where}: prompt must be a string, got {type(prompt).__name__}")
