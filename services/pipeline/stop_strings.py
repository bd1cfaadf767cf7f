"""Stage 3: stop-string matching over a request's streamed text, with hold-back.

A stop string can straddle two chunks ("...\\n" then "\\n..."), so text that might be
the start of a stop string is held back until the next chunk settles it. We hold
only the longest tail that is a proper prefix of some stop string (never more than
len(longest stop) - 1 characters), so ordinary text streams without delay.

The match is chunking-independent: the stop string whose first occurrence *ends*
earliest wins (ties: the one starting earliest), which is the first stop string a
reader scanning the text character by character would see complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopResult:
    text: str  # text safe to emit now
    matched: str | None = None  # the stop string that ended the stream, if any


class StopStringMatcher:
    """Feed text deltas; get back what may be emitted and whether a stop string hit."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._pending = ""  # received, not yet emitted, known to contain no stop string

    def feed(self, text: str) -> StopResult:
        if not self._stops:
            return StopResult(text)
        buf = self._pending + text
        hit = first_stop(buf, self._stops)
        if hit is not None:
            start, stop = hit
            self._pending = ""
            return StopResult(buf[: start + len(stop) if self._include else start], stop)
        held = self._held_tail_len(buf)
        self._pending = buf[len(buf) - held :]
        return StopResult(buf[: len(buf) - held])

    def flush(self) -> str:
        """The held-back tail, once the stream ended without a stop string."""
        text, self._pending = self._pending, ""
        return text

    def _held_tail_len(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            # Scan candidate starts left to right: the first that fits is the longest.
            i = buf.find(stop[0], max(0, len(buf) - len(stop) + 1))
            while i != -1:
                if len(buf) - i > longest and stop.startswith(buf[i:]):
                    longest = len(buf) - i
                    break
                i = buf.find(stop[0], i + 1)
        return longest


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string that completes first in text, or None."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start == -1:
            continue
        key = (start + len(stop), start, stop)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2])


def truncate_at_stop(text: str, stops: Sequence[str], include_stop: bool = False) -> str:
    """Reference semantics for the whole text at once (tests compare streaming to this)."""
    hit = first_stop(text, stops)
    if hit is None:
        return text
    start, stop = hit
    return text[: start + len(stop)] if include_stop else text[:start]
