"""Incremental detokenisation with stop strings: the text of a growing list of token ids, released in pieces.

Each step decodes the whole list again and releases the new suffix, except text that could still be the
start of a stop string or an unfinished UTF-8 character; the pieces concatenate to the text a one-shot
decode gives, cut before the first stop string.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    """The released text of one request's generated tokens."""

    def __init__(self, decode: Callable[[list[int]], str | None], stop: list[str] = ()):
        self._decode = decode
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.released = 0      # characters of the decoded text already handed out
        self.stopped = False   # a stop string was found; the text ends before it

    def _text(self) -> str:
        return self._decode(self.ids) or ""

    def add(self, ids: list[int]) -> str:
        """Take new token ids; the text that can be released now."""
        self.ids += ids
        text = self._text()
        if self.stop:
            start = max(0, self.released - max(len(s) for s in self.stop))
            found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if found:
                self.stopped = True
                return self._release(text, min(found))
        safe = len(text)
        while safe > self.released and text[safe - 1] == "\ufffd":  # a character still being spelled
            safe -= 1
        return self._release(text, safe - self._held(text[:safe]))

    def flush(self) -> str:
        """Everything not yet released (at the end of a generation not stopped by a stop string)."""
        return "" if self.stopped else self._release(self._text(), None)

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best

    def _release(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        piece = text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return piece
