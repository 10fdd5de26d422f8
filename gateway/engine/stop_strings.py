"""Stop strings matched across token boundaries; matched text is never shown to the client."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Holds back the last ``max(len(stop)) - 1`` characters until they cannot start a match.

    Any occurrence of a stop string ends inside the newest text, so it starts at most
    ``len(stop) - 1`` characters before it: exactly what is held back.
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched)."""
        if not self.stop:
            return text, False
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self._pending = self._pending[: min(hits)], ""
            return out, True
        cut = max(0, len(self._pending) - self._holdback)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back tail, emitted when the sequence ends for another reason."""
        out, self._pending = self._pending, ""
        return out
