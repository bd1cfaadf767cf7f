"""Loopback cluster for the load-balancer tests: `headrace serve` replicas (dummy tiny
weights) as subprocesses behind HAProxy running deploy/haproxy.cfg.

The config file is used as shipped except the lines it marks "templated" (listen port,
replica addresses and their /health ports), plus whatever ``overrides`` a test names.
Every process started here is killed by ``Cluster.close`` (tests call it from a finalizer).
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.waiting import free_port

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
READY = re.compile(r"headrace ready: .* on [\w.]+:(\d+)")
METRICS = re.compile(r"metrics: http://[\w.]+:(\d+)/metrics")
HEADRACE = str(Path(sys.executable).with_name("headrace"))


@dataclass
class Replica:
    process: subprocess.Popen
    port: int
    metrics_port: int
    lines: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_replica(extra: tuple[str, ...] = (), timeout: float = 300) -> Replica:
    """`headrace serve --port 0`; the ports come from its ready lines (bounded wait)."""
    args = [HEADRACE, "serve", "--model", "dummy:tiny", "--host", "127.0.0.1", "--port", "0"]
    # One thread each, as docs/deploying.md "Several replicas on one host" says: two or
    # three replicas on a 2-core machine with a thread per core spin-wait for each other at
    # every fork-join (measured: a 2-second drain test took 30 s and ran out of grace).
    args += ["--metrics-port", "0", "--log-format", "json", "--grace-period", "30"]
    args += ["--threads", "1", *extra]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_pump, args=(process, lines), daemon=True).start()
    port = metrics = None
    deadline = time.monotonic() + timeout
    while metrics is None:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            process.kill()
            raise TimeoutError("replica did not announce itself") from None
        port = int(m.group(1)) if (m := READY.search(line)) else port
        metrics = int(m.group(1)) if (m := METRICS.search(line)) else None
    return Replica(process, port, metrics)


def _pump(process: subprocess.Popen, lines: queue.Queue) -> None:
    for line in process.stdout:
        lines.put(line)


def haproxy_config(replicas: list[Replica], listen: int, overrides: Mapping[str, str] = {}) -> str:
    """deploy/haproxy.cfg with its templated lines filled in for loopback replicas."""
    out = []
    for line in HAPROXY_CFG.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("bind ") and "templated" in line:
            line = f"    bind 127.0.0.1:{listen} proto h2"
        elif stripped.startswith("server-template ") and "templated" in line:
            line = "\n".join(
                f"    server replica{i} {r.target} port {r.metrics_port}"
                for i, r in enumerate(replicas)
            )
        for old, new in overrides.items():
            if stripped == old:
                line = f"    {new}"
        out.append(line)
    text = "\n".join(out) + "\n"
    assert text.count("server replica") == len(replicas)
    for old in overrides:
        assert old not in text, f"override target {old!r} not found in {HAPROXY_CFG}"
    return text


@dataclass
class Cluster:
    replicas: list[Replica]
    proxy: subprocess.Popen
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        for process in [self.proxy, *(r.process for r in self.replicas)]:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def start_cluster(tmp: Path, n: int, overrides: Mapping[str, str] = {}) -> Cluster:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    replicas: list[Replica] = []
    try:
        for _ in range(n):
            replicas.append(start_replica())
        port = free_port()
        config = tmp / "haproxy.cfg"
        config.write_text(haproxy_config(replicas, port, overrides))
        proxy = subprocess.Popen(
            [haproxy, "-db", "-f", str(config)],
            stdout=subprocess.DEVNULL, stderr=(tmp / "haproxy.log").open("w"), env={**os.environ},
        )  # fmt: skip
    except BaseException:
        for r in replicas:
            r.process.kill()
        raise
    cluster = Cluster(replicas, proxy, port)
    _wait_listening(cluster)
    return cluster


def _wait_listening(cluster: Cluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.proxy.poll() is not None:
            cluster.close()
            raise RuntimeError(f"haproxy exited with {cluster.proxy.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", cluster.port)) == 0:
                time.sleep(2.5)  # the replicas' first health checks (rise 2, inter 1 s)
                return
        time.sleep(0.1)
    cluster.close()
    raise TimeoutError("haproxy did not listen")


def terminate(replica: Replica) -> None:
    replica.process.send_signal(signal.SIGTERM)
