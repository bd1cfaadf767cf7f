"""A fleet on loopback: headrace replicas an SMG gateway reaches only over gRPC.

Each replica writes its tokenizer to a directory of its own, which is deleted once the
replica is up, and the gateway runs in a mount namespace of its own where ``/tmp`` is an
empty tmpfs (its cwd and HOME in there too), when this machine allows one (``unshare``:
root, or unprivileged user namespaces): the gateway cannot read any replica's files, as
on another host, so it must fetch the tokenizer with GetTokenizer. Replicas run
tests/support/stall_hook.py (``stall``/``resume`` stop and restart the step loop) and can
be stopped and started again on the same ports (``restart``). Every wait is bounded and
every process is killed on exit.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway_stack import (
    DEAD_HF_ENDPOINT,
    ROOT,
    Replica,
    _wait_for_line,
    _wait_ready,
    smg_binary,
)
from tests.support.waiting import free_port

# The gateway's view: an empty /tmp (where the replicas' files would be), nothing else.
_HIDE = 'mount -t tmpfs headrace-fleet /tmp && mkdir -p "$HOME" && cd "$HOME" && exec "$@"'


@functools.cache
def namespace_prefix() -> tuple[str, ...] | None:
    """The command prefix that runs a program in a mount namespace of its own, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = (unshare, "-m") if os.geteuid() == 0 else (unshare, "-rm")
    probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs x /tmp"], capture_output=True)
    return prefix if probe.returncode == 0 else None


@dataclass
class FleetReplica:
    """One replica; its ports stay its own across restarts."""

    args: tuple[str, ...]
    workdir: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        tokenizer_dir = self.workdir / f"tokenizer-{self.port}-{self.starts}"
        argv = [sys.executable, "-m", "tests.support.stall_hook", "serve"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--metrics-port", str(self.metrics_port), "--device", "cpu", "--threads", "1"]
        argv += ["--log-format", "json", "--tokenizer-dir", str(tokenizer_dir), *self.args]
        log = open(self.workdir / f"replica-{self.port}-{self.starts}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True
        )
        self.starts += 1
        _wait_for_line(self.process, "headrace ready", timeout)
        shutil.rmtree(tokenizer_dir)  # no gateway can read it now: GetTokenizer or nothing

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def restart(self, timeout: float = 300.0) -> None:
        self.stop()
        self.start(timeout)

    def stall(self) -> None:
        """Stop the step loop between two steps (tests/support/stall_hook.py)."""
        self.process.send_signal(signal.SIGUSR1)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGUSR2)

    def value(self, name: str, **labels: str) -> float:
        return Replica(self.process, self.port, self.metrics_port).value(name, **labels)


@dataclass
class Gateway:
    base: str
    prometheus_port: int
    process: subprocess.Popen
    isolated: bool  # in a mount namespace of its own

    def metrics(self) -> dict[tuple[str, tuple], float]:
        url = f"http://127.0.0.1:{self.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the samples whose labels include ``labels``."""
        return sum(
            v
            for (n, sample_labels), v in self.metrics().items()
            if n == name and set(labels.items()) <= set(sample_labels)
        )

    def post(self, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body or {}).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)


@dataclass
class Fleet:
    """Replicas and gateways started here; all killed by ``close``."""

    workdir: Path
    replicas: list[FleetReplica] = field(default_factory=list)
    gateways: list[Gateway] = field(default_factory=list)

    def replica(self, *args: str) -> FleetReplica:
        replica = FleetReplica(tuple(args), self.workdir)
        self.replicas.append(replica)
        replica.start()
        return replica

    def gateway(self, replicas: list[FleetReplica], *args: str, timeout: float = 120.0) -> Gateway:
        port, prom = free_port(), free_port()
        argv = [smg_binary() or "smg", "launch", "--worker-urls", *(r.url for r in replicas)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
        argv += ["--prometheus-port", str(prom), "--worker-startup-check-interval", "1", *args]
        prefix = namespace_prefix()
        if prefix:  # HOME and cwd inside the namespace's empty /tmp
            argv, home = [*prefix, "sh", "-c", _HIDE, "sh", *argv], "/tmp/gateway-home"
        else:  # cwd and HOME away from the replicas' (deleted) tokenizer directories
            home = str(self.workdir / f"gateway-home-{port}")
            Path(home).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_ENDPOINT": DEAD_HF_ENDPOINT, "NO_COLOR": "1", "HOME": home}
        log = open(self.workdir / f"smg-{port}.log", "w")  # noqa: SIM115 (lives on)
        cwd = "/" if prefix else home
        process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        gateway = Gateway(f"http://127.0.0.1:{port}", prom, process, prefix is not None)
        self.gateways.append(gateway)
        _wait_ready(process, f"{gateway.base}/readiness", timeout)
        return gateway

    def stop_gateway(self, gateway: Gateway) -> None:
        if gateway.process.poll() is None:
            gateway.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                gateway.process.wait(timeout=15)
        if gateway.process.poll() is None:
            gateway.process.kill()
            gateway.process.wait(timeout=10)

    def close(self) -> None:
        for gateway in self.gateways:
            if gateway.process.poll() is None:
                gateway.process.kill()
        for replica in self.replicas:
            if replica.process is not None and replica.process.poll() is None:
                replica.process.kill()
        for process in [g.process for g in self.gateways] + [
            r.process for r in self.replicas if r.process is not None
        ]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
