"""n > 1 and logit_bias on the CPU, in process: what sharing the prompt saves, what a bias costs.

1. One request with n samples vs n identical requests sent at once, through the Pipeline
   over the real engine (the default model), with prefix caching on and off: prompt
   tokens the engine computed, the samples' ``cached_prompt_tokens`` (not computed: the
   forked samples' prompt length - 1, or prefix-cache hits), samples forked and not,
   client-side time to the first event and to the end. The n requests at once are
   admitted in one step, so none reuses another's blocks.
2. The sampler alone on [batch, vocab] logits (batch 1 and 32, temperature 0.7, top-p
   0.9): median time of ``sample_on_device`` with no logit_bias/min_tokens, with one row
   asking (300 biased ids and min_tokens), and with every row asking; on random logits
   (flat: every row's nucleus is most of the vocabulary, the top-p cut's worst case) and
   on the default model's own logits over a text (transformers reading the same file).

One run each after a warm-up; on a shared machine the figures carry the neighbours' load
(the JSON records the load average). Run by hand:

    .venv/bin/python bench/samples.py [--n 4] [--prompt-tokens 600] [--threads 2] [--skip-sampler]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/samples.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import load_average, publish  # noqa: E402
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig  # noqa: E402
from compute.core.sampling_params import SamplingParams  # noqa: E402
from compute.core.sequence import Sequence  # noqa: E402
from compute.engine import Engine  # noqa: E402
from compute.sampling.sampler import Sampler  # noqa: E402
from services.domain import Complete, GenerateInput  # noqa: E402
from services.pipeline.pipeline import Pipeline, PipelineConfig  # noqa: E402

TEXT = "The lighthouse keeper climbed the spiral stairs each evening and watched the boats. "


async def _timed(pipeline: Pipeline, inputs: list[GenerateInput]) -> dict[str, float]:
    start = time.perf_counter()
    first: list[float] = []
    completes: list[Complete] = []

    async def one(inp: GenerateInput) -> None:
        async for event in pipeline.generate(inp):
            if not first:
                first.append(time.perf_counter() - start)
            if isinstance(event, Complete):
                completes.append(event)

    await asyncio.gather(*(one(inp) for inp in inputs))
    return {
        "first_event_s": round(first[0], 4),
        "total_s": round(time.perf_counter() - start, 4),
        "samples": len(completes),
        "cached_prompt_tokens": sum(c.usage.cached_prompt_tokens for c in completes),
    }


def samples_vs_requests(engine: Engine, n: int, prompt: str, max_tokens: int) -> dict:
    pipeline = Pipeline(engine, PipelineConfig(max_n=max(n, 16)))
    pipeline.start()
    try:
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True)
        results = {}
        for i, label in enumerate(("warm-up", f"n={n}", f"{n} requests")):
            # Each run its own prompt (a distinct first word), so no run reuses another's.
            text = f"{i} {prompt}"
            if label.endswith("requests"):
                inputs = [GenerateInput(f"r{k}", prompt=text, params=params) for k in range(n)]
            else:
                inputs = [GenerateInput("r", prompt=text, params=params, n=n)]
            before = pipeline.engine_stats()
            run = asyncio.run(_timed(pipeline, inputs))
            time.sleep(0.2)  # the step loop publishes its stats after the step
            after = pipeline.engine_stats()
            run["prompt_tokens_computed"] = after.prompt_tokens - before.prompt_tokens
            run["samples_forked"] = after.samples_forked - before.samples_forked
            run["samples_not_forked"] = after.samples_not_forked - before.samples_not_forked
            run["prompt_tokens"] = len(engine.tokenizer.encode(text))
            results[label] = run
            print(label, run)
        del results["warm-up"]
        return results
    finally:
        pipeline.stop()


def model_logits(rows: int) -> torch.Tensor:
    """The default model's logits at ``rows`` positions 16 apart over a text (this
    benchmark's sentence and the README), as transformers computes them from the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compute.loaders.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    ids = tokenizer(TEXT + readme, return_tensors="pt").input_ids[:, : 16 * rows]
    with torch.inference_mode():
        return model(ids).logits[0, ::16][:rows].clone()


def sampler_cost(logits: torch.Tensor, batch: int, repeats: int) -> dict[str, float]:
    logits = logits[:batch].contiguous()
    vocab = logits.shape[1]
    plain = SamplingParams(temperature=0.7, top_p=0.9)
    asking = SamplingParams(
        temperature=0.7, top_p=0.9, min_tokens=8, logit_bias=tuple((i, 1.0) for i in range(300))
    )
    cases = {"none": [plain] * batch, "one row": [asking] + [plain] * (batch - 1)}
    cases["every row"] = [asking] * batch
    result = {}
    for name, params in cases.items():
        seqs = [Sequence(f"s{i}", [1, 2, 3], p, 0.0) for i, p in enumerate(params)]
        sampler = Sampler(vocab, eos_token_ids=(2,))
        times = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            sampler.sample_on_device(logits, seqs)
            times.append(time.perf_counter() - start)
        result[name] = round(statistics.median(times[3:]) * 1e3, 3)
        print(f"sampler batch {batch} {name}: {result[name]} ms")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--skip-sampler", action="store_true", help="part 1 only")
    args = parser.parse_args()
    runs, vocab = {}, None
    for prefix in (True, False):
        cache = CacheConfig(num_blocks=1024, enable_prefix_caching=prefix)
        engine = Engine(
            EngineConfig(cache=cache, device=DeviceConfig("cpu", num_threads=args.threads))
        )
        sentence_tokens = len(engine.tokenizer.encode(TEXT))
        prompt = TEXT * max(1, args.prompt_tokens // sentence_tokens)
        vocab = engine.model_config.vocab_size
        print("prefix caching", "on" if prefix else "off")
        label = f"prefix_caching_{'on' if prefix else 'off'}"
        runs[label] = samples_vs_requests(engine, args.n, prompt, args.max_tokens)
    payload = {"samples_vs_requests": runs}
    if not args.skip_sampler:
        flat = torch.randn((32, vocab), generator=torch.Generator().manual_seed(0))
        real = model_logits(32)
        payload["sampler_ms"] = {
            f"batch {b}": sampler_cost(flat, b, args.repeats) for b in (1, 32)
        }  # random logits
        payload["sampler_ms_model_logits"] = {
            f"batch {b}": sampler_cost(real, b, args.repeats) for b in (1, 32)
        }
    payload["load_average_after"] = load_average()
    publish("samples", payload, settings=vars(args))


if __name__ == "__main__":
    main()
