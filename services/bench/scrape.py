"""Samples the server's Prometheus /metrics while the benchmark runs (a background thread).

Each sample keeps the gauges and counters a reader of the result needs to explain it:
running/waiting sequences, KV usage, preemptions, prefix-cache hit tokens, generated
tokens and the step loop's idle ratio. An unreachable endpoint is recorded, not fatal:
the benchmark measures the client side either way.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.client.client_security import ClientSecurity

# Sample name in the exposition -> key in the result.
SAMPLED = {
    "headrace_requests_running": "running",
    "headrace_requests_waiting": "waiting",
    "headrace_kv_cache_usage_ratio": "kv_cache_usage",
    "headrace_step_loop_idle_ratio": "step_loop_idle_ratio",
    "headrace_preemptions_total": "preemptions",
    "headrace_prefix_cache_hit_tokens_total": "prefix_cache_hit_tokens",
    "headrace_generation_tokens_total": "generation_tokens",
    "headrace_prompt_tokens_total": "prompt_tokens",
}


def scrape(
    url: str, timeout: float = 2.0, security: ClientSecurity | None = None
) -> dict[str, float]:
    """One scrape: the SAMPLED values present at ``url`` (HTTPS and the token per
    ``security``)."""
    security = security or ClientSecurity()
    request = urllib.request.Request(url, headers=dict(security.metadata))
    context = security.ssl_context() if url.startswith("https:") else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SAMPLED and not sample.labels:
                values[SAMPLED[sample.name]] = sample.value
    return values


class MetricsSampler:
    """``start()`` scrapes every ``interval`` seconds until ``stop()``; times are relative
    to ``t0`` (a time.perf_counter() value, the run's start)."""

    def __init__(
        self, url: str | None, interval: float = 0.5, security: ClientSecurity | None = None
    ) -> None:
        self.url = url
        self.interval = interval
        self.security = security
        self.samples: list[dict[str, float]] = []
        self.errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self, t0: float) -> None:
        if not self.url:
            return
        self._t0 = t0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> list[dict[str, float]]:
        """Stop (after one last scrape) and return the samples taken since start."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
        return self.samples

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                self._sample()
                return

    def _sample(self) -> None:
        try:
            values = scrape(self.url, security=self.security)
        except (OSError, ValueError) as exc:
            name = type(exc).__name__
            self.errors[name] = self.errors.get(name, 0) + 1
            return
        self.samples.append({"t": time.perf_counter() - self._t0, **values})

    def report(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "interval_s": self.interval,
            "scrape_errors": self.errors,
            "samples": self.samples,
        }
