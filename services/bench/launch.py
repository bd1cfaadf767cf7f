"""``--launch``: start ``headrace serve`` in a subprocess on free ports for the benchmark."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"headrace ready: .* on (?P<host>[^\s:]+):(?P<port>\d+)")
METRICS = re.compile(r"metrics: (?P<url>https?://\S+/metrics)")


@dataclass(frozen=True)
class LaunchedServer:
    """A started ``headrace serve``: its process, gRPC target, metrics URL and log file."""

    process: subprocess.Popen
    target: str
    metrics_url: str
    log_path: Path


def serve_command(serve_args: Sequence[str]) -> list[str]:
    """``headrace serve`` from this interpreter on free loopback ports, quiet logs."""
    return [
        sys.executable,
        "-m",
        "services.cli.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--log-level",
        "warning",
        *serve_args,
    ]


@contextlib.contextmanager
def launched_server(serve_args: Sequence[str], ready_timeout: float) -> Iterator[tuple[str, str]]:
    """``headrace serve <serve_args>`` on free ports; yields (gRPC target, metrics URL);
    SIGTERM (drain) on exit. The server's output goes to a temporary log, shown on failure."""
    with launched_process(serve_args, ready_timeout) as server:
        yield server.target, server.metrics_url


@contextlib.contextmanager
def launched_process(serve_args: Sequence[str], ready_timeout: float) -> Iterator[LaunchedServer]:
    """As ``launched_server``, yielding the process and its log too (the log file lives
    until the context exits)."""
    cmd = serve_command(serve_args)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=os.environ)
        try:
            target, metrics_url = _wait_ready(proc, log_path, ready_timeout)
            yield LaunchedServer(proc, target, metrics_url, log_path)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, log_path: Path, timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text()
        ready, metrics = READY.search(text), METRICS.search(text)
        if ready and metrics:
            return f"{ready['host']}:{ready['port']}", metrics["url"]
        if proc.poll() is not None:
            raise RuntimeError(
                f"the launched server exited with {proc.returncode}:\n{text[-4000:]}"
            )
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout:.0f}s:\n{log_path.read_text()[-4000:]}")
