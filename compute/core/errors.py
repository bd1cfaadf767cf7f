"""``FieldError``: how every check in headrace reports a bad request value.

The field is named by its domain name (``prompt``, ``max_tokens``, ``top_p``); each
service maps it to the path of the field in its own request message (``at``), from
``field`` and ``rule``, never by parsing the message. It is the one such error from the
engine's checks to the status mapping (services/server/status.py: INVALID_ARGUMENT).
"""

from __future__ import annotations


class RequestError(Exception):
    """A request failed; ``code`` is the gRPC status code's name (services/server/status.py)."""

    code = "INTERNAL"


class FieldError(RequestError, ValueError):
    """A value of ``field`` breaks ``rule``; the message is ``"<field>: <rule>"``."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule

    def at(self, field: str) -> FieldError:
        """The same rule, with the field named as the caller's request spells it."""
        return FieldError(field, self.rule)


MAX_ECHO_CHARS = 64


def capped(value: object, quote: bool = True) -> str:
    """``value`` for an error message (repr when ``quote``), at most 64 characters of it.

    Messages go back to clients in gRPC trailers: echoing a 100,000-character input would
    push the trailers past the client's metadata limit and hide the real error.
    """
    text = repr(value) if quote else str(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."
