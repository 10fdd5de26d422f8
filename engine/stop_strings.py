"""Stop strings matched across token boundaries; matched text is never shown to the client."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Holds back the last ``max(len(stop)) - 1`` characters until they cannot start a match.

    Any occurrence of a stop string ends inside the newest text, so it starts at most
    ``len(stop) - 1`` characters before it: exactly what is held back.

    ``matched`` is the stop string that ended the output (None until one does): the earliest
    occurrence; of several starting there (each a prefix of the next), the shortest. The engine
    hands it on in the final delta (``Delta.matched_stop``), so nobody decodes the output again
    to find it.
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched)."""
        if not self.stop:
            return text, False
        self._pending += text
        hits = [(at, s) for s in self.stop if (at := self._pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self._pending = self._pending[:at], ""
            return out, True
        cut = max(0, len(self._pending) - self._holdback)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back tail, emitted when the sequence ends for another reason."""
        out, self._pending = self._pending, ""
        return out
