"""Token ids to text for generation: incremental decoding with stop strings."""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Text of one sequence as its tokens arrive, cut at the first stop string.

    :meth:`add` returns only text that can no longer change: a trailing partial character
    (``\\ufffd`` of an incomplete UTF-8 sequence) and a tail that could still grow into a stop
    string are held back until the next token decides; :meth:`finish` releases them."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False  # a stop string was found: the text is final

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Take one token; return the newly released text ("" when nothing is)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        full = self._decoded()
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(full[:cut])
        safe = len(full)
        while safe and full[safe - 1] == "\ufffd":
            safe -= 1
        hold = 0  # the longest tail that is a proper prefix of a stop string
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if full[safe - k : safe] == s[:k]:
                    hold = max(hold, k)
                    break
        safe -= hold
        return self._release(full[:safe])

    def finish(self) -> str:
        """Release everything held back (the sequence ended without a stop string)."""
        return "" if self.stopped else self._release(self._decoded())

    def _release(self, upto: str) -> str:
        new = upto[len(self.text) :] if upto.startswith(self.text) else ""
        self.text += new
        return new
