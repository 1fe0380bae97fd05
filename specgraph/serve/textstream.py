"""A request's text as its tokens come, cut at its first stop string.

The text is always the decoding of all its tokens so far (what `specgraph run` prints for them),
handed out in pieces that never take back what they gave: a trailing partial character (U+FFFD,
the rest of its bytes in the next token) waits, and so does text that may be the start of a stop
string. Streamed or not, a request's text is the pieces joined. What ended it, a stop string or
the stop token its last step brought, is left out of the text unless `keep_stop` (vLLM's
include_stop_str_in_output). As in vLLM, `min_tokens` holds stop strings back too: one counts only
where it ends in text that a token after the first `min_tokens` brought.
"""

from __future__ import annotations

from typing import Callable

PARTIAL = "\ufffd"  # what a byte-level tokenizer decodes an incomplete UTF-8 sequence to


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], keep_stop: bool = False,
                 min_tokens: int = 0):
        self.decode, self.stops, self.keep_stop, self.min_tokens = decode, stops, keep_stop, min_tokens
        self.ids: list[int] = []
        self.text = ""  # handed out so far
        self.stop: str | None = None  # the stop string that came: the text ends before it (or with it)
        self._held_back: int | None = None  # characters of the first min_tokens tokens' text, once they came

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def add(self, ids: list[int], last: bool, stop_token: bool = False) -> str:
        """Take a step's tokens (`last`: the request's final ones; `stop_token`: the last of them is
        the stop token that ended it) -> the text that may be handed out now."""
        self.ids.extend(ids)
        text = self.decode(self.ids[:-1] if stop_token and not self.keep_stop else self.ids)
        found = [(at, stop) for at, stop in ((self._find(text, stop), stop) for stop in self.stops) if at >= 0]
        if found:
            at, stop = min(found)
            self.stop = stop
            text = text[: at + len(stop) if self.keep_stop else at]
        elif not last:
            text = text[: len(text) - self._held(text)]
        piece = text[len(self.text):] if text.startswith(self.text) else ""
        self.text += piece
        return piece

    def _find(self, text: str, stop: str) -> int:
        """Where `stop` first occurs in `text` ending past the first min_tokens tokens' text; -1: nowhere."""
        if self._held_back is None:
            if len(self.ids) < self.min_tokens:
                return -1
            self._held_back = len(self.decode(self.ids[: self.min_tokens]).rstrip(PARTIAL)) if self.min_tokens else 0
        return text.find(stop, max(0, self._held_back - len(stop) + 1))

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that must wait: a partial character, or the longest
        ending that begins a stop string."""
        partial = len(text) - len(text.rstrip(PARTIAL))
        begun = max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        return max(partial, begun)
