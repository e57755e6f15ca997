"""Turning generated tokens into text pieces for streaming, and cutting the text at stop strings.

Decoding one token at a time goes wrong for byte-level BPE: a character of several UTF-8 bytes may be
split over tokens. So the text is always the decode of all the output tokens so far, and a piece is
what was added since the last piece. Text that ends in an incomplete character (decoded as U+FFFD)
is held back until the next token completes it, and so is a tail that could be the start of a stop
string. When a stop string appears, the text ends just before it (OpenAI's rule: the stop string
itself is not returned).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []
        self.text = ""  # the text handed out so far
        self.stopped = False  # a stop string was found: the request must end

    def push(self, token_id: int) -> str:
        """Add a token; return the new text that is safe to hand out now (maybe "")."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        full = self._decode()
        cut = self._find_stop(full)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut])
        safe = len(full.rstrip(REPLACEMENT))
        if self.stop:
            hold = max(len(s) for s in self.stop) - 1
            safe = min(safe, len(full) - hold)
        return self._emit(full[:max(safe, len(self.text))])

    def finish(self) -> str:
        """The request ended: hand out whatever was held back."""
        if self.stopped:
            return ""
        full = self._decode()
        cut = self._find_stop(full)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut])
        return self._emit(full)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special=True)

    def _find_stop(self, full: str) -> int | None:
        # only where a stop string could end in text not yet handed out
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _emit(self, upto: str) -> str:
        if not upto.startswith(self.text):  # the decode changed text already handed out (rare)
            return ""
        piece = upto[len(self.text):]
        self.text = upto
        return piece
