"""The CPU kernels against the torch path they replace, op by op and step by step.

Issue 11's directions, each measured against what ran before on the same machine, in
one run, on the embedded SmolLM2-135M's real weights and shapes:

  linear      per projection (qkv, o, gate_up, down, lm_head) and row count: torch fp32
              (the dense path: ``x @ w_t`` up to 2 rows, ``F.linear`` above), the kernels
              on the GGUF blocks with fp32 activations (``quantized``) and with int8
              activations (``quantized-int8``)
  pass        one row through every projection of the model in order (210 matrices + the
              lm_head), as a decode step reads them: the weights stream from DRAM, which
              the per-projection loops above (one weight, cached) do not show
  attention   decode batches over contexts, and one prefill chunk: kernels/reference.py
              (gather + SDPA) against the kernel reading the paged cache in place
  step        whole engine decode steps at batch 1 and 48 for each --weights mode (the
              sum of the above plus everything per layer and per step)

Times are medians of ``--reps`` runs after a warm-up; each op is timed in a loop long
enough to last ~``--min-ms``. Writes ``bench/results/cpu-kernels-<stamp>.json`` and a PNG.
Run: ``make bench-cpu-kernels``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import common
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders import load_model
from compute.models.decoder import fuse
from kernels import reference
from kernels.cpu import build as cpu_build
from kernels.cpu.attention import paged_attention
from kernels.cpu.library import available
from kernels.cpu.quant_linear import quant_linear
from kernels.metadata import AttentionMetadata

MODES = ("dense", "quantized", "quantized-int8")


def timed(fn: Callable[[], object], reps: int, min_ms: float) -> float:
    """Median seconds per call."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_ms / 1000 or calls < 3:
        fn()
        calls += 1
    per_rep = max(1, calls // 3)
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(per_rep):
            fn()
        samples.append((time.perf_counter() - t) / per_rep)
    return statistics.median(samples)


def projections() -> dict[str, tuple]:
    """name -> (quantized weight, dense fp32 weight) for layer 0's fused projections and lm_head."""
    q = load_model("default", quantized=True, progress=False).weights
    p = "model.layers.0."
    parts = {
        "qkv": [q[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"],
        "o": [q[f"{p}self_attn.o_proj.weight"]],
        "gate_up": [q[f"{p}mlp.gate_proj.weight"], q[f"{p}mlp.up_proj.weight"]],
        "down": [q[f"{p}mlp.down_proj.weight"]],
        "lm_head": [q["model.embed_tokens.weight"]],
    }
    out = {}
    for name, ws in parts.items():
        w = fuse(ws)
        out[name] = (w, w.dequantize())
    return out


def bench_linear(args) -> list[dict]:
    rows = []
    weights = projections()
    tiled = {name: qw.tiled() for name, (qw, _) in weights.items()}  # the int8 layout
    for name, (qw, dense) in weights.items():
        dense_t = dense.t().contiguous()
        for n in args.rows:
            if name == "lm_head" and n > 64:
                continue  # logits are computed for sampled rows only
            x = torch.randn(n, qw.cols)

            def torch_fp32(x=x, dense=dense, dense_t=dense_t):
                return x @ dense_t if x.shape[0] <= 2 else F.linear(x, dense)

            row = {"matrix": name, "shape": [qw.rows, qw.cols], "rows": n}
            row["dense_us"] = 1e6 * timed(torch_fp32, args.reps, args.min_ms)
            exact = functools.partial(quant_linear, x, qw)
            int8 = functools.partial(quant_linear, x, tiled[name], int8=True)
            row["quantized_us"] = 1e6 * timed(exact, args.reps, args.min_ms)
            row["quantized_int8_us"] = 1e6 * timed(int8, args.reps, args.min_ms)
            rows.append(row)
            keys = ("dense_us", "quantized_us", "quantized_int8_us")
            times = ", ".join(f"{k[:-3]} {row[k]:.0f} us" for k in keys)
            print(f"linear {name:8s} rows={n:4d}: {times}")
    return rows


def bench_pass(args) -> list[dict]:
    """One row through every projection of the model, in a decode step's order."""
    q = load_model("default", quantized=True, progress=False).weights
    layers = 1 + max(int(k.split(".")[2]) for k in q if k.startswith("model.layers."))
    names = [f"model.layers.{i}" for i in range(layers)]
    matrices = []
    for p in names:
        matrices.append(fuse([q[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]))
        matrices.append(q[f"{p}.self_attn.o_proj.weight"])
        matrices.append(fuse([q[f"{p}.mlp.gate_proj.weight"], q[f"{p}.mlp.up_proj.weight"]]))
        matrices.append(q[f"{p}.mlp.down_proj.weight"])
    matrices.append(q["model.embed_tokens.weight"])
    rows = []
    for mode, int8 in (("quantized", False), ("quantized-int8", True)):
        ws = [w.tiled() if int8 else w for w in matrices]
        xs = {w.cols: torch.randn(1, w.cols) for w in ws}

        def one_pass(ws=ws, xs=xs, int8=int8):
            for w in ws:
                quant_linear(xs[w.cols], w, int8=int8, check=False)

        nbytes = sum(w.nbytes for w in ws)
        seconds = timed(one_pass, args.reps, args.min_ms)
        rows.append({"weights": mode, "matrices": len(ws), "bytes": nbytes,
                     "ms": 1e3 * seconds, "gb_s": nbytes / seconds / 1e9})  # fmt: skip
        print(f"pass {mode:15s}: {len(ws)} matrices, {nbytes / 1e6:.0f} MB in "
              f"{rows[-1]['ms']:.2f} ms ({rows[-1]['gb_s']:.1f} GB/s)")  # fmt: skip
    return rows


def attention_case(batch: int, context: int, qlen: int, block: int = 16):
    """SmolLM2's heads (9 query, 3 KV, dim 64), one layer's cache, scattered blocks."""
    per_seq = -(-context // block)
    blocks = torch.randperm(batch * per_seq + 8)
    shape = (batch * per_seq + 8, block, 3, 64)
    k, v = torch.randn(shape), torch.randn(shape)
    tables = [blocks[i * per_seq : (i + 1) * per_seq].tolist() for i in range(batch)]
    meta = AttentionMetadata.build([qlen] * batch, [context] * batch, tables, block)
    return torch.randn(batch * qlen, 9, 64), k, v, meta


def bench_attention(args) -> list[dict]:
    cases = [(b, c, 1) for b in (1, 16, 48) for c in (128, 512, 2048)] + [(1, 512, 512)]
    rows = []
    for batch, context, qlen in cases:
        q, k, v, meta = attention_case(batch, context, qlen)
        row = {"batch": batch, "context": context, "query_len": qlen}
        call = (q, k, v, meta, 0.125)
        row["reference_us"] = 1e6 * timed(
            functools.partial(reference.paged_attention, *call), args.reps, args.min_ms
        )
        row["kernel_us"] = 1e6 * timed(
            functools.partial(paged_attention, *call), args.reps, args.min_ms
        )
        rows.append(row)
        case = f"batch={batch:3d} context={context:5d} query={qlen:4d}"
        print(f"attention {case}: reference {row['reference_us']:.0f} us, "
              f"kernel {row['kernel_us']:.0f} us")  # fmt: skip
    return rows


def bench_steps(args) -> list[dict]:
    rows = []
    for mode in MODES:
        kernels = "torch" if mode == "dense" else "native"
        engine = Engine(
            EngineConfig(
                cache=CacheConfig(num_blocks=2048),
                scheduler=SchedulerConfig(max_num_seqs=64),
                device=DeviceConfig(device="cpu", cpu_kernels=kernels, weights=mode),
            )
        )
        for batch in (1, 48):
            params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"{mode}-{batch}-{i}", list(range(100, 164)), params)
            while engine.stats().num_running < batch or any(
                s.num_computed_tokens < 64 for s in engine.scheduler.live_sequences()
            ):
                engine.step()  # prefill everything first: the timed steps are pure decode
            row = {"weights": mode, "batch": batch}
            row["step_ms"] = 1e3 * timed(engine.step, args.reps, args.min_ms * 20)
            row["tok_s"] = batch / (row["step_ms"] / 1e3)
            rows.append(row)
            print(f"step {mode:15s} batch={batch:2d}: {row['step_ms']:.1f} ms")
            for i in range(batch):
                engine.abort(f"{mode}-{batch}-{i}")
        del engine
    return rows


def plot(result: dict, stamp: str) -> None:
    fig, axes = common.new_figure(3, width=6.0)
    one = [r for r in result["linear"] if r["rows"] == 1]
    labels = [r["matrix"] for r in one]
    for key, offset in (("dense_us", -0.27), ("quantized_us", 0.0), ("quantized_int8_us", 0.27)):
        axes[0].bar([i + offset for i in range(len(one))], [r[key] for r in one], 0.27,
                    label=key.removesuffix("_us"))  # fmt: skip
    axes[0].set_xticks(range(len(one)), labels)
    axes[0].set_ylabel("µs per call (1 row, log scale)")
    axes[0].set_yscale("log")
    axes[0].set_title("linear, one row (decode)", fontsize=10)
    axes[0].legend(fontsize=8)
    att = result["attention"]
    names = [f"b{r['batch']} c{r['context']} q{r['query_len']}" for r in att]
    axes[1].barh(names, [r["reference_us"] / r["kernel_us"] for r in att])
    axes[1].set_xlabel("reference time / kernel time")
    axes[1].set_title("attention: speedup of the in-place kernel", fontsize=10)
    steps = result["steps"]
    common.bar_panel(
        axes[2], [f"{r['weights']}\nb{r['batch']}" for r in steps], [r["tok_s"] for r in steps],
        "decode tok/s", "engine decode steps",
    )  # fmt: skip
    common.save_figure(fig, "cpu-kernels", stamp, title="CPU kernels vs the torch path")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch (and kernel) threads")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per case (median)")
    p.add_argument("--min-ms", type=float, default=100.0, help="time per repetition, about")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 16, 48, 512], help="input rows of the linear cases")  # fmt: skip
    p.add_argument(
        "--skip", default="", help="comma list of parts to skip: linear,pass,attention,steps"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the CPU kernels cannot be built on this machine")
    skip = {part for part in args.skip.split(",") if part}
    result = {"load_average_start": common.load_average(), "isa": cpu_build.best_isa()}
    for part, fn in (
        ("linear", bench_linear),
        ("pass", bench_pass),
        ("attention", bench_attention),
        ("steps", bench_steps),
    ):
        result[part] = [] if part in skip else fn(args)
        result[f"load_average_after_{part}"] = common.load_average()
    draw = None if skip else (lambda stamp: plot(result, stamp))
    common.publish("cpu-kernels", result, draw, settings=vars(args))


if __name__ == "__main__":
    main()
