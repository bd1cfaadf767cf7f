"""Processes for the gateway tests and benchmark: headrace replicas behind the real SMG.

Every wait is bounded and every process is killed on exit (``Stack`` is a context
manager). SMG gets ``HF_ENDPOINT`` pointing at a dead loopback port so it never
reaches for the hub: the tokenizer must come from the worker's GetModelInfo.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import free_port

ROOT = Path(__file__).resolve().parents[2]
DEAD_HF_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens


def smg_binary() -> str | None:
    local = Path(sys.executable).parent / "smg"
    return str(local) if local.exists() else shutil.which("smg")


@dataclass
class Replica:
    process: subprocess.Popen
    port: int
    metrics_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: (name, sorted labels) -> value."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class Stack:
    """Replicas and gateways started by this test; all killed by ``close``."""

    workdir: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    def replica(self, *args: str, timeout: float = 180.0) -> Replica:
        port, metrics_port = free_port(), free_port()
        argv = [sys.executable, "-m", "services.cli.cli", "serve", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--device", "cpu"]
        argv += ["--threads", "1", "--log-format", "json", *args]
        log = open(self.workdir / f"replica-{port}.log", "w")  # noqa: SIM115 (lives on)
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        self.processes.append(process)
        _wait_for_line(process, "headrace ready", timeout)
        return Replica(process, port, metrics_port)

    def gateway(self, replicas: list[Replica], *args: str, timeout: float = 120.0) -> str:
        """``smg launch`` in front of ``replicas``; returns its base URL once ready."""
        port, prom = free_port(), free_port()
        argv = [smg_binary() or "smg", "launch", "--worker-urls", *(r.url for r in replicas)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
        argv += ["--prometheus-port", str(prom), "--worker-startup-check-interval", "1", *args]
        env = {**os.environ, "HF_ENDPOINT": DEAD_HF_ENDPOINT, "NO_COLOR": "1"}
        log = open(self.workdir / f"smg-{port}.log", "w")  # noqa: SIM115 (lives on)
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(process, f"{base}/readiness", timeout)
        return base

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def terminate(replica: Replica, timeout: float = 60.0) -> int:
    """SIGTERM (drain) and the exit status."""
    replica.process.send_signal(signal.SIGTERM)
    return replica.process.wait(timeout=timeout)


def _wait_for_line(process: subprocess.Popen, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {prefix!r}")
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if line.startswith(prefix):
                return line
    raise TimeoutError(f"no {prefix!r} within {timeout} s")


def _wait_ready(process: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with {process.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready within {timeout} s")


def served_model(base: str) -> str:
    import json

    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]
