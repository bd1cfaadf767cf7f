"""The cost of grammar constraints (``python -m bench.constrained``).

On the embedded model (quantized CPU kernels unless ``--device cuda``), greedy:

- decode: the same JSON-asking chat prompts at 1 and at ``--streams`` (32) concurrent
  streams, constrained (the test schemas of tests/support/schemas.py, in turn) and
  unconstrained. The unconstrained run of a prompt generates exactly as many tokens as its
  constrained run did (``max_tokens`` = that count, EOS ignored), so both runs have the
  same batch over time. Reported per mode: generated tokens / wall time of the whole batch
  and the median per-request decode rate ((tokens - 1) / (last - first token time)); the
  ratio constrained / unconstrained is the headline (goal: >= 0.9 at 32 streams). Runs
  alternate the two modes, ``--reps`` times. Each run also says where its steps' time went
  (``per_step_ms``, the engine's StepTiming averaged over its steps: schedule, forward,
  sample (logits, grammar masks, sampling, resolve) and, within it, the masks' fill).
- compile: each schema's compile through stage 1's compile stage, cold (a new stage,
  an empty cache) and cached (the same text again).
- first token: one request through the whole pipeline (stages 1-3), unconstrained and with
  a cached schema, alternated; the time from ``generate()`` to its first chunk (goal:
  cached <= unconstrained + 5 ms).

Writes ``bench/results/constrained-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace
from typing import Any

from bench import common
from tests.support.schemas import SCHEMAS

ASKS = [
    "Give me a JSON record of a person with name, age and role.",
    "Write a JSON order for two keyboards, shipped to Berlin.",
    "What's the weather like in Oslo for the next three days? Answer in JSON.",
    "Describe a product as a JSON object with many typed fields.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the batch run")
    p.add_argument("--max-tokens", type=int, default=160, help="max tokens per request")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every measurement")
    p.add_argument("--ttft-reps", type=int, default=10, help="first-token samples per mode")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: engine's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--name", default="constrained", help="result file prefix in bench/results/")
    return p.parse_args(argv)


def run_batch(engine, prompts: list[list[int]], params: list) -> dict[str, Any]:
    times: dict[str, list[float]] = {}
    ids: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"b{i}", prompt, p)
        times[f"b{i}"], ids[f"b{i}"] = [], []
    spent = dict.fromkeys(("schedule_s", "forward_s", "sample_s", "mask_s"), 0.0)
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for key in spent:
            spent[key] += getattr(engine.last_step_timing, key)
        for out in outputs:
            times[out.request_id] += [now] * len(out.new_token_ids)
            ids[out.request_id] += list(out.new_token_ids)
    wall = time.perf_counter() - start
    order = [f"b{i}" for i in range(len(prompts))]
    rates = [_decode_rate(times[r]) for r in order]
    return {
        "wall_s": wall,
        "tokens": [len(ids[r]) for r in order],
        "tok_s": sum(len(ids[r]) for r in order) / wall,
        "median_decode_tok_s": statistics.median(r for r in rates if r is not None),
        "steps": steps,
        "per_step_ms": {key[:-2]: 1e3 * value / steps for key, value in spent.items()},
    }


def _decode_rate(times: list[float]) -> float | None:
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def decode(engine, compiled: list, prompts: list[list[int]], args) -> dict[str, Any]:
    from compute.core.sampling_params import SamplingParams

    result: dict[str, Any] = {}
    for streams in (1, args.streams):
        batch = [prompts[i % len(prompts)] for i in range(streams)]
        constrained = [
            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, grammar=compiled[i % 4])
            for i in range(streams)
        ]
        runs: dict[str, list] = {"constrained": [], "unconstrained": []}
        for rep in range(args.reps):
            c = run_batch(engine, batch, constrained)
            plain = [
                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in c["tokens"]
            ]
            u = run_batch(engine, batch, plain)
            runs["constrained"].append(c)
            runs["unconstrained"].append(u)
            print(
                f"streams {streams} rep {rep}: {c['tok_s']:.1f} vs {u['tok_s']:.1f} tok/s; "
                f"per step {c['per_step_ms']} vs {u['per_step_ms']} ms"
            )
        med = {m: statistics.median(r["tok_s"] for r in rs) for m, rs in runs.items()}
        result[f"streams_{streams}"] = {
            "tok_s_constrained": med["constrained"],
            "tok_s_unconstrained": med["unconstrained"],
            "ratio": med["constrained"] / med["unconstrained"],
            "median_decode_tok_s_constrained": statistics.median(
                r["median_decode_tok_s"] for r in runs["constrained"]
            ),
            "median_decode_tok_s_unconstrained": statistics.median(
                r["median_decode_tok_s"] for r in runs["unconstrained"]
            ),
            "runs": runs,
        }
    return result


def compile_times(engine, reps: int) -> dict[str, Any]:
    from compute.core.grammar import Constraint
    from services.pipeline.grammar_compile import GrammarStage
    from services.pipeline.pipeline import _grammar_compiler

    compiler = _grammar_compiler(engine)
    compiler.warm_up()  # the tokenizer's one-off preparation is not a schema's cost
    out: dict[str, Any] = {}

    async def measure(stage, constraint) -> float:
        start = time.perf_counter()
        await stage.compile(constraint)
        return time.perf_counter() - start

    for name, schema in SCHEMAS.items():
        constraint = Constraint("json_schema", json.dumps(schema))
        cold, cached = [], []
        for _ in range(reps):
            stage = GrammarStage(compiler)
            cold.append(asyncio.run(measure(stage, constraint)))
            cached.append(asyncio.run(measure(stage, constraint)))
            stage.shutdown()
        out[name] = {"cold_s": statistics.median(cold), "cached_s": statistics.median(cached)}
    return out


def first_token(engine, prompt: list[int], reps: int) -> dict[str, Any]:
    from compute.core.grammar import Constraint
    from compute.core.sampling_params import SamplingParams
    from services.domain import GenerateInput
    from services.pipeline.pipeline import Pipeline

    pipeline = Pipeline(engine)
    pipeline.start()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    constraint = Constraint("json_schema", json.dumps(SCHEMAS["person"]))
    base = GenerateInput(request_id="ttft", token_ids=tuple(prompt), params=params)

    async def ttft(inp: GenerateInput) -> float:
        start = time.perf_counter()
        async for _ in pipeline.generate(inp):
            return time.perf_counter() - start
        raise RuntimeError("no chunk")

    async def run() -> dict[str, list[float]]:
        await ttft(replace(base, constraint=constraint))  # compiles: the cache is warm after
        await ttft(base)
        samples: dict[str, list[float]] = {"unconstrained": [], "cached_schema": []}
        for _ in range(reps):
            samples["unconstrained"].append(await ttft(base))
            samples["cached_schema"].append(await ttft(replace(base, constraint=constraint)))
        return samples

    try:
        samples = asyncio.run(run())
    finally:
        pipeline.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "median_ttft_s": med,
        "cached_minus_unconstrained_ms": (med["cached_schema"] - med["unconstrained"]) * 1e3,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from compute.core.config import DeviceConfig, EngineConfig
    from compute.core.grammar import Constraint
    from compute.engine import Engine
    from compute.loaders import load_model
    from services.pipeline.pipeline import _grammar_compiler

    loaded = load_model("default", quantized=args.device == "cpu", progress=False)
    device = DeviceConfig(device=args.device, num_threads=args.threads)
    engine = Engine(EngineConfig(device=device), loaded=loaded)
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": a}]) for a in ASKS]
    compiler = _grammar_compiler(engine)
    compiled = [
        compiler.compile(Constraint("json_schema", json.dumps(s))) for s in SCHEMAS.values()
    ]
    load_start = common.load_average()
    payload = {
        "compile": compile_times(engine, args.reps),
        "decode": decode(engine, compiled, prompts, args),
        "first_token": first_token(engine, prompts[0], args.ttft_reps),
        "load_average_start": load_start,
        "load_average_end": common.load_average(),
    }
    for streams, d in payload["decode"].items():
        print(streams, {k: round(v, 3) for k, v in d.items() if k != "runs"})
    print("compile", payload["compile"])
    print("first token", payload["first_token"]["median_ttft_s"])
    common.publish(args.name, payload, settings=vars(args))


if __name__ == "__main__":
    main()
