"""Decode paged attention on a GPU: kernels/cuda/launch.py against torch SDPA over gathered K/V.

For batches 1/8/64/256 at contexts 512/2048/8192 (every sequence the same
length), SmolLM2's shape (9 query heads, 3 KV heads, dim 64) and a
Llama-8B-like one (32/8, dim 128), block size 16, fp16, scattered block tables:

- kernel_us: GPU time of one paged_attention call (CUDA events, median of
  --iters after --warmup). Before each timed call a 1 GiB buffer is zeroed,
  which evicts L2 and keeps the GPU busy while Python issues the call, so the
  events bracket GPU work alone.
- call_us: wall time per call of back-to-back calls, host overhead included
  (what a step without CUDA graphs pays per layer: the calls share one
  metadata record, so like layers 2..N of a step they reuse its checked plan).
- decode_partition_size / decode_partitions: what kernels/cuda/attention_plan.py
  chose for the case (smaller partitions for small batches).
- GB/s and % of peak HBM bandwidth, counting the bytes that must move: the K
  and V of every context token once, the query and the output (not the
  partition workspaces or block tables). Peak comes from the device name
  (H100 SXM 3.35 TB/s, H200 4.8 TB/s; see PEAK_BANDWIDTH) and is recorded.
- Baseline, same run: torch SDPA (enable_gqa) after gathering K/V through the
  block tables; timed as gather + SDPA and as SDPA alone on gathered K/V.
- Each decode kernel (--variants, kernels/cuda/launch.py DECODE_VARIANTS: the two-pass
  kernel the engine uses and the one-pass one) on the same case, alternated call by call
  under the same flush: `variants` has each with the names of the CUDA kernels one call
  launched (`kernels`, recorded at the launcher) and its max difference from the first;
  `kernel` is the engine's variant (launch.decode_variant) when it was timed, else the
  first, with what it launched; `fastest` names the quicker variant.
- Prefill (--prefill-seqs, off with --no-prefill): the CuPy prefill kernel (fp32 on CUDA
  cores) against torch SDPA over the gathered pages (kernels/cuda/prefill_sdpa.py, tensor
  cores), alternated, per shape: whole prompts (SDPA's flash kernel) and chunks over a
  cached prefix (its memory-efficient kernel); µs, TFLOP/s counting the visible
  query-key pairs (4 x heads x head dim FLOPs each), the kernels launched, and the max
  difference between the two.
The JSON is rewritten after every case, so a run killed at its time limit keeps the
cases done.

Run by hand on a GPU machine (exits with a message elsewhere):

    python -m bench.gpu.cuda_kernels [--iters 50] [--batches 1 8 64 256] [--contexts 512 2048 8192]

Writes bench/results/kernels-<gpu>-<timestamp>.json and a PNG beside it (--no-png: the
JSON only; python -m bench.gpu.replot draws it later).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as `python bench/kernels.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.cuda import attention_plan
from kernels.cuda import launch as cuda  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402

SHAPES = {  # name: (query heads, KV heads, head dim)
    "smollm2-135m": (9, 3, 64),
    "llama-8b": (32, 8, 128),
}
BLOCK_SIZE = 16
DTYPE = torch.float16
# Datasheet HBM bandwidth by device-name fragment, first match wins (bytes/s).
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM, shown as "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--iters", type=int, default=50, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-baseline", action="store_true", help="skip torch SDPA")
    parser.add_argument(
        "--variants", nargs="+", default=list(cuda.DECODE_VARIANTS), choices=cuda.DECODE_VARIANTS,
        help="decode kernels to time on every case (the first is reported as `kernel`)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-seqs", nargs="+", default=["4x2048/2048", "4x512/4096"],
        help="prefill cases, each NxQ/C: N sequences of Q query tokens over C context tokens",
    )  # fmt: skip
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill cases")
    parser.add_argument("--no-png", action="store_true")
    return parser.parse_args()


def require_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU: torch.cuda.is_available() is False here")
    if not cuda.is_available():
        sys.exit("bench/kernels.py needs CuPy for the kernels: pip install cupy-cuda13x")


def peak_bandwidth(name: str) -> float | None:
    return next((bw for fragment, bw in PEAK_BANDWIDTH if fragment in name), None)


def gpu_facts() -> dict:
    import cupy

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[0]  # fmt: skip
    except (OSError, subprocess.CalledProcessError, IndexError):
        driver = None
    return {
        "gpu": props.name,
        "driver": driver,
        "cuda_runtime": torch.version.cuda,
        "cupy": cupy.__version__,
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "peak_bandwidth_bytes_per_s": peak_bandwidth(props.name),
    }


# ----------------------------------------------------------------------------- one case


def make_case(shape: tuple[int, int, int], batch: int, context: int, query_len: int = 1) -> dict:
    """Random fp16 query and caches; each sequence's blocks scattered over the cache."""
    heads, kv_heads, head_dim = shape
    per_seq = math.ceil(context / BLOCK_SIZE)
    cache_shape = (batch * per_seq, BLOCK_SIZE, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, dtype=DTYPE, device="cuda")
    value_cache = torch.randn(cache_shape, dtype=DTYPE, device="cuda")
    order = torch.randperm(batch * per_seq).view(batch, per_seq)
    meta = AttentionMetadata.build(
        [query_len] * batch, [context] * batch, order.tolist(), BLOCK_SIZE, device="cuda"
    )
    query = torch.randn(batch * query_len, heads, head_dim, dtype=DTYPE, device="cuda")
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, meta=meta)


