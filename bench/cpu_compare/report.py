"""The CPU comparison's result: medians per system, ratios, issue 11's goals, table and PNG.

Pure functions of the raw measurements (bench/cpu_compare/measure.py's ``measure``) and the
systems' ``info()``, so a test can assemble a result from fake measurements.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench import common
from bench.decode import common_prefix

LLAMA, HF = "llama.cpp", "hf"
# Issue 11's targets for the default model: (key, what, part, summary field, test).
RSS_GOAL_MIB = 1.5e9 / 2**20  # "1.5 GB" read as 10^9 bytes (1430.5 MiB), the stricter reading
GOALS = (
    ("decode_120", "single-stream decode >= 120 tok/s", "decode", "decode_tok_s",
     lambda v, s: v >= 120),
    ("decode_vs_llama", "single-stream decode >= llama.cpp's", "decode", "decode_tok_s",
     lambda v, s: _other(s, LLAMA, "decode_tok_s", lambda o: v >= o)),
    ("ttft_512", "TTFT of a 512-token prompt <= 0.5 s", "ttft", "ttft_s", lambda v, s: v <= 0.5),
    ("many_vs_llama", "many streams >= 1.5x llama.cpp server", "many", "many_output_tok_s",
     lambda v, s: _other(s, LLAMA, "many_output_tok_s", lambda o: v >= 1.5 * o)),
    ("many_vs_hf_static", "many streams >= 3x HF static batching", "many", "many_output_tok_s",
     lambda v, s: _other(s, HF, "many_output_tok_s", lambda o: v >= 3 * o)),
    ("rss_idle", "idle RSS of headrace serve <= 1.5 GB", "memory", "rss_idle_mib",
     lambda v, s: v <= RSS_GOAL_MIB),
)  # fmt: skip
# The settings the goals are stated for; a run with others gets no verdict on that part.
ISSUE_SETTINGS = {
    "decode": {"new_tokens": 128},
    "ttft": {"ttft_prompt_len": 512},
    "many": {"num_requests": 48, "prompt_min": 10, "prompt_max": 60, "output_mean": 48,
             "output_cap": 160},
    "memory": {},
}  # fmt: skip


def _other(summary: dict[str, Any], name: str, field: str, test) -> bool | None:
    value = summary.get(name, {}).get(field)
    return None if value is None else bool(test(value))


def _median(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in runs if r.get(field) is not None]
    return round(statistics.median(values), 4) if values else None


def summarize(raw: dict[str, dict[str, list]], infos: dict[str, dict]) -> dict[str, dict]:
    """Per system: medians over the repetitions, and the idle RSS of a server."""
    out: dict[str, dict[str, Any]] = {}
    for name, parts in raw.items():
        decode, ttft, many = parts.get("decode", []), parts.get("ttft", []), parts.get("many", [])
        rates = [r["decode_tok_s"] for r in decode if r.get("decode_tok_s") is not None]
        entry = {
            "decode_tok_s": _median(decode, "decode_tok_s"),
            "decode_tok_s_min_max": [min(rates), max(rates)] if rates else None,
            "ttft_s": _median(ttft, "ttft_s"),
            "many_output_tok_s": _median(many, "output_tok_s"),
            "rss_idle_mib": (infos.get(name, {}).get("idle") or {}).get("rss_mib"),
        }
        if name != HF and raw.get(HF, {}).get("decode"):
            entry["greedy_tokens_as_hf"] = _agreement(decode, raw[HF]["decode"])
        if name != LLAMA and raw.get(LLAMA, {}).get("agree") and parts.get("agree"):
            entry["greedy_tokens_as_llama_cpp"] = [
                common_prefix(mine["token_ids"], theirs["token_ids"])
                for mine, theirs in zip(parts["agree"], raw[LLAMA]["agree"], strict=True)
            ]
        if name == LLAMA:
            entry["server_decode_tok_s"] = _median(decode, "server_predicted_per_second")
            entry["server_ttft_s"] = _median(
                [{"v": r["server_prompt_ms"] / 1000} for r in ttft if "server_prompt_ms" in r], "v"
            )
        out[name] = entry
    return out


def _agreement(mine: list[dict], hf: list[dict]) -> list[int]:
    """Per repetition, how many leading greedy tokens equal HF's on the same prompt: a check
    that every system ran the same model (rounding differences make long runs part late)."""
    theirs = {r["rep"]: r["token_ids"] for r in hf}
    return [common_prefix(r["token_ids"], theirs[r["rep"]]) for r in mine if r["rep"] in theirs]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(summary: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """For every headrace configuration: speed over llama.cpp and HF (>1 = headrace faster;
    for TTFT the other's time over headrace's)."""
    out = {}
    for name, mine in summary.items():
        if not name.startswith("headrace"):
            continue
        r: dict[str, float | None] = {}
        for other, key in ((LLAMA, "llama_cpp"), (HF, "hf")):
            if other not in summary:
                continue
            theirs = summary[other]
            r[f"decode_over_{key}"] = _ratio(mine["decode_tok_s"], theirs["decode_tok_s"])
            r[f"ttft_speedup_over_{key}"] = _ratio(theirs["ttft_s"], mine["ttft_s"])
            many_key = "many_over_hf_static" if other == HF else f"many_over_{key}"
            r[many_key] = _ratio(mine["many_output_tok_s"], theirs["many_output_tok_s"])
        out[name] = r
    return out


def goals(
    summary: dict[str, dict],
    settings: dict[str, Any],
    table: tuple = GOALS,
    stated_for: dict[str, dict[str, Any]] = ISSUE_SETTINGS,
) -> dict[str, dict]:
    """The goals of ``table`` (default issue 11's) per headrace configuration: met
    true/false, or null when a figure (or the system it is compared with) is missing, or the
    run's settings are not the ones the goal is stated for (``stated_for``, per part)."""
    out = {}
    for name, mine in summary.items():
        if not name.startswith("headrace"):
            continue
        out[name] = {}
        for key, what, part, field, test in table:
            value = mine.get(field)
            stated = all(settings.get(k) == v for k, v in stated_for[part].items())
            met = None if value is None or not stated else test(value, summary)
            out[name][key] = {"goal": what, "value": value, "met": met}
            if not stated:
                out[name][key]["note"] = f"run with other settings than {stated_for[part]}"
    return out


def assemble(
    settings: dict[str, Any],
    machine_extra: dict[str, Any],
    plan_desc: dict[str, Any],
    infos: dict[str, dict],
    raw: dict[str, dict[str, list]],
    skipped: dict[str, str],
    load_average: dict[str, list[float]],
    goal_table: tuple = GOALS,
) -> dict[str, Any]:
    """The JSON payload (bench/common.py's write_result adds the commit and timestamp);
    ``goal_table``: the goals judged (default issue 11's, stated for its settings)."""
    summary = summarize(raw, infos)
    return {
        "machine": common.machine_info() | machine_extra,
        "settings": settings,
        "plan": plan_desc,
        "load_average": load_average,
        "skipped": skipped,
        "summary": summary,
        "ratios": ratios(summary),
        "goals": goals(summary, settings, goal_table),
        "systems": {name: {"info": infos.get(name, {}), **parts} for name, parts in raw.items()},
    }


def print_table(payload: dict[str, Any]) -> None:
    ttft = f"TTFT-{payload['plan']['ttft_prompt_tokens']} ms"
    header = ("system", "decode tok/s", ttft, "many tok/s", "idle RSS MiB")
    print("\n{:<26} {:>13} {:>12} {:>11} {:>13}".format(*header))
    for name, s in payload["summary"].items():
        cells = (s["decode_tok_s"], _ms(s["ttft_s"]), s["many_output_tok_s"], s["rss_idle_mib"])
        shown = ["-" if c is None else f"{c:.1f}" for c in cells]
        print(f"{name:<26} {shown[0]:>13} {shown[1]:>12} {shown[2]:>11} {shown[3]:>13}")
    for name, r in payload["ratios"].items():
        if r:
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    for name, g in payload["goals"].items():
        marks = {True: "met", False: "NOT met", None: "n/a"}
        print(f"{name} goals: " + "; ".join(f"{k} {marks[v['met']]}" for k, v in g.items()))
    for name, s in payload["summary"].items():
        if "greedy_tokens_as_llama_cpp" in s:
            new = payload["plan"]["new_tokens"]
            print(f"{name}: leading greedy tokens as llama.cpp's (of {new}): "
                  f"{s['greedy_tokens_as_llama_cpp']}")  # fmt: skip
    for name, why in payload["skipped"].items():
        print(f"{name}: {why}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _wrap(label: str) -> str:
    """headrace[quantized-int8] -> three short lines, so five bars' labels do not collide."""
    return label.replace("[", "\n").replace("]", "").replace("quantized-", "quantized-\n")


def plot(payload: dict[str, Any], stamp: str, name: str) -> None:
    """Four bar panels: decode tok/s, TTFT-512, many-stream tok/s, idle RSS."""
    s = payload["summary"]
    batch = payload["settings"].get("static_batch_size")
    fig, axes = common.new_figure(4, width=4.6)
    panels = (
        ("decode_tok_s", "tokens/s", f"one stream: decode, {payload['plan']['new_tokens']} tok"),
        ("ttft_s", "ms", f"one stream: TTFT, {payload['plan']['ttft_prompt_tokens']}-tok prompt"),
        ("many_output_tok_s", "output tokens/s",
         f"{payload['plan']['workload']['num_requests']} streams at once"),
        ("rss_idle_mib", "MiB", "server RSS at idle after start"),
    )  # fmt: skip
    for ax, (field, unit, title) in zip(axes, panels, strict=True):
        names = [n for n in s if s[n].get(field) is not None]
        static = field.startswith("many")
        labels = [f"hf-static/{batch}" if n == HF and static else n for n in names]
        values = [s[n][field] * (1000 if field == "ttft_s" else 1) for n in names]
        common.bar_panel(ax, [_wrap(label) for label in labels], values, unit, title)
    loads = payload["load_average"]
    title = (f"{payload['machine']['cpu']}, {payload['settings']['threads']} threads; "
             f"load avg start {loads.get('start')} end {loads.get('end')}")  # fmt: skip
    common.save_figure(fig, name, stamp, title=title)
