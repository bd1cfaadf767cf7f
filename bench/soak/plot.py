"""The soak's PNG: RSS, KV usage with running/waiting, latency percentiles and errors, all
over time, with the warm-up and load phases marked. Needs matplotlib (the bench extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _phases(ax, phases: dict[str, list[float]]) -> None:
    load = phases.get("load")
    if load:
        ax.axvspan(*load, color="tab:blue", alpha=0.06, label="load")
    warm = phases.get("warmup")
    if warm:
        ax.axvline(warm[1], color="grey", linestyle="--", linewidth=0.8, label="end of warm-up")


def _series(ax, samples: list[dict], key: str, **style) -> None:
    points = [(s["t"], s[key]) for s in samples if key in s]
    if points:
        ax.plot(*zip(*points, strict=True), **style)


def _rss(ax, result: dict[str, Any]) -> None:
    samples, rss = result["samples"], result["summary"]["rss"]
    _series(ax, samples, "rss_mib", label="VmRSS")
    _series(ax, samples, "rss_anon_mib", label="RssAnon", linewidth=0.8)
    base = rss.get("after_warmup_mib")
    limit = result["summary"]["goals"]["rss_growth_limit_percent"]
    if base:
        ax.axhline(
            base * (1 + limit / 100),
            color="tab:red",
            linestyle=":",
            linewidth=0.8,
            label=f"after warm-up +{limit:g}%",
        )
    growth = rss.get("growth_after_warmup_percent")
    shown = "n/a" if growth is None else f"{growth:+.2f}%"
    ax.set_title(f"server RSS (growth after warm-up {shown})", fontsize=9)
    ax.set_ylabel("MiB")


def _kv(ax, result: dict[str, Any]) -> None:
    samples = result["samples"]
    _series(ax, samples, "kv_cache_usage", label="KV usage (fraction)", color="tab:green")
    ax.set_ylabel("KV usage")
    twin = ax.twinx()
    _series(twin, samples, "running", label="running", color="tab:blue", linewidth=0.8)
    _series(twin, samples, "waiting", label="waiting", color="tab:orange", linewidth=0.8)
    twin.set_ylabel("sequences")
    twin.legend(fontsize=7, loc="center right")
    kv = result["summary"]["kv_after_load"]
    ax.set_title(f"KV cache (leaked blocks after the load: {kv['leaked_blocks']})", fontsize=9)


def _latency(ax, result: dict[str, Any]) -> None:
    wins = result["windows"]
    mids = [(w["t_start"] + w["t_end"]) / 2 for w in wins]
    for key, color in (("ttft", "tab:blue"), ("tpot", "tab:orange"), ("e2e", "tab:green")):
        for q, style in (("p50", "-"), ("p99", ":")):
            values = [w[key][f"{q}_ms"] for w in wins]
            points = [(t, v) for t, v in zip(mids, values, strict=True) if v is not None]
            if points:
                ax.plot(
                    *zip(*points, strict=True), style, color=color, marker=".", label=f"{key} {q}"
                )
    ax.set_yscale("log")
    ax.set_ylabel("ms (normal requests, per window)")
    ax.set_title("latency percentiles over time", fontsize=9)


def _errors(ax, result: dict[str, Any]) -> None:
    wins = result["windows"]
    width = max((w["t_end"] - w["t_start"] for w in wins), default=1.0)
    starts = [w["t_start"] for w in wins]
    codes = sorted({c for w in wins for c in w["expected_by_code"] if c != "OK"})
    bottom = [0] * len(wins)
    for code in codes:
        heights = [w["expected_by_code"].get(code, 0) for w in wins]
        ax.bar(
            starts,
            heights,
            width=width * 0.9,
            bottom=bottom,
            align="edge",
            label=f"expected {code}",
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    unexpected = [sum(w["unexpected_by_code"].values()) for w in wins]
    ax.bar(
        starts,
        unexpected,
        width=width * 0.9,
        bottom=bottom,
        align="edge",
        color="tab:red",
        label="UNEXPECTED",
    )
    total = result["summary"]["requests"]["unexpected_total"]
    ax.set_title(f"errors per window by code (unexpected in all: {total})", fontsize=9)
    ax.set_ylabel("requests")


def _rate(load: dict[str, Any]) -> str:
    rate = load["request_rate"]
    if rate == "inf":
        return f"closed loop of {load['max_concurrency']}"
    return f"{rate:.3g} req/s"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 9))
    for ax, draw in zip(axes.flat, (_rss, _kv, _latency, _errors), strict=True):
        _phases(ax, result["phases"])
        draw(ax, result)
        ax.set_xlabel("time since start (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    goals = result["summary"]["goals"]
    verdict = {True: "PASS", False: "FAIL", None: "INCOMPLETE"}[goals["passed"]]
    info = result.get("server_info", {})
    fig.suptitle(
        f"headrace soak: {info.get('model_name', '?')} on {info.get('device', '?')}, "
        f"{result['settings']['duration']:g} s at {_rate(result['load'])}: {verdict}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
