"""The soak's verdict, computed only from what the run recorded (so a test can recompute it).

- Each request is *expected* when its status code is one its plan allows and, for a
  non-OK code with field prefixes, the message starts with one of them; a message that
  carries a Python class name or a traceback, or runs past ``MAX_DETAILS_CHARS``, is
  unexpected whatever its code. Everything else is *unexpected*: the goal is zero.
- Latency windows: TTFT, TPOT (vLLM's definitions, services/bench/stats.py) and
  end-to-end latency of the normal requests that ended OK in each window, p50/p90/p99.
- RSS: at idle after start, after warm-up and at the end of the load (medians over the
  last ``rss_span`` seconds of each), at idle after the load, and the peak. Growth after
  warm-up compares the larger end figure with the after-warm-up one.
- Leaked KV blocks: KV usage after the load is gone (running and waiting back to 0)
  times the number of blocks; the goal is zero.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from bench.soak.client import SoakRecord
from bench.soak.requests import Expect
from services.bench import stats

MAX_DETAILS_CHARS = 1024  # longer means unbounded input echoed back (issue 10)
_LEAKS = ("<class", "Traceback", "Error(")


def classify(record: SoakRecord, expect: Expect) -> bool:
    """Did the request end as its plan says it must?"""
    if record.code not in expect.codes:
        return False
    if record.code == "OK":
        return True
    if record.details_chars > MAX_DETAILS_CHARS or any(s in record.details for s in _LEAKS):
        return False
    return not expect.prefixes or record.details.startswith(expect.prefixes)


def outcome_counts(records: Sequence[SoakRecord]) -> dict[str, Any]:
    """Counts by kind/variant/code and by expected/unexpected code, with examples."""
    by_kind: dict[str, Counter] = {}
    by_variant: dict[str, Counter] = {}
    for r in records:
        by_kind.setdefault(r.kind, Counter())[r.code] += 1
        by_variant.setdefault(f"{r.kind}/{r.variant}", Counter())[r.code] += 1
    unexpected = [r for r in records if not r.expected]
    return {
        "total": len(records),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "by_variant": {k: dict(v) for k, v in sorted(by_variant.items())},
        "expected_by_code": dict(Counter(r.code for r in records if r.expected)),
        "unexpected_by_code": dict(Counter(r.code for r in unexpected)),
        "unexpected_total": len(unexpected),
        "unexpected_examples": [
            {
                "index": r.index,
                "kind": r.kind,
                "variant": r.variant,
                "code": r.code,
                "details": r.details,
                "t": round(r.end, 3),
            }
            for r in unexpected[:20]
        ],
    }


def seconds_by_kind(records: Sequence[SoakRecord]) -> dict[str, dict[str, float]]:
    """Per kind, send-to-end seconds: how fast a rejection or a cancellation came back."""
    by_kind: dict[str, list[float]] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r.end - r.send)
    return {
        kind: {"median_s": statistics.median(v), "max_s": max(v), "n": len(v)}
        for kind, v in sorted(by_kind.items())
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}_ms": _ms(stats.percentile(values, q)) for q in (50, 90, 99)}


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def latencies(records: Iterable[SoakRecord]) -> dict[str, list[float]]:
    """TTFT, TPOT and e2e (seconds) of the normal requests that ended OK."""
    ok = [r for r in records if r.kind == "normal" and r.code == "OK"]
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": []}
    for r in ok:
        out["e2e"].append(r.end - r.send)
        if r.first_token is None:
            continue
        ttft = r.first_token - r.send
        out["ttft"].append(ttft)
        if r.output_tokens > 1:
            out["tpot"].append((r.end - r.send - ttft) / (r.output_tokens - 1))
    return out


def windows(records: Sequence[SoakRecord], start: float, end: float, width: float) -> list[dict]:
    """Per ``width`` seconds of [start, end) (by the time each request ended): latency
    percentiles and expected/unexpected counts by code."""
    out = []
    t = start
    while t < end:
        inside = [r for r in records if t <= r.end < t + width]
        lat = latencies(inside)
        out.append(
            {
                "t_start": t,
                "t_end": min(t + width, end),
                "requests": len(inside),
                "completed_normal": len(lat["e2e"]),
                **{key: percentiles(values) for key, values in lat.items()},
                "expected_by_code": dict(Counter(r.code for r in inside if r.expected)),
                "unexpected_by_code": dict(Counter(r.code for r in inside if not r.expected)),
            }
        )
        t += width
    return out


def _median_in(samples: Sequence[dict], key: str, a: float, b: float) -> float | None:
    """Median of ``key`` over samples with t in [a, b]; else the last value before b."""
    values = [s[key] for s in samples if key in s and a <= s["t"] <= b]
    if values:
        return statistics.median(values)
    before = [s[key] for s in samples if key in s and s["t"] <= b]
    return before[-1] if before else None


def rss_summary(samples: Sequence[dict], phases: dict[str, list[float]], span: float) -> dict:
    warm_end, load_end = phases["warmup"][1], phases["load"][1]
    out = {
        "idle_start_mib": _median_in(samples, "rss_mib", *phases["idle_start"]),
        "after_warmup_mib": _median_in(samples, "rss_mib", warm_end - span, warm_end),
        "end_of_load_mib": _median_in(samples, "rss_mib", load_end - span, load_end),
        "idle_end_mib": _median_in(samples, "rss_mib", *phases["idle_end"]),
        "peak_mib": max((s["rss_mib"] for s in samples if "rss_mib" in s), default=None),
        "span_s": span,
    }
    ends = [v for v in (out["end_of_load_mib"], out["idle_end_mib"]) if v is not None]
    base = out["after_warmup_mib"]
    out["growth_after_warmup_percent"] = 100 * (max(ends) - base) / base if ends and base else None
    return out


def memory(line: dict | None, rss: dict) -> dict[str, Any] | None:
    """The engine's start-up ``memory`` line (MiB on the CPU) set against the soak's RSS:
    what model tensors and the KV cache explain, and the rest at start and at the end."""
    if not line:
        return None
    model = line.get("model_mib", {}).get("cpu", 0.0)
    kv = line.get("kv_cache_mib", {}).get("cpu", 0.0)

    def other(rss_mib: float | None) -> float | None:
        return None if rss_mib is None else rss_mib - model - kv

    return {
        "model_cpu_mib": model,
        "kv_cache_cpu_mib": kv,
        "rss_at_load_mib": line.get("rss_mib"),
        "other_idle_start_mib": other(rss["idle_start_mib"]),
        "other_idle_end_mib": other(rss["idle_end_mib"]),
    }


def kv_after_load(final: dict, num_blocks: int | None) -> dict[str, Any]:
    """What the engine still holds once the load is gone (``final``: a monitor sample)."""
    usage = final.get("kv_cache_usage")
    leaked = None if usage is None or not num_blocks else round(usage * num_blocks)
    return {
        "kv_cache_usage": usage,
        "num_blocks": num_blocks,
        "leaked_blocks": leaked,
        "running": final.get("running"),
        "waiting": final.get("waiting"),
    }


def goals(rss: dict, kv: dict, counts: dict, rss_limit_percent: float) -> dict[str, Any]:
    """Each goal True/False (None when it could not be measured) and the overall verdict."""
    growth = rss["growth_after_warmup_percent"]
    idle = kv["running"] == 0 and kv["waiting"] == 0 if kv["running"] is not None else None
    checks = {
        "rss_growth_below_limit": None if growth is None else growth < rss_limit_percent,
        "zero_leaked_blocks": None if kv["leaked_blocks"] is None else kv["leaked_blocks"] == 0,
        "engine_idle_after_load": idle,
        "zero_unexpected_errors": counts["unexpected_total"] == 0,
    }
    values = list(checks.values())
    passed = False if False in values else (None if None in values else True)
    return {"rss_growth_limit_percent": rss_limit_percent, **checks, "passed": passed}
