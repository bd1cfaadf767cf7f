"""Samples the server while the soak runs: its resident memory and its /metrics gauges.

RSS comes from ``/proc/<pid>/status`` of the server process: VmRSS (with its anonymous
and file-backed parts, RssAnon / RssFile) and the thread count. The server's threads
(gRPC, tokenize pool, step loop, output pool) share one address space, so VmRSS of the
process already is the sum over its threads; there is no per-thread figure to add.
The gauges (running, waiting, KV usage...) come from services/bench/scrape.py. A sample
that cannot be taken (no pid given, endpoint down) leaves its keys out, never stops the run.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.procs import kib_to_mib, proc_status
from services.bench.scrape import scrape

_STATUS_KEYS = {"VmRSS": "rss_mib", "RssAnon": "rss_anon_mib", "RssFile": "rss_file_mib"}
# Labelled counters read at the start and the end: what the server itself counted.
COUNTERS = {
    "headrace_requests_finished_total": "finish_reason",
    "headrace_requests_rejected_total": "reason",
}


def read_status(pid: int) -> dict[str, float]:
    """RSS figures (MiB) and thread count of ``pid``; {} when it cannot be read."""
    status = proc_status(pid)
    out = {name: kib_to_mib(status[key]) for key, name in _STATUS_KEYS.items() if key in status}
    if "Threads" in status:
        out["threads"] = int(status["Threads"])
    return out


def read_counters(url: str | None) -> dict[str, dict[str, float]]:
    """{counter: {label value: count}} for COUNTERS; {} when /metrics cannot be read."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return {}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = COUNTERS.get(sample.name)
            if label and label in sample.labels:
                out.setdefault(sample.name, {})[sample.labels[label]] = sample.value
    return out


class Monitor:
    """Every ``interval`` seconds (a background thread) one sample: t (seconds since
    ``t0``, a time.perf_counter() value), the current ``phase``, RSS and the gauges."""

    def __init__(self, pid: int | None, metrics_url: str | None, interval: float, t0: float):
        self.pid, self.url, self.interval, self.t0 = pid, metrics_url, interval, t0
        self.phase = "start"
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, Any]:
        """Take one sample now, keep it and return it."""
        point: dict[str, Any] = {"t": time.perf_counter() - self.t0, "phase": self.phase}
        if self.pid is not None:
            point |= read_status(self.pid)
        if self.url:
            with contextlib.suppress(OSError, ValueError):  # a missed scrape: no gauges
                point |= scrape(self.url)
        self.samples.append(point)
        return point

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def latest(self, key: str) -> float | None:
        for point in reversed(self.samples):
            if key in point:
                return point[key]
        return None


def server_log_facts(path: Path | None) -> dict[str, Any]:
    """The start-up ``memory`` line and the error/warning lines of a JSON server log."""
    facts: dict[str, Any] = {"memory": None, "levels": {}, "errors": []}
    if path is None or not path.exists():
        return facts
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        level = entry.get("level", "")
        facts["levels"][level] = facts["levels"].get(level, 0) + 1
        if entry.get("event") == "memory":
            facts["memory"] = entry
        elif level in ("error", "critical") and len(facts["errors"]) < 20:
            facts["errors"].append({k: str(v)[:300] for k, v in entry.items()})
    return facts
