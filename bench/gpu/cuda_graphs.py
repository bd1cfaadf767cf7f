"""Decode steps with and without CUDA graphs (issue 16).

For each model shape (dummy weights) an engine with ``--cuda-graphs`` and one without;
for each context (512, 2048) and batch size (1, 8, 64, 256): that many requests with
prompts of the context's length are prefilled, then --steps decode steps are timed
(wall clock, synchronized at the end; EOS ignored) and the requests aborted. Also one
stream end to end: 128 greedy tokens after a 32-token prompt, tokens/s over the decode.

Writes ``bench/results/cuda-graphs-<gpu>-<stamp>.json`` with top-level ``gpu``,
``speedup_batch1`` (eager step time / graph step time at batch 1, context 512, the first
shape), ``single_stream_tok_s`` ({eager, graphs}, first shape) and one row per case, and
a PNG, both rewritten after every shape (``complete`` says whether every shape is in).
Goals: speedup_batch1 >= 3 and single-stream decode >= 1,000 tok/s for
SmolLM2-135M on an H100. ``--device cpu --shapes tiny`` is a dry run of the plumbing
(the "graphs" engine then runs the padded graph buffers eagerly: no capture on a CPU).
Run: ``python bench/cuda_graphs.py`` (``make gpu-check ARGS="versions install graphs"``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from bench import common
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.runner.cuda_graphs import DecodeGraphs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b", help="dummy model shapes")
    p.add_argument("--batches", default="1,8,64,256", help="comma list of batch sizes")
    p.add_argument("--contexts", default="512,2048", help="comma list of context lengths")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per case")
    p.add_argument("--stream-tokens", type=int, default=128, help="single-stream tokens")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA), float16, ...")
    p.add_argument("--kv-cache-memory-gib", type=float, default=24.0, help="KV memory")
    p.add_argument("--name", default="cuda-graphs", help="result file prefix in bench/results/")
    p.add_argument("--no-png", action="store_true", help="write the JSON only (replot later)")
    return p.parse_args(argv)


def make_engine(args: argparse.Namespace, shape: str, graphs: bool, max_seqs: int) -> Engine:
    longest = max(int(c) for c in args.contexts.split(",")) + args.steps + args.stream_tokens
    engine = Engine(
        EngineConfig(
            model=f"dummy:{shape}",
            cache=CacheConfig(block_size=16, memory_gib=args.kv_cache_memory_gib),
            scheduler=SchedulerConfig(
                max_num_seqs=max_seqs, max_num_batched_tokens=8192, max_model_len=longest + 8
            ),
            device=DeviceConfig(device=args.device, dtype=args.dtype, cuda_graphs=graphs),
        )
    )
    if graphs and engine.device.type == "cpu":  # dry run: the buffers, run eagerly
        engine.runner.graphs = DecodeGraphs(
            engine.runner.model, engine.runner.kv_caches, engine.block_size, max_seqs,
            engine.max_model_len, capture=False,
        )  # fmt: skip
    return engine


def decode_step_ms(engine: Engine, args: argparse.Namespace, batch: int, context: int) -> float:
    """Median wall time of a decode step of `batch` sequences at about `context` tokens."""
    rng = random.Random(batch * 7919 + context)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    ids = [f"b{batch}-c{context}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(4, vocab) for _ in range(context)], params)
    while engine.stats().num_waiting or any(
        engine.scheduler.get(r).num_output_tokens == 0 for r in ids
    ):
        engine.step()  # prefill (chunked) until every request decodes
    engine.step()
    times = []
    for _ in range(args.steps):
        common.sync(args.device)
        start = time.perf_counter()
        engine.step()
        common.sync(args.device)
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times) * 1e3


def single_stream_tok_s(engine: Engine, args: argparse.Namespace) -> float:
    vocab = engine.model_config.vocab_size
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
    engine.add_request("stream", [rng.randrange(4, vocab) for _ in range(32)], params)
    stamps = []
    while engine.has_unfinished():
        if engine.step():
            common.sync(args.device)
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def run_shape(args: argparse.Namespace, shape: str) -> list[dict[str, Any]]:
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for graphs in (False, True):
        engine = make_engine(args, shape, graphs, max(batches))
        captured = list(engine.cuda_graph_batch_sizes)
        capture_s = engine.runner.graphs.capture_s if engine.runner.graphs else 0.0
        stream = single_stream_tok_s(engine, args)
        for context in contexts:
            for batch in batches:
                ms = decode_step_ms(engine, args, batch, context)
                row = {
                    "shape": shape, "graphs": graphs, "batch": batch, "context": context,
                    "step_ms": round(ms, 4), "decode_tok_s": round(batch * 1e3 / ms, 1),
                }  # fmt: skip
                print(row, flush=True)
                rows.append(row)
        rows.append({
            "shape": shape, "graphs": graphs, "single_stream_tok_s": round(stream, 1),
            "captured_batch_sizes": captured, "capture_s": round(capture_s, 2),
        })  # fmt: skip
        print(rows[-1], flush=True)
        del engine
    return rows


def step_ms(rows: list[dict], shape: str, graphs: bool, batch: int, context: int) -> float | None:
    for r in rows:
        if (r["shape"], r["graphs"], r.get("batch"), r.get("context")) == (
            shape, graphs, batch, context,
        ):  # fmt: skip
            return r["step_ms"]
    return None


def plot_title(gpu: str) -> str:
    return f"decode step, eager vs CUDA graphs, {gpu}"


def plot(rows: list[dict], shapes: list[str], stamp: str, name: str, title: str) -> None:
    fig, axes = common.new_figure(len(shapes))
    for ax, shape in zip(axes, shapes, strict=True):
        for graphs in (False, True):
            for context in sorted({r["context"] for r in rows if "context" in r}):
                points = [(r["batch"], r["step_ms"]) for r in rows if r["shape"] == shape
                          and r["graphs"] == graphs and r.get("context") == context]  # fmt: skip
                if points:
                    xs, ys = zip(*points, strict=True)
                    label = f"{'graphs' if graphs else 'eager'}, ctx {context}"
                    ax.plot(xs, ys, marker="o", linestyle="-" if graphs else "--", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("decode step, ms")
        ax.set_title(shape)
        ax.legend(fontsize=7)
    common.save_figure(fig, name, stamp, title)


def payload(rows: list[dict], args: argparse.Namespace, gpu: str) -> dict[str, Any]:
    """The JSON's payload; the top-level figures are the first shape's, once it is done."""
    shapes = args.shapes.split(",")
    first, context = shapes[0], min(int(c) for c in args.contexts.split(","))
    eager, graphs = (step_ms(rows, first, g, 1, context) for g in (False, True))
    streams = {
        ("graphs" if r["graphs"] else "eager"): r["single_stream_tok_s"]
        for r in rows
        if r["shape"] == first and "single_stream_tok_s" in r
    }
    done = [s for s in shapes if sum("single_stream_tok_s" in r and r["shape"] == s
                                     for r in rows) == 2]  # fmt: skip
    return {
        "gpu": gpu,
        "speedup_batch1": round(eager / graphs, 2) if eager and graphs else None,
        "single_stream_tok_s": streams,
        "shapes_done": done,
        "complete": done == shapes,
        "rows": rows,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("cuda_graphs: no CUDA device here (use --device cpu for a dry run)")
    shapes = args.shapes.split(",")
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    stamp = common.timestamp()
    name = f"{args.name}-{gpu.replace(' ', '_')}"
    rows: list[dict] = []
    for shape in shapes:
        rows += run_shape(args, shape)
        # After every shape (same file, rewritten): a run killed at its time limit keeps
        # the shapes it finished.
        result = payload(rows, args, gpu)
        path = common.write_result(name, result, stamp, settings=vars(args))
        if not args.no_png:
            plot(rows, result["shapes_done"], stamp, name, plot_title(gpu))
        print(f"wrote {path} ({shape}); speedup_batch1 {result['speedup_batch1']}, "
              f"single stream {result['single_stream_tok_s']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
