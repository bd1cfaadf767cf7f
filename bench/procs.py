"""Server processes of the benchmarks: start one, wait until it serves, read its memory.

The servers a benchmark measures (``headrace serve``, ``llama-server``) run as its child
processes so that their resident set can be read from /proc/<pid>/status and so that every
system runs on the same machine, with the same thread count, in the same run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The CPU features the kernels of either engine may use; recorded with every result.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """Which of CPU_FLAGS the first CPU in /proc/cpuinfo reports (empty off Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return {flag: flag in have for flag in CPU_FLAGS}
    return {}


def proc_status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as {field: value} (e.g. "VmRSS": "1234 kB"); {} when unreadable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def kib_to_mib(value: str) -> float:
    """A /proc memory figure ("1234 kB": the kernel writes KiB) in MiB."""
    return int(value.split()[0]) / 1024


def proc_status_mib(pid: int, field: str = "VmRSS") -> float | None:
    """A memory line of /proc/<pid>/status (VmRSS: resident now, VmHWM: its peak) in MiB."""
    try:
        return round(kib_to_mib(proc_status(pid)[field]), 1)
    except (KeyError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time the process has used (shows that idle servers stayed idle)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    """A loopback port free right now (for servers that cannot report the one they took)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server child process whose output goes to a temporary log file.

    ``start`` blocks until ``ready(log_text)`` returns a value other than None (and returns
    it), the process exits (RuntimeError with the log's tail) or
    ``timeout`` passes (TimeoutError). ``stop`` sends SIGTERM (the servers drain), then kills.
    """

    def __init__(self, name: str, cmd: Sequence[str], cwd: Path | None = None) -> None:
        self.name, self.cmd, self.cwd = name, list(cmd), cwd
        self._tmp = tempfile.TemporaryDirectory(prefix="cpu-compare-")
        self.log_path = Path(self._tmp.name) / "server.log"
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    def start(self, ready: Callable[[str], Any], timeout: float) -> Any:
        t0 = time.perf_counter()
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd, env=os.environ
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = ready(self.log_text())
            if value is not None:
                self.start_s = round(time.perf_counter() - t0, 2)
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s: {self.tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return self.log_text()[-chars:]

    def memory(self) -> dict[str, Any]:
        return {
            "rss_mib": proc_status_mib(self.pid, "VmRSS"),
            "peak_rss_mib": proc_status_mib(self.pid, "VmHWM"),
            "cpu_s": cpu_seconds(self.pid),
        }

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            self._tmp.cleanup()
