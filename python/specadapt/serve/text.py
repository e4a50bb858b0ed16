"""Incremental detokenization of a request's output with stop strings (``specadapt serve``).

Tokens arrive a round at a time; the text of the whole output is kept, and only complete characters are released
(a token that ends inside a multi-byte character decodes to U+FFFD until the next one completes it). The window
decode follows the usual serving approach: decode ``ids[prefix:]`` and subtract the text of ``ids[prefix:read]``,
so each token costs a decode of a few tokens, not of the whole output.

Stop strings (OpenAI's ``stop``): the output ends before the first occurrence of any of them (the stop string is
not returned); the token that completed it is the last one counted. While streaming, the last
``max(len(stop)) - 1`` characters are held back, because they might be the start of a stop string.
"""

from __future__ import annotations

__all__ = ["IncrementalText"]

_REPLACEMENT = "\ufffd"


class IncrementalText:
    """The text of one request's output, token by token.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=True)``).
        stop: stop strings (empty strings are ignored).

    Attributes:
        text: the output text so far (cut before a stop string once one is found).
        num_tokens: tokens consumed (the stopping token included, those after it not).
        stopped: a stop string was found.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.num_tokens = 0
        self.stopped = False
        self._prefix = 0
        self._read = 0
        self._sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> None:
        """Consume ``tokens`` (ids) in order, stopping at the first that completes a stop string."""
        for token in tokens:
            if self.stopped:
                return
            self.ids.append(int(token))
            self.num_tokens += 1
            before = self._decode(self.ids[self._prefix:self._read])
            after = self._decode(self.ids[self._prefix:])
            if len(after) <= len(before) or after.endswith(_REPLACEMENT):
                continue  # no complete character yet
            delta = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            start = max(len(self.text) - self._hold, 0)
            self.text += delta
            self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def finish(self) -> None:
        """The output ended: release what was held back (a dangling partial character stays out)."""
        self._hold = 0

    def take_delta(self) -> str:
        """Text not handed out yet, except the held-back tail (see the module docstring)."""
        end = len(self.text) if (self.stopped or self._hold == 0) else max(len(self.text) - self._hold, self._sent)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta
