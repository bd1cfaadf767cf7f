"""Polling and ports for the tests that run servers: one copy of each."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition"
) -> float:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds.
    Returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what}: not reached within {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - start


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
