"""Device idle time between engine steps, synchronous vs asynchronous output.

Dummy weights of a model shape (default SmolLM2-135M's), B requests decoding together
(random 32-token prompts, EOS ignored). Once every request is past its prefill, each
launch (build the batch, forward, sample, queue the id copy) is bracketed by a pair of
timestamps through the runner's ``launch_hooks``: CUDA events on a GPU, so the device's
busy time per step is end - begin of a launch and its idle gap before the next step is
begin(N+1) - end(N) (an event is stamped when the stream reaches it: a step queued
behind the previous one shows a gap near 0). Reported per mode and batch size: median
and p90 of step and gap, and gap / step. The goal (issue 17): gap < 10% of the step at
batch 64 with asynchronous output.

On the CPU the same run uses host clocks: a launch returns when its work is done, so
the "gap" is the host's time between launches (scheduling, output handling); it checks
the plumbing, it is not the GPU figure.

Each row records whether the decode steps replayed CUDA graphs (the engine's default on
CUDA; a failed capture falls back to eager steps, logged): ``cuda_graphs`` (any batch size
captured), ``captured_batch_sizes``, and ``graph_replays`` during the measured steps.

Writes ``bench/results/step-gap-<device>-<stamp>.json`` and a PNG (``--no-png``: the JSON
only; ``python -m bench.gpu.replot`` draws it later).
Run: ``python bench/step_gap.py --device cuda`` (part of ``make gpu-check``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench import common
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from services.bench.stats import percentile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda or cpu (cpu: host clocks, a dry run)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on the CPU), ...")
    p.add_argument("--shape", default="smollm2-135m", help="dummy model shape")
    p.add_argument("--batches", default="8,64", help="comma list of batch sizes")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=100, help="decode steps measured per run")
    p.add_argument("--warmup", type=int, default=10, help="decode steps before measuring")
    p.add_argument("--modes", default="sync,async", help="comma list: sync, async")
    p.add_argument("--name", default="step-gap", help="result file prefix in bench/results/")
    p.add_argument("--no-png", action="store_true", help="write the JSON only")
    return p.parse_args(argv)


class Timeline:
    """Timestamps around every launch: CUDA events on a GPU, host clocks on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[object, object]] = []
        self.recording = False
        self._begin: object = None

    def before(self) -> None:
        if self.recording:
            self._begin = self._stamp()

    def after(self) -> None:
        if self.recording:
            self.marks.append((self._begin, self._stamp()))

    def _stamp(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, start: object, end: object) -> float:
        if self.cuda:
            return start.elapsed_time(end)  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]

    def steps_and_gaps(self) -> tuple[list[float], list[float]]:
        """Milliseconds: each launch's span, and each idle gap before the next launch."""
        if self.cuda:
            torch.cuda.synchronize()
        steps = [self._ms(b, e) for b, e in self.marks]
        gaps = [
            self._ms(e, b) for (_, e), (b, _) in zip(self.marks[:-1], self.marks[1:], strict=True)
        ]
        return steps, [max(0.0, g) for g in gaps]


def run(args: argparse.Namespace, batch: int, async_output: bool) -> dict:
    total = args.warmup + args.steps + 4
    engine = Engine(
        EngineConfig(
            model=f"dummy:{args.shape}",
            cache=CacheConfig(
                block_size=16, num_blocks=batch * (-(-(args.prompt_len + total) // 16) + 1)
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * args.prompt_len)
            ),
            device=DeviceConfig(device=args.device, dtype=args.dtype, async_output=async_output),
        )
    )
    timeline = Timeline(engine.device.type == "cuda")
    engine.runner.launch_hooks = (timeline.before, timeline.after)
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"r{i}", [rng.randrange(4, vocab) for _ in range(args.prompt_len)], params
        )
    for _ in range(args.warmup + 1):  # the prefill step, then warm decode steps
        engine.step()
    graphs = engine.runner.graphs
    replays_before = graphs.replays if graphs is not None else 0
    timeline.recording = True
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    if timeline.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    timeline.recording = False
    replays = (graphs.replays if graphs is not None else 0) - replays_before
    steps, gaps = timeline.steps_and_gaps()
    while engine.has_unfinished():
        engine.step()
    step_ms, gap_ms = statistics.median(steps), statistics.median(gaps)
    return {
        "mode": "async" if async_output else "sync",
        "batch": batch,
        "step_ms_median": round(step_ms, 4),
        "step_ms_p90": round(percentile(steps, 90), 4),
        "gap_ms_median": round(gap_ms, 4),
        "gap_ms_p90": round(percentile(gaps, 90), 4),
        "gap_over_step": round(gap_ms / step_ms, 4) if step_ms else None,
        "wall_ms_per_step": round(wall * 1e3 / args.steps, 4),
        "decode_tok_s": round(batch * args.steps / wall, 1),
        "cuda_graphs": bool(engine.cuda_graph_batch_sizes),
        "captured_batch_sizes": list(engine.cuda_graph_batch_sizes),
        "graph_replays": replays,
    }


def title(shape: str, device: str, clocks: str) -> str:
    return f"step gap, {shape}, {device} ({clocks})"


def plot(rows: list[dict], stamp: str, name: str, title: str) -> None:
    fig, (ax_gap, ax_ratio) = common.new_figure(2)
    labels = [f"{r['mode']} b{r['batch']}" for r in rows]
    common.bar_panel(ax_gap, labels, [r["gap_ms_median"] for r in rows], "ms", "idle gap (median)")
    ratios = [100 * (r["gap_over_step"] or 0.0) for r in rows]
    common.bar_panel(ax_ratio, labels, ratios, "% of step", "gap / step (goal < 10% at b64)")
    common.save_figure(fig, name, stamp, title)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("step_gap: no CUDA device here (use --device cpu for a dry run)")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for mode in args.modes.split(","):
            row = run(args, batch, async_output=mode == "async")
            print(row, flush=True)
            rows.append(row)
    device = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0).replace(" ", "_")
    stamp = common.timestamp()
    name = f"{args.name}-{'cpu' if args.device == 'cpu' else 'gpu'}"
    clocks = "host clocks" if args.device == "cpu" else "CUDA events"
    payload = {"device": device, "clocks": clocks, "rows": rows}
    path = common.write_result(name, payload, stamp, settings=vars(args))
    if not args.no_png:
        plot(rows, stamp, name, title(args.shape, device, clocks))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
