"""Timing of the CPU attention path (kernels/reference.py) at SmolLM2 shapes.

Decode batches of 1/16/64 sequences at a given context, full prefills of 16..1024
tokens and prefill chunks over a cached prefix. Each case reports the minimum
over repeats of CPU time (robust on a shared machine, where wall time mostly
measures the neighbours) and the median wall time. Run by hand:

    .venv/bin/python bench/attention_cpu.py [--threads 1] [--context 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/attention_cpu.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bar_panel, new_figure, save_figure, timestamp, write_result  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from kernels.reference import paged_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M


def measure(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Min CPU µs and median wall µs over ``repeats`` calls, after two warm-up calls."""
    fn()
    fn()  # the second warm-up lets the allocator settle on reusable chunks
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu_us_min": min(cpu) * 1e6, "wall_us_median": statistics.median(wall) * 1e6}


def make_case(query_lens: list[int], context_lens: list[int]):
    """A random cache with scattered block tables and the query/metadata for one call."""
    counts = [-(-ctx // BLOCK_SIZE) for ctx in context_lens]
    order = torch.randperm(sum(counts)).tolist()
    tables, start = [], 0
    for count in counts:
        tables.append(order[start : start + count])
        start += count
    shape = (sum(counts), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape), torch.randn(shape)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM)
    return query, key_cache, value_cache, meta


def time_case(query_lens: list[int], context_lens: list[int], repeats: int) -> dict[str, float]:
    query, key_cache, value_cache, meta = make_case(query_lens, context_lens)
    scale = HEAD_DIM**-0.5
    return measure(lambda: paged_attention(query, key_cache, value_cache, meta, scale), repeats)


def run(context: int, repeats: int) -> dict[str, dict[str, float]]:
    cases: dict[str, tuple[list[int], list[int]]] = {}
    for batch in (1, 16, 64):
        cases[f"decode x{batch} @{context}"] = ([1] * batch, [context] * batch)
    for length in (16, 64, 256, 1024):
        cases[f"prefill {length}"] = ([length], [length])
    for qlen, ctx in ((7, 512), (64, 1024), (256, 1024)):
        cases[f"chunk {qlen} @{ctx}"] = ([qlen], [ctx])
    results = {}
    for name, (query_lens, context_lens) in cases.items():
        results[name] = time_case(query_lens, context_lens, repeats)
        print(f"{name:>20}: {results[name]['cpu_us_min']:10.0f} µs cpu (min)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=512, help="decode context length")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = run(args.context, args.repeats)
    stamp = timestamp()
    write_result("attention_cpu", {"results": results}, stamp, settings=vars(args))
    fig, (ax,) = new_figure(1, width=10)
    labels = list(results)
    bar_panel(ax, labels, [r["cpu_us_min"] / 1e3 for r in results.values()], "ms (CPU, min)", "")
    ax.tick_params(axis="x", labelrotation=45)
    save_figure(fig, "attention_cpu", stamp, f"paged_attention on CPU, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