def gather(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[N, B, Hkv, D] through tables [S, C] -> [S, Hkv, context, D] for SDPA."""
    batch, cols = tables.shape
    gathered = cache[tables.long()].view(batch, cols * BLOCK_SIZE, *cache.shape[2:])
    return gathered[:, :context].transpose(1, 2)


def time_gpu(fn: Callable[[], object], iters: int, warmup: int, flush: torch.Tensor) -> float:
    """Median µs of fn between CUDA events, each call behind an L2-evicting memset."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_wall(fn: Callable[[], object], iters: int) -> float:
    """µs per call of back-to-back calls, host overhead included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def bytes_moved(shape: tuple[int, int, int], batch: int, context: int) -> int:
    heads, kv_heads, head_dim = shape
    element = torch.finfo(DTYPE).bits // 8
    kv = 2 * batch * context * kv_heads * head_dim
    return (kv + 2 * batch * heads * head_dim) * element


def bandwidth(nbytes: int, micros: float, peak: float | None) -> dict:
    rate = nbytes / (micros * 1e-6)
    percent = None if peak is None else round(100 * rate / peak, 1)
    return {"us": round(micros, 2), "gb_per_s": round(rate / 1e9, 1), "percent_of_peak": percent}


def with_variant(
    variant: str, fn: Callable[[], torch.Tensor], setting: str = "decode_variant"
) -> Callable[[], torch.Tensor]:
    """fn run with kernels/cuda/launch.py's `setting` (decode_variant, prefill_variant) set
    to `variant`, put back after."""

    def run() -> torch.Tensor:
        before = getattr(cuda, setting)
        setattr(cuda, setting, variant)
        try:
            return fn()
        finally:
            setattr(cuda, setting, before)

    return run


def launched_kernels(fn: Callable[[], object]) -> list[str]:
    """The CUDA kernels one call of fn launches, by name, in order (recorded at
    kernels/cuda/launch.py's launcher)."""
    names: list[str] = []
    real = cuda._launch

    def record(device, file, name, *rest):
        names.append(name)
        return real(device, file, name, *rest)

    cuda._launch = record
    try:
        fn()
    finally:
        cuda._launch = real
    return names


def time_variants(
    calls: dict[str, Callable[[], object]], iters: int, warmup: int, flush: torch.Tensor
) -> dict[str, float]:
    """Median µs of each call, the calls alternated (A B A B) so that clock and thermal
    drift fall on all of them alike; each behind an L2-evicting memset, as time_gpu."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iters):
        for name, fn in calls.items():
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def run_case(name, shape, batch, context, args, flush, peak) -> dict:
    case = make_case(shape, batch, context)
    scale = 1.0 / math.sqrt(shape[2])
    calls = {
        v: with_variant(v, lambda: cuda.paged_attention(**case, scale=scale)) for v in args.variants
    }
    ours = calls[args.variants[0]]
    nbytes = bytes_moved(shape, batch, context)
    result = {"shape": name, "batch": batch, "context": context, "bytes": nbytes}
    plan = attention_plan.build_plan(
        case["query"], case["key_cache"], case["value_cache"], case["meta"]
    )
    result["decode_partition_size"] = plan.decode_partition_size  # chosen for this batch
    result["decode_partitions"] = plan.decode_partitions
    micros = time_variants(calls, args.iters, args.warmup, flush)
    reference = ours().float()
    result["variants"] = {
        v: {
            **bandwidth(nbytes, micros[v], peak),
            "kernels": launched_kernels(calls[v]),
            "max_abs_diff_vs_first": (calls[v]().float() - reference).abs().max().item(),
        }
        for v in args.variants
    }
    result["fastest"] = min(args.variants, key=micros.__getitem__)
    engine = cuda.decode_variant if cuda.decode_variant in args.variants else args.variants[0]
    result["kernel"] = {"variant": engine, **result["variants"][engine]}
    result["kernel"]["call_us"] = round(time_wall(calls[engine], args.iters), 2)
    if not args.no_baseline:
        result.update(run_baseline(case, shape, context, args, flush, peak, nbytes, ours()))
    return result


def run_baseline(case, shape, context, args, flush, peak, nbytes, ours) -> dict:
    q = case["query"].unsqueeze(2)  # [S, H, 1, D]
    tables = case["meta"].block_tables

    def gathered():
        k = gather(case["key_cache"], tables, context)
        v = gather(case["value_cache"], tables, context)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    k = gather(case["key_cache"], tables, context).contiguous()
    v = gather(case["value_cache"], tables, context).contiguous()
    alone = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    max_diff = (alone().squeeze(2).float() - ours.float()).abs().max().item()
    return {
        "sdpa_with_gather": bandwidth(
            nbytes, time_gpu(gathered, args.iters, args.warmup, flush), peak
        ),
        "sdpa_alone": bandwidth(nbytes, time_gpu(alone, args.iters, args.warmup, flush), peak),
        "max_abs_diff_vs_sdpa": max_diff,
    }


# ----------------------------------------------------------------------------- prefill


def parse_prefill(text: str) -> tuple[int, int, int]:
    """ "NxQ/C" -> (N sequences, Q query tokens, C context tokens), Q <= C."""
    count, rest = text.split("x")
    query_len, context = rest.split("/")
    n, q, c = int(count), int(query_len), int(context)
    if not (n > 0 and 2 <= q <= c):
        raise ValueError(f"--prefill-seqs {text}: need N > 0 and 2 <= Q <= C")
    return n, q, c


def prefill_flops(shape: tuple[int, int, int], count: int, query_len: int, context: int) -> int:
    """4 x heads x head dim FLOPs per visible query-key pair (QK^T and PV), causal."""
    heads, _, head_dim = shape
    pairs = sum(context - query_len + i + 1 for i in range(query_len))
    return 4 * heads * head_dim * pairs * count


def run_prefill_case(name, shape, spec: str, args, flush) -> dict:
    count, query_len, context = parse_prefill(spec)
    case = make_case(shape, count, context, query_len)
    scale = 1.0 / math.sqrt(shape[2])
    plain = lambda: cuda.paged_attention(**case, scale=scale)  # noqa: E731
    calls = {v: with_variant(v, plain, "prefill_variant") for v in cuda.PREFILL_VARIANTS}
    micros = time_variants(calls, args.iters, args.warmup, flush)
    flops = prefill_flops(shape, count, query_len, context)
    first = calls[cuda.PREFILL_VARIANTS[0]]().float()
    return {
        "shape": name, "sequences": count, "query_len": query_len, "context": context,
        "flops": flops,
        "variants": {
            v: {"us": round(micros[v], 2), "tflop_s": round(flops / micros[v] / 1e6, 2),
                "kernels": launched_kernels(calls[v])}
            for v in calls
        },
        "fastest": min(calls, key=micros.__getitem__),
        "max_abs_diff_sdpa_vs_cupy": (calls["sdpa"]().float() - first).abs().max().item(),
    }  # fmt: skip


# ----------------------------------------------------------------------------- report


def print_table(results: list[dict]) -> None:
    variants = list(results[0]["variants"]) if results else []
    print(f"{'shape':14} {'batch':>5} {'ctx':>5} "
          + "".join(f"{v + ' us':>13} {'% peak':>7} " for v in variants)
          + f"{'call us':>8} {'sdpa+gather':>11} {'sdpa':>8} {'% peak':>7}")  # fmt: skip
    for r in results:
        k, g, s = r["kernel"], r.get("sdpa_with_gather", {}), r.get("sdpa_alone", {})
        kernels = "".join(
            f"{r['variants'][v]['us']:>13} {r['variants'][v]['percent_of_peak']!s:>7} "
            for v in variants
        )
        print(
            f"{r['shape']:14} {r['batch']:>5} {r['context']:>5} {kernels}{k['call_us']:>8} "
            f"{g.get('us', '-')!s:>11} {s.get('us', '-')!s:>8} "
            f"{s.get('percent_of_peak', '-')!s:>7}"
        )


def write_png(results: list[dict], stamp: str, gpu: str) -> Path:
    from bench.common import new_figure, save_figure

    shapes = sorted({r["shape"] for r in results})
    fig, axes = new_figure(len(shapes))
    for ax, shape in zip(axes, shapes, strict=True):
        for context in sorted({r["context"] for r in results}):
            rows = [r for r in results if r["shape"] == shape and r["context"] == context]
            for variant, style in zip(rows[0]["variants"], ("-", "--"), strict=False):
                gbps = [r["variants"][variant]["gb_per_s"] for r in rows]
                label = f"ctx {context}, {variant}"
                ax.plot([r["batch"] for r in rows], gbps, style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("GB/s (K+V+q+out)")
        ax.set_title(shape, fontsize=10)
        ax.legend(fontsize=8)
    return save_figure(fig, f"kernels-{_slug(gpu)}", stamp, title=f"paged decode attention, {gpu}")


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def main() -> None:
    args = parse_args()
    require_gpu()
    from bench.common import timestamp, write_result

    facts = gpu_facts()
    peak = facts["peak_bandwidth_bytes_per_s"]
    flush = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    results: list[dict] = []
    prefill: list[dict] = []
    stamp = timestamp()
    settings = {**vars(args), "block_size": BLOCK_SIZE, "dtype": str(DTYPE)}
    engine = {"decode_variant": cuda.decode_variant, "prefill_variant": cuda.prefill_variant}

    def save() -> Path:
        payload = {"gpu": facts, "engine": engine, "cases_done": len(results) + len(prefill),
                   "results": results, "prefill": prefill}  # fmt: skip
        return write_result(f"kernels-{_slug(facts['gpu'])}", payload, stamp, settings)

    for name in args.shapes:
        for context in args.contexts:
            for batch in args.batches:
                results.append(run_case(name, SHAPES[name], batch, context, args, flush, peak))
                torch.cuda.empty_cache()
                path = save()
    for name in [] if args.no_prefill else args.shapes:
        for spec in args.prefill_seqs:
            prefill.append(run_prefill_case(name, SHAPES[name], spec, args, flush))
            print(prefill[-1], flush=True)
            torch.cuda.empty_cache()
            path = save()
    print_table(results)
    print(f"wrote {path}")
    if not args.no_png:
        print(f"wrote {write_png(results, stamp, facts['gpu'])}")


if __name__ == "__main__":
    main()
