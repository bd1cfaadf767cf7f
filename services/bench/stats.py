"""The benchmark's metrics, with vLLM's ``bench serve`` definitions, from client timestamps.

Per successful request: TTFT = first chunk carrying tokens - send; e2e = end - send;
TPOT = (e2e - TTFT) / (output tokens - 1), for requests with more than one token;
ITL = every gap between consecutive chunks carrying tokens (a chunk of several tokens is
one gap, as in vLLM). Throughputs divide by the run's duration (first send to last end).
Goodput is the rate of requests meeting every SLO given (milliseconds): ttft, tpot, e2el.
Percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from services.bench.runner import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linearly interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ttft(r: RequestRecord) -> float | None:
    return r.chunks[0][0] - r.send if r.chunks else None


def e2e(r: RequestRecord) -> float:
    return (r.end or r.send) - r.send


def tpot(r: RequestRecord) -> float | None:
    first = ttft(r)
    if first is None or r.output_tokens < 2:
        return None
    return (e2e(r) - first) / (r.output_tokens - 1)


def itls(r: RequestRecord) -> list[float]:
    times = [t for t, _ in r.chunks]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p99 (and p50) in milliseconds."""
    ms = [v * 1000 for v in values]
    out: dict[str, float | None] = {
        "mean_ms": statistics.fmean(ms) if ms else None,
        "median_ms": statistics.median(ms) if ms else None,
        "std_ms": statistics.pstdev(ms) if ms else None,
    }
    out |= {f"p{q}_ms": percentile(ms, q) for q in PERCENTILES}
    return out


def parse_slos(text: str | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput: {item!r} is not KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        if float(value) <= 0:
            raise ValueError(f"--goodput: {key} must be > 0 ms")
        slos[key] = float(value)
    return slos


def meets_slos(r: RequestRecord, slos: Mapping[str, float]) -> bool:
    measured = {"ttft": ttft(r), "tpot": tpot(r), "e2el": e2e(r)}
    for key, limit_ms in slos.items():
        value = measured[key]
        if value is not None and value * 1000 > limit_ms:
            return False
    return True


def summarize(
    records: Sequence[RequestRecord], duration: float, slos: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """Every metric of one run; rates are per second of ``duration``."""
    ok = [r for r in records if r.ok]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors_by_code": dict(Counter(r.error for r in records if r.error)),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft": distribution([v for r in ok if (v := ttft(r)) is not None]),
        "tpot": distribution([v for r in ok if (v := tpot(r)) is not None]),
        "itl": distribution([v for r in ok for v in itls(r)]),
        "e2el": distribution([e2e(r) for r in ok]),
    }
    if slos:
        summary["goodput_slos_ms"] = dict(slos)
        summary["request_goodput"] = per_s(sum(meets_slos(r, slos) for r in ok))
    return summary
