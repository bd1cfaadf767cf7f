"""The benchmark's PNG: latency CDFs, throughput and running/waiting over time, and for a
sweep throughput and p99 TTFT/TPOT against the request rate. Needs matplotlib (the
``bench`` extra: ``pip install 'headrace[bench]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.bench import stats
from services.bench.runner import RequestRecord


def _records(run: dict[str, Any]) -> list[RequestRecord]:
    out = []
    for r in run["requests"]:
        record = RequestRecord(**{k: v for k, v in r.items() if k != "chunks"})
        record.chunks = [(t, n) for t, n in r["chunks"]]
        out.append(record)
    return out


def _cdf(ax, values: list[float], label: str) -> None:
    ordered = sorted(v * 1000 for v in values)
    if ordered:
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def _latency_cdfs(ax, runs: list[dict[str, Any]], metric: str) -> None:
    for run in runs:
        ok = [r for r in _records(run) if r.ok]
        if metric == "itl":
            values = [v for r in ok for v in stats.itls(r)]
        else:
            fn = {"ttft": stats.ttft, "tpot": stats.tpot, "e2el": stats.e2e}[metric]
            values = [v for r in ok if (v := fn(r)) is not None]
        _cdf(ax, values, f"rate {run['request_rate']}")
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _throughput_over_time(ax, run: dict[str, Any]) -> None:
    times = [t for r in _records(run) if r.ok for t, n in r.chunks for _ in range(n)]
    # About 50 bins, at least 1 s: a bin shorter than a step would alternate full and empty.
    bin_s = max(1.0, max(times, default=0.0) / 50)
    if times:
        bins = max(1, int(max(times) / bin_s) + 1)
        counts = [0] * bins
        for t in times:
            counts[int(t / bin_s)] += 1
        ax.step([i * bin_s for i in range(bins)], [c / bin_s for c in counts], where="post")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"output tok/s (client, {bin_s:.0f} s bins)")
    ax.grid(alpha=0.3)


def _running_waiting(ax, run: dict[str, Any]) -> None:
    samples = run["server_metrics"]["samples"]
    for key in ("running", "waiting"):
        points = [(s["t"], s[key]) for s in samples if key in s]
        if points:
            ax.plot(*zip(*points, strict=True), label=key)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences (server /metrics)")
    ax.grid(alpha=0.3)
    if samples:
        ax.legend(fontsize=7)
    else:
        ax.set_title("no /metrics samples", fontsize=8)


def _sweep(ax_tput, ax_lat, runs: list[dict[str, Any]]) -> None:
    runs = [r for r in runs if r["request_rate"] != "inf"]  # no place on a rate axis
    rates = [r["request_rate"] for r in runs]
    ax_tput.plot(rates, [r["metrics"]["output_throughput"] for r in runs], "o-")
    ax_tput.set_xlabel("request rate (req/s)")
    ax_tput.set_ylabel("output tok/s")
    for key in ("ttft", "tpot"):
        ax_lat.plot(rates, [r["metrics"][key]["p99_ms"] for r in runs], "o-", label=f"p99 {key}")
    ax_lat.set_xlabel("request rate (req/s)")
    ax_lat.set_ylabel("ms")
    ax_lat.legend(fontsize=7)
    for ax in (ax_tput, ax_lat):
        ax.grid(alpha=0.3)


def plot(record: dict[str, Any], path: Path) -> None:
    """Write the PNG for one result record (as report/command build it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'headrace[bench]'") from exc
    runs = record["runs"]
    nrows = 3 if len(runs) > 1 else 2
    fig, axes = plt.subplots(nrows, 3, figsize=(16, 4.2 * nrows), squeeze=False)
    for ax, metric in zip(axes[0], ("ttft", "tpot", "itl"), strict=True):
        _latency_cdfs(ax, runs, metric)
    _latency_cdfs(axes[1][0], runs, "e2el")
    _throughput_over_time(axes[1][1], runs[-1])
    _running_waiting(axes[1][2], runs[-1])
    axes[1][1].set_title(f"last run (rate {runs[-1]['request_rate']})", fontsize=9)
    if nrows == 3:
        _sweep(axes[2][0], axes[2][1], runs)
        axes[2][2].axis("off")
    info = record.get("server_info", {})
    fig.suptitle(
        f"headrace bench serve {record.get('label', '')}: {info.get('model_name', '?')} "
        f"on {info.get('device', '?')}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
