"""The end-of-run summary table and the result JSON (settings, machine, server, commit)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

_ROWS = (
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Benchmark duration (s)", "duration_s", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Request goodput (req/s)", "request_goodput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
)
_LATENCIES = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st)"),
    ("itl", "Inter-token Latency"),
    ("e2el", "End-to-end Latency"),
)


def print_table(title: str, summary: dict[str, Any], out: TextIO) -> None:
    """vLLM-style: counts and throughputs, then mean/median/p90/p99 of each latency."""
    width = 50
    print(f"{' ' + title + ' ':=^{width}}", file=out)
    for label, key, fmt in _ROWS:
        if summary.get(key) is not None:
            print(f"{label + ':':<40}{fmt.format(summary[key]):>10}", file=out)
    if summary.get("errors_by_code"):
        codes = ", ".join(f"{k}={v}" for k, v in sorted(summary["errors_by_code"].items()))
        print(f"{'Errors by code:':<24}{codes:>26}", file=out)
    for key, name in _LATENCIES:
        print(f"{' ' + name + ' ':-^{width}}", file=out)
        for stat in ("mean", "median", "p90", "p99"):
            value = summary[key][f"{stat}_ms"]
            shown = "-" if value is None else f"{value:.2f}"
            print(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{shown:>10}", file=out)
    print("=" * width, file=out)


def machine() -> dict[str, Any]:
    """What the numbers depend on, without the hostname (results get committed)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def commit() -> dict[str, Any] | None:
    """The git commit of the working directory, when it is a checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path: Path, record: dict[str, Any]) -> None:
    record = {"timestamp": datetime.now(UTC).isoformat(timespec="seconds"), **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
