"""The soak benchmark's flags, each documented in --help, and their checks."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.soak.requests import parse_mix

DEFAULT_MIX = "normal:70,cancel:8,deadline:7,bad:13,oversized:2"
EPILOG = """Flags after `--` go to the launched `headrace serve`, e.g.
  python -m bench.soak --duration 90 -- --model dummy:tiny
  python -m bench.soak --server localhost:50051 --server-pid 12345 --server-log serve.log"""


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
    g.add_argument(
        "--metrics-url",
        help="its /metrics (default: the launched one's, or "
        "http://HOST:9400/metrics; 'none' to skip)",
    )
    g.add_argument("--ready-timeout", type=float, default=600.0, help="launch wait (s)")
    g = p.add_argument_group("load")
    g.add_argument("--duration", type=float, default=1200.0, help="seconds of load (default 1200)")
    g.add_argument(
        "--warmup",
        type=float,
        help="its first seconds that are warm-up (default: 10%% of --duration, at most 120)",
    )
    g.add_argument(
        "--request-rate",
        default="auto",
        help="requests/s of the whole mix, or "
        "'auto': --load-fraction of a capacity measured first (default auto)",
    )
    g.add_argument("--load-fraction", type=float, default=0.5, help="of capacity (default 0.5)")
    g.add_argument(
        "--calibrate-requests",
        type=int,
        default=16,
        help="normal requests in the all-at-once capacity burst (default 16)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        help="most requests in flight; alone (no --request-rate): a closed loop of this many",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    g.add_argument("--mix", default=DEFAULT_MIX, help=f"kind weights (default {DEFAULT_MIX})")
    g.add_argument("--input-len", type=int, default=128, help="normal prompt tokens, centre")
    g.add_argument("--output-len", type=int, default=64, help="normal max_tokens, centre")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.9,
        help="lengths uniform in len*(1 +- ratio) (default 0.9)",
    )
    g.add_argument(
        "--oversized-mib",
        type=_floats,
        default=[2.0, 6.0, 12.0],
        help="oversized prompt sizes, cycled (default 2,6,12)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload and arrivals seed")
    g = p.add_argument_group("measuring")
    g.add_argument("--sample-interval", type=float, default=1.0, help="RSS and /metrics (s)")
    g.add_argument(
        "--window",
        type=float,
        help="latency/error window (s; default 60, or --duration/10 when shorter)",
    )
    g.add_argument("--idle-seconds", type=float, default=10.0, help="idle before and after (s)")
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        help="wait for in-flight requests, then for an idle engine (s)",
    )
    g.add_argument(
        "--rss-span",
        type=float,
        default=30.0,
        help="seconds of samples whose median is an RSS figure (default 30)",
    )
    g.add_argument("--rss-growth-limit", type=float, default=5.0, help="goal, %% (default 5)")
    g.add_argument("--progress-every", type=float, default=30.0, help="progress line period (s)")
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
