"""The offline benchmark's JSON payload, terminal report and PNG."""

from __future__ import annotations

from typing import Any

from bench import common
from bench.offline.engine import StepLog
from bench.offline.workload import int_list


def timeline(log: StepLog, max_bins: int = 60) -> dict[str, list[float]]:
    """Output tokens/s in equal time bins of about five steps or more (one step's rate is too
    spiky to read, and a bin narrower than a step shows gaps that are not there)."""
    bins = max(1, min(max_bins, len(log.t) // 5))
    width = log.t[-1] / bins
    counts = [0] * bins
    for t, n in zip(log.t, log.tokens, strict=True):
        counts[min(bins - 1, int(t / width))] += n
    return {
        "t_s": [round((i + 0.5) * width, 3) for i in range(bins)],
        "tok_s": [round(c / width, 2) for c in counts],
    }


def step_trace(log: StepLog) -> dict[str, list]:
    return {
        "t_s": [round(t, 4) for t in log.t],
        "tokens": log.tokens,
        "running": log.running,
        "kv_slots_allocated": log.kv_allocated,
        "kv_slots_used": log.kv_used,
    }


def assemble(args, workload, hf: dict, runs: dict) -> dict[str, Any]:
    """The JSON payload: systems, ratios, sweep, interleave comparison, main run's trace."""
    main_key = (args.max_num_seqs, args.prefill_interval)
    public = {k: {f: v for f, v in r.items() if f != "_log"} for k, r in runs.items()}
    systems = dict(hf)
    if main_key in runs:
        systems = {"headrace": public[main_key], **hf}
    payload: dict[str, Any] = {
        "settings": vars(args),
        "workload": workload.describe(),
        "systems": systems,
        "ratios": ratios(systems),
        "sweep_max_num_seqs": pick(
            public, [(m, args.prefill_interval) for m in int_list(args.sweep_max_num_seqs)]
        ),
        "prefill_interval_comparison": pick(
            public, [(args.max_num_seqs, p) for p in int_list(args.compare_prefill_intervals)]
        ),
    }
    if main_key in runs:
        payload["headrace_timeline"] = timeline(runs[main_key]["_log"])
        payload["headrace_steps"] = step_trace(runs[main_key]["_log"])
    return payload


def ratios(systems: dict[str, dict]) -> dict[str, float]:
    out = {}
    if "headrace" not in systems:
        return out
    for base in ("hf-static", "hf-single"):
        if base in systems:
            rate = systems["headrace"]["output_tok_s"] / systems[base]["output_tok_s"]
            out[f"headrace_over_{base.replace('-', '_')}"] = round(rate, 2)
    return out


def pick(runs: dict[tuple[int, int], dict], keys: list[tuple[int, int]]) -> list[dict]:
    return [runs[k] for k in keys if k in runs]


def report(payload: dict[str, Any]) -> None:
    print(f"\nworkload: {payload['workload']}")
    print(f"\n{'system':<11} {'output tok/s':>13} {'elapsed s':>10}  notes")
    for name, r in payload["systems"].items():
        notes = ""
        if name == "headrace":
            notes = f"kv waste {r['kv_waste']:.2%}, itl p99 {r['itl_p99_ms']} ms"
        elif name == "hf-static":
            notes = f"useful {r['useful_fraction']:.0%} of generated, kv waste (computed) "
            notes += f"{r['kv_waste_computed']:.0%}"
        elif r.get("extrapolated"):
            notes = f"EXTRAPOLATED from {r['requests_run']} requests"
        print(f"{name:<11} {r['output_tok_s']:>13.1f} {r['elapsed_s']:>10.1f}  {notes}")
    for key, value in payload["ratios"].items():
        print(f"{key}: {value:.2f}x")
    print("\nmax_num_seqs sweep:")
    for r in payload["sweep_max_num_seqs"]:
        print(f"  {r['max_num_seqs']:>4}: {r['output_tok_s']:8.1f} tok/s")
    print("\nprefill_interval comparison:")
    for r in payload["prefill_interval_comparison"]:
        print(
            f"  {r['prefill_interval']:>4}: {r['output_tok_s']:8.1f} tok/s, "
            f"itl mean {r['itl_mean_ms']} ms, p99 {r['itl_p99_ms']} ms, "
            f"ttft mean {r['ttft_mean_s']} s"
        )


def plot_timeline(ax, payload: dict[str, Any]) -> None:
    line = payload.get("headrace_timeline")
    if not line:
        ax.set_visible(False)
        return
    ax.plot(line["t_s"], line["tok_s"], color="tab:blue", label="output tokens/s")
    ax.set_xlabel("seconds since all requests were submitted")
    ax.set_ylabel("output tokens/s")
    ax.set_title("headrace over time", fontsize=10)
    steps = payload["headrace_steps"]
    running = ax.twinx()
    running.plot(steps["t_s"], steps["running"], color="tab:gray", alpha=0.6, lw=1)
    running.set_ylabel("running sequences", color="tab:gray")


def plot_sweep(ax, payload: dict[str, Any]) -> None:
    sweep = payload["sweep_max_num_seqs"]
    if not sweep:
        ax.set_visible(False)
        return
    xs = [r["max_num_seqs"] for r in sweep]
    ax.plot(xs, [r["output_tok_s"] for r in sweep], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("headrace throughput vs max_num_seqs", fontsize=10)


def plot_intervals(ax, payload: dict[str, Any]) -> None:
    runs = payload["prefill_interval_comparison"]
    if not runs:
        ax.set_visible(False)
        return
    labels = [f"interval {r['prefill_interval']}" for r in runs]
    common.bar_panel(
        ax, labels, [r["output_tok_s"] for r in runs], "output tokens/s", "prefill_interval"
    )
    for i, r in enumerate(runs):
        text = f"ITL mean {r['itl_mean_ms']:.0f} ms\np99 {r['itl_p99_ms']:.0f} ms"
        ax.text(i, r["output_tok_s"] * 0.5, text, ha="center", fontsize=8, color="white")


def plot(payload: dict[str, Any], stamp: str, name: str) -> None:
    fig, (ax_bar, ax_time, ax_sweep, ax_int) = common.new_figure(2, nrows=2)
    systems = payload["systems"]
    labels = [n + (" (extrap.)" if r.get("extrapolated") else "") for n, r in systems.items()]
    common.bar_panel(
        ax_bar,
        labels,
        [r["output_tok_s"] for r in systems.values()],
        "output tokens/s",
        f"{payload['workload']['num_requests']} requests, "
        + ("all at t=0" if payload["settings"]["arrival_rate"] == 0 else "Poisson arrivals"),
    )
    plot_timeline(ax_time, payload)
    plot_sweep(ax_sweep, payload)
    plot_intervals(ax_int, payload)
    load = payload["load_average_start"]
    common.save_figure(fig, name, stamp, title=f"offline throughput; load average at start {load}")
