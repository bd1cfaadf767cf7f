"""Speculative decoding (n-gram drafts): decode speed with and without it, one engine each.

Workloads, all greedy on the embedded model: (a) "copy": single stream, prompts whose
answers copy or lightly edit a given paragraph or code snippet; (b) "free": single stream,
free-form prompts; (c) "mixed48": 48 concurrent requests, half of each kind. Single-stream
decode tok/s = (tokens - 1) / (last token time - first token time) per request, the median
over requests and repetitions; mixed48 = generated tokens / wall time of the whole batch.
Every configuration (none, then ngram with each K) runs each workload in turn, in rotating
order, repetition after repetition (A/B interleaved: the machine is shared, its load moves
and hits all alike). Greedy tokens are compared with speculation off, and the acceptance
rate (accepted / drafted tokens) is recorded per workload. Writes
``bench/results/speculative-<stamp>.json`` and a PNG. Run: ``make bench-speculative``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench import common

PARAGRAPH = (
    "The old mill stood by the river for two hundred years. Every spring the water rose, "
    "turned the great wheel faster, and the miller ground more flour than the village "
    "could eat; the rest went by cart to the market town, two days away. When the railway "
    "came, the carts stopped, and the mill fell silent one autumn."
)
CODE = (
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i : i + window]\n"
    "        result.append(sum(chunk) / window)\n"
    "    return result\n"
)
COPY_ASKS = [
    f"Repeat this paragraph exactly:\n{PARAGRAPH}",
    f"Rewrite this paragraph, replacing 'mill' with 'bakery':\n{PARAGRAPH}",
    f"Rename the variable 'chunk' to 'part' in this code and return all of it:\n{CODE}",
    f"Add a docstring to this function and return the whole function:\n{CODE}",
]
FREE_ASKS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle gear system works, step by step, for a curious child.",
    "Why do leaves change colour in autumn? Answer in a friendly paragraph.",
    "What should a beginner know before planting a vegetable garden?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--ks", default="2,4,6", help="comma list of draft lengths K to measure")
    from compute.core.config import SpeculativeConfig

    engine = SpeculativeConfig()  # the serve defaults
    p.add_argument(
        "--ngram-min", type=int, default=engine.ngram_min, help="--speculative-ngram-min"
    )
    p.add_argument(
        "--ngram-max", type=int, default=engine.ngram_max, help="--speculative-ngram-max"
    )
    p.add_argument("--max-batch", type=int, default=8, help="--speculative-max-batch")
    p.add_argument("--new-tokens", type=int, default=96, help="max tokens per request")
    p.add_argument("--concurrent", type=int, default=48, help="requests of the mixed workload")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every workload")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: engine's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--workloads", default="copy,free,mixed48", help="comma list: copy, free, mixed48"
    )
    p.add_argument("--name", default="speculative", help="result file prefix in bench/results/")
    return p.parse_args(argv)


def make_engine(args: argparse.Namespace, k: int | None, loaded):
    from compute.core.config import DeviceConfig, EngineConfig, SpeculativeConfig
    from compute.engine import Engine

    spec = SpeculativeConfig()
    if k is not None:
        spec = SpeculativeConfig(
            method="ngram",
            num_tokens=k,
            ngram_min=args.ngram_min,
            ngram_max=args.ngram_max,
            max_batch=args.max_batch,
        )
    device = DeviceConfig(device=args.device, num_threads=args.threads)
    return Engine(EngineConfig(device=device, speculative=spec), loaded=loaded)


def run_batch(engine, prompts: list[list[int]], params) -> dict[str, Any]:
    """Run ``prompts`` together; per-request token times, ids, and the wall time."""
    counter = engine.scheduler.drafts
    before = (counter.num_draft_tokens, counter.num_accepted_tokens)
    times: dict[str, list[float]] = {}
    ids: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
        times[f"b{i}"], ids[f"b{i}"] = [], []
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request_id] += [now] * len(out.new_token_ids)
            ids[out.request_id] += list(out.new_token_ids)
    wall = time.perf_counter() - start
    order = [f"b{i}" for i in range(len(prompts))]
    return {
        "wall_s": wall,
        "times": [times[r] for r in order],
        "ids": [ids[r] for r in order],
        "drafted": counter.num_draft_tokens - before[0],
        "accepted": counter.num_accepted_tokens - before[1],
    }


def decode_rate(times: list[float]) -> float | None:
    """Tokens per second after the first token (None with fewer than two)."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from compute.core.sampling_params import SamplingParams
    from compute.loaders import LoadedModel, load_model

    loaded = load_model("default", quantized=args.device == "cpu", progress=False)
    tokenizer = loaded.tokenizer

    def fresh() -> LoadedModel:
        return LoadedModel(loaded.config, dict(loaded.weights), tokenizer, loaded.source)

    def chat(text: str) -> list[int]:
        return tokenizer.encode_chat([{"role": "user", "content": text}])

    copy, free = [chat(a) for a in COPY_ASKS], [chat(a) for a in FREE_ASKS]
    mixed = [(copy if i % 2 else free)[(i // 2) % 4] for i in range(args.concurrent)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    configs: list[int | None] = [None, *ks]
    names = {k: "none" if k is None else f"ngram-k{k}" for k in configs}
    engines = {k: make_engine(args, k, fresh()) for k in configs}
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    raw: dict[str, dict[str, list]] = {names[k]: {w: [] for w in workloads} for k in configs}

    for rep in range(args.reps):
        for shift in range(len(configs)):
            k = configs[(rep + shift) % len(configs)]
            engine = engines[k]
            for workload in workloads:
                if workload == "mixed48":
                    raw[names[k]][workload].append(run_batch(engine, mixed, params))
                else:
                    for prompt in copy if workload == "copy" else free:
                        raw[names[k]][workload].append(run_batch(engine, [prompt], params))
            print(f"rep {rep} {names[k]} done, load {common.load_average()}", flush=True)

    summary = summarise(raw, names, configs, workloads)
    settings = vars(args) | {"configs": [names[k] for k in configs]}
    stamp = common.timestamp()
    path = common.write_result(args.name, {"summary": summary}, stamp, settings)
    plot(summary, workloads, stamp, args)
    print(path)
    for name, per in summary.items():
        print(name, {w: {k: v for k, v in s.items() if k != "identical"} for w, s in per.items()})


def summarise(raw, names, configs, workloads) -> dict[str, dict[str, dict[str, Any]]]:
    base = raw[names[None]]
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for k in configs:
        runs = raw[names[k]]
        per: dict[str, dict[str, Any]] = {}
        for w in workloads:
            if w == "mixed48":
                rates = [sum(len(t) for t in r["ids"]) / r["wall_s"] for r in runs[w]]
            else:
                rates = [x for r in runs[w] if (x := decode_rate(r["times"][0])) is not None]
            drafted = sum(r["drafted"] for r in runs[w])
            accepted = sum(r["accepted"] for r in runs[w])
            same = all(r["ids"] == b["ids"] for r, b in zip(runs[w], base[w], strict=True))
            per[w] = {
                "tok_s_median": statistics.median(rates) if rates else None,
                "tok_s_all": [round(x, 2) for x in rates],
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "identical_greedy_tokens": same,
            }
        summary[names[k]] = per
    for per in summary.values():
        for w, s in per.items():
            ref = summary[names[None]][w]["tok_s_median"]
            s["speedup"] = s["tok_s_median"] / ref if ref and s["tok_s_median"] else None
    return summary


def plot(summary, workloads: list[str], stamp: str, args) -> None:
    fig, axes = common.new_figure(len(workloads))
    for ax, w in zip(axes, workloads, strict=True):
        labels = list(summary)
        values = [summary[n][w]["tok_s_median"] or 0.0 for n in labels]
        unit = "tok/s (batch)" if w == "mixed48" else "decode tok/s (median)"
        common.bar_panel(ax, labels, values, unit, w)
    title = f"speculative decoding, {args.device}, n-gram {args.ngram_min}-{args.ngram_max}"
    common.save_figure(fig, args.name, stamp, title)


if __name__ == "__main__":
    main()
