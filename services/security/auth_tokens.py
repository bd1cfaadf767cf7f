"""The bearer tokens the server accepts: read from ``--auth-token-file``, re-read on change.

The file holds one token per line; blank lines and lines starting with ``#`` are
skipped. A presented token is compared with every accepted one in constant time (both
sides hashed first, so neither the content nor the length of a token leaks through
timing), and the comparison never stops early. The file is checked for changes at
most once a second; what it holds then is what is accepted (fail closed: a file that
became unreadable or empty accepts nothing until it is fixed).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import threading
import time
from pathlib import Path

from kernels.log import get_logger

FLAG = "--auth-token-file"
# An HTTP header value without spaces: RFC 6750's token68 and more (printable ASCII).
_TOKEN = re.compile(r"[\x21-\x7e]+")
CHECK_INTERVAL = 1.0  # seconds between looks at the file's mtime

log = get_logger(__name__)


def read_tokens(path: str | os.PathLike) -> tuple[str, ...]:
    """The tokens in ``path``; ValueError (naming the flag and line) if there are none or
    a line is not a token. Token text never appears in a message."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{FLAG}: cannot read {path}: {_reason(exc)}") from None
    tokens = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _TOKEN.fullmatch(line):
            raise ValueError(
                f"{FLAG}: line {number} of {path} is not a token (printable ASCII, no spaces)"
            )
        tokens.append(line)
    if not tokens:
        raise ValueError(f"{FLAG}: {path} holds no token (one per line)")
    return tuple(tokens)


def _reason(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # follows symlinks: a Kubernetes secret swaps one
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class TokenFile:
    """The accepted tokens, re-read when the file changes; thread-safe."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._stamp = _stamp(self.path)
        self._digests = tuple(_digest(t) for t in read_tokens(self.path))
        self._checked = time.monotonic()

    def accepts(self, token: str) -> bool:
        """Whether ``token`` is one of the accepted tokens (constant time over all of them)."""
        presented = _digest(token)
        match = False
        for digest in self._current():
            match |= hmac.compare_digest(presented, digest)
        return match

    def _current(self) -> tuple[bytes, ...]:
        now = time.monotonic()
        if now - self._checked < CHECK_INTERVAL:
            return self._digests
        with self._lock:
            self._checked = now
            stamp = _stamp(self.path)
            if stamp != self._stamp:
                self._stamp = stamp
                self._reload()
            return self._digests

    def _reload(self) -> None:
        try:
            tokens = read_tokens(self.path)
        except ValueError as exc:
            log.error("auth token file unusable: no token accepted until fixed", error=str(exc))
            self._digests = ()
            return
        self._digests = tuple(_digest(t) for t in tokens)
        log.info("auth tokens reloaded", path=self.path, tokens=len(tokens))
