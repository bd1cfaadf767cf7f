"""Offline throughput: headrace continuous batching vs HF transformers static batching.

A seeded synthetic workload in the style of Anyscale's continuous-batching study: N requests,
all submitted at once, prompt lengths uniform in [prompt-min, prompt-max] (random token ids),
output lengths exponential with mean output-mean, capped at output-cap (EOS is ignored, so
every request produces exactly its length on every system). Measured in one run, on the same
model (embedded SmolLM2-135M GGUF, fp32) and the same torch thread count:

  headrace         Engine driven step-wise: all requests added, step() until done
  hf-static        HF ``generate`` on left-padded batches of --static-batch-size requests in
                   arrival order; a batch runs until its longest request is done, and only
                   each request's own tokens count as output
  hf-single        HF ``generate`` one request at a time

Also: KV waste of headrace (allocated-but-unused slots / allocated, from engine.stats() after
every step, weighted by allocation), and with --full a max_num_seqs sweep and a
prefill_interval comparison (throughput, inter-token latency) on the same workload. Writes
``bench/results/offline-<stamp>.json`` and a PNG. Run: ``make bench`` (the default stays under
8 minutes on 2 CPU cores; ``make bench ARGS=--full`` for the long sweeps).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import common
from bench.offline.engine import run_all_headrace
from bench.offline.hf import run_hf
from bench.offline.report import assemble, plot, report
from bench.offline.workload import make_workload, model_vocab_size
from services.bench.flags import add_rows

SYSTEMS = ("headrace", "hf-static", "hf-single")


_EXTRA_RUNS = (  # (flag, type, default, help)
    ("--sweep-max-num-seqs", None, "", "max_num_seqs values ('' = skip; --full: 1,4,16,64)"),
    ("--compare-prefill-intervals", None, "", "prefill_interval values ('' = skip; --full: 0,4)"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.offline", description=__doc__, formatter_class=common.HelpFormatter
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    w.add_argument("--prompt-min", type=int, default=16, help="shortest prompt (tokens)")
    w.add_argument("--prompt-max", type=int, default=256, help="longest prompt (tokens)")
    w.add_argument("--output-mean", type=float, default=64, help="mean of the exponential")
    w.add_argument("--output-cap", type=int, default=256, help="longest output (tokens)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload generator")
    w.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals, requests/s (0 = all at t=0); headrace systems only, since "
        "the static baselines have no notion of arrival",
    )
    _add_system_flags(p.add_argument_group("systems"))
    x = p.add_argument_group("extra headrace runs (same workload)")
    add_rows(x, _EXTRA_RUNS)
    x.add_argument(
        "--full",
        action="store_true",
        help="the long run (about 23 min on 2 quiet CPU cores): hf-single on every request, the "
        "max_num_seqs sweep and the prefill_interval comparison, where not given explicitly",
    )
    p.add_argument("--name", default="offline", help="result file prefix in bench/results/")
    args = p.parse_args(argv)
    if args.full:
        _apply_full(args, argv if argv is not None else sys.argv[1:])
    return args


def _add_system_flags(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of systems to run")
    s.add_argument("--max-num-seqs", type=int, default=64, help="headrace max_num_seqs")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="headrace budget")
    s.add_argument("--prefill-interval", type=int, default=0, help="headrace prefill_interval")
    s.add_argument("--static-batch-size", type=int, default=8, help="hf-static batch size")
    s.add_argument(
        "--single-requests",
        type=int,
        default=8,
        help="run hf-single on only the first K requests and extrapolate (0 = all; "
        "the JSON marks an extrapolated figure; --full: 0)",
    )
    s.add_argument("--threads", type=int, default=2, help="torch intra-op threads (all)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (all systems)")
    s.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="weights and KV cache dtype (all systems); the CUDA kernels take float16/bfloat16",
    )


def _apply_full(args: argparse.Namespace, argv: list[str]) -> None:
    """The long sweeps, kept out of the default `make bench` (<= 8 minutes); a flag given
    explicitly wins."""
    for flag, value in _FULL.items():
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            setattr(args, flag[2:].replace("-", "_"), value)


_FULL = {
    "--single-requests": 0,
    "--sweep-max-num-seqs": "1,4,16,64",
    "--compare-prefill-intervals": "0,4",
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    if args.arrival_rate < 0:
        raise SystemExit("--arrival-rate: must be >= 0")
    if args.arrival_rate > 0 and set(systems) != {"headrace"}:
        raise SystemExit("--arrival-rate: only with --systems headrace (baselines run offline)")
    workload = make_workload(args, model_vocab_size())
    load_start = common.load_average()
    hf = run_hf(args, workload, systems) if {"hf-static", "hf-single"} & set(systems) else {}
    runs = run_all_headrace(args, workload) if "headrace" in systems else {}
    payload = assemble(args, workload, hf, runs)
    payload["load_average_start"] = load_start
    payload["load_average_end"] = common.load_average()
    report(payload)
    common.publish(args.name, payload, lambda stamp: plot(payload, stamp, args.name))


if __name__ == "__main__":
    main()
