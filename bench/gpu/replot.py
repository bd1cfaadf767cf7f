"""Draws the PNG of a GPU benchmark's JSON, beside it (no GPU needed).

The one device call (bench/gpu/gpu_check.sh) returns at most 8 files, so there its
benchmarks write their JSON only (``--no-png``); after the call, on any machine:

    python -m bench.gpu.replot bench/results/gpu-check-<date>/*.json

Each file is drawn by the benchmark that wrote it, chosen by its ``benchmark`` field
(kernels-*, step-gap-*, cuda-graphs-*, engine-gpu-*); the PNG gets the JSON's name.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench import common


def draw(path: Path) -> Path:
    """The PNG of one result JSON, written next to it; returns its path."""
    record: dict[str, Any] = json.loads(path.read_text())
    name = record["benchmark"]
    stamp = path.stem.removeprefix(f"{name}-")
    results_dir, common.RESULTS_DIR = common.RESULTS_DIR, path.parent  # where PNGs go
    try:
        _draw(record, name, stamp)
    finally:
        common.RESULTS_DIR = results_dir
    return path.with_suffix(".png")


def _draw(record: dict[str, Any], name: str, stamp: str) -> None:
    if name.startswith("kernels-"):
        from bench.gpu import cuda_kernels

        cuda_kernels.write_png(record["results"], stamp, record["gpu"]["gpu"])
    elif name.startswith("step-gap-"):
        from bench.gpu import step_gap

        settings = record["settings"]
        title = step_gap.title(settings["shape"], record["device"], record["clocks"])
        step_gap.plot(record["rows"], stamp, name, title)
    elif name.startswith("cuda-graphs-"):
        from bench.gpu import cuda_graphs

        title = cuda_graphs.plot_title(record["gpu"])
        cuda_graphs.plot(record["rows"], record["shapes_done"], stamp, name, title)
    elif name.startswith("engine-gpu-"):
        from bench.gpu import engine_gpu

        engine_gpu.plot(record["rows"], stamp, name, engine_gpu.plot_title(record["settings"]))
    else:
        raise ValueError(f"no plot for benchmark {name!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path, help="result files of bench/gpu/*.py")
    args = parser.parse_args(argv)
    for path in args.json:
        print(f"wrote {draw(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
