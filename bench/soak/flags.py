"""The soak benchmark's flags, each documented in --help, and their checks."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.soak.requests import parse_mix
from services.bench.flags import add_rows

DEFAULT_MIX = "normal:70,cancel:8,deadline:7,bad:13,oversized:2"
EPILOG = """Flags after `--` go to the launched `headrace serve`, e.g.
  python -m bench.soak --duration 90 -- --model dummy:tiny
  python -m bench.soak --server localhost:50051 --server-pid 12345 --server-log serve.log"""


_WARMUP = "its first seconds that are warm-up (default: 10%% of --duration, at most 120)"
_RATE = "requests/s of the whole mix, or 'auto': --load-fraction of a capacity measured first"
_MOST = "most requests in flight; alone (no --request-rate): a closed loop of this many"
_BURST = "normal requests in the all-at-once capacity burst (default 16)"
_WINDOW = "latency/error window (s; default 60, or --duration/10 when shorter)"
_LOAD = (  # (flag, type, default, help), in --help order
    ("--duration", float, 1200.0, "seconds of load (default 1200)"),
    ("--warmup", float, None, _WARMUP),
    ("--request-rate", None, "auto", _RATE + " (default auto)"),
    ("--load-fraction", float, 0.5, "of capacity (default 0.5)"),
    ("--calibrate-requests", int, 16, _BURST),
    ("--max-concurrency", int, None, _MOST),
    ("--burstiness", float, 1.0, "gamma shape (1 = Poisson)"),
    ("--mix", None, DEFAULT_MIX, f"kind weights (default {DEFAULT_MIX})"),
    ("--input-len", int, 128, "normal prompt tokens, centre"),
    ("--output-len", int, 64, "normal max_tokens, centre"),
    ("--range-ratio", float, 0.9, "lengths uniform in len*(1 +- ratio) (default 0.9)"),
)
_MEASURING = (
    ("--sample-interval", float, 1.0, "RSS and /metrics (s)"),
    ("--window", float, None, _WINDOW),
    ("--idle-seconds", float, 10.0, "idle before and after (s)"),
    ("--drain-timeout", float, 120.0, "wait for in-flight requests, then for an idle engine (s)"),
    ("--rss-span", float, 30.0, "seconds of samples whose median is an RSS figure (default 30)"),
    ("--rss-growth-limit", float, 5.0, "goal, %% (default 5)"),
    ("--progress-every", float, 30.0, "progress line period (s)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="Soak a headrace server: long mixed load at about half capacity; RSS, "
        "KV blocks, latency and error counts over time; pass/fail against issue 10's goals.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--server", metavar="HOST:PORT", help="use this server (default: launch one)")
    g.add_argument("--server-pid", type=int, help="with --server: its pid, for RSS (/proc)")
    g.add_argument("--server-log", type=Path, help="with --server: its JSON log, for 'memory'")
    metrics = "its /metrics (default: the launched one's, or http://HOST:9400/metrics; "
    g.add_argument("--metrics-url", help=metrics + "'none' to skip)")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="launch wait (s)")
    g = p.add_argument_group("load")
    add_rows(g, _LOAD)
    sizes = "oversized prompt sizes, cycled (default 2,6,12)"
    g.add_argument("--oversized-mib", type=_floats, default=[2.0, 6.0, 12.0], help=sizes)
    g.add_argument("--seed", type=int, default=0, help="workload and arrivals seed")
    add_rows(p.add_argument_group("measuring"), _MEASURING)
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", type=Path, help="default bench/results")
    g.add_argument("--name", default="soak", help="file name prefix (default soak)")
    return p


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ours, serve = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    args = build_parser().parse_args(ours)
    args.serve_args = serve
    check(args)
    return args


def check(args: argparse.Namespace) -> None:
    """Fill the derived defaults and refuse what argparse cannot."""
    if args.serve_args and args.server:
        raise SystemExit("flags after `--` are for a launched server, not --server")
    if args.duration <= 0:
        raise SystemExit("--duration must be > 0")
    if args.warmup is None:
        args.warmup = min(120.0, args.duration / 10)
    args.warmup = min(args.warmup, args.duration)
    if args.window is None:
        args.window = min(60.0, args.duration / 10)
    if args.request_rate != "auto" and not float(args.request_rate) > 0:
        raise SystemExit("--request-rate must be > 0 or 'auto'")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    if not 0 < args.load_fraction <= 1 or args.calibrate_requests < 1:
        raise SystemExit("--load-fraction must be in (0, 1], --calibrate-requests >= 1")
    if not args.oversized_mib or min(args.oversized_mib) <= 0:
        raise SystemExit("--oversized-mib: sizes > 0")
    try:
        parse_mix(args.mix)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
