"""Engine throughput on a GPU: headrace continuous batching vs HF transformers static batching.

The workload: --num-requests (256) requests submitted at once, random prompts of
--prompt-len (512) tokens, output lengths spread as real traffic is: drawn (seeded) from an
exponential distribution of mean --output-len (128), capped at --output-cap (512), at least
1 (EOS ignored, so each request makes exactly its length), for every model shape in
--shapes, on dummy weights: the same seeded tensors in both systems (made once on the host
in fp32, cast to --dtype on the device). --output-cap 0 gives every request exactly
--output-len tokens.

- headrace: an Engine stepped until every request is done (asynchronous output as its
  default on CUDA; --no-async-output for the synchronous figure);
- hf-static: LlamaForCausalLM built from the same config and tensors, ``generate`` over
  batches of the requests in submission order (all prompts have one length, so no
  padding); a static batch runs until its longest request is done, so each batch makes
  its longest length for every row and only the requested tokens count; each batch size
  in --hf-batch-sizes is probed on the first batch of it, and the best runs the workload.

Output tok/s = the requested tokens (sum of the lengths) / wall time (prefill included,
both systems), after
an untimed warm-up of each (CuPy compiles its kernels at their first launch). Writes
``bench/results/engine-gpu-<gpu>-<stamp>.json`` with top-level ``gpu``,
``headrace_tok_s``, ``hf_static_tok_s`` and ``ratio`` (the first shape), the settings and
one row per shape, and a PNG, both rewritten after every shape (``complete`` says whether
every shape is in). Run: ``python bench/engine_gpu.py`` on a GPU machine
(``--device cpu --shapes tiny`` and small numbers for a dry run of the plumbing).
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import replace
from typing import Any

import torch

from bench import common
from compute.core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders.base import LoadedModel
from compute.loaders.dummy import load_dummy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b", help="dummy shapes (llama)")
    p.add_argument("--num-requests", type=int, default=256, help="requests, all at once")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="mean new tokens per request")
    p.add_argument(
        "--output-cap", type=int, default=512,
        help="cap of the exponential output lengths (0: every request makes --output-len)",
    )  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=256, help="headrace max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="headrace budget")
    p.add_argument("--kv-cache-memory-gib", type=float, default=16.0, help="headrace KV memory")
    p.add_argument(
        "--async-output", action=argparse.BooleanOptionalAction, default=None,
        help="headrace asynchronous output (default: the engine's, on for CUDA)",
    )  # fmt: skip
    p.add_argument("--hf-batch-sizes", default="16,32,64,128,256", help="probed HF batch sizes")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and prompts")
    p.add_argument("--name", default="engine-gpu", help="result file prefix in bench/results/")
    p.add_argument("--no-png", action="store_true", help="write the JSON only (replot later)")
    return p.parse_args(argv)


def prompts(args: argparse.Namespace, vocab_size: int, count: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(4, vocab_size) for _ in range(args.prompt_len)] for _ in range(count)]


def output_lens(args: argparse.Namespace, count: int) -> list[int]:
    """Seeded output lengths: capped exponential of mean --output-len, or all --output-len."""
    if args.output_cap <= 0:
        return [args.output_len] * count
    rng = random.Random(args.seed + 1)
    draw = (round(rng.expovariate(1.0 / args.output_len)) for _ in range(count))
    return [min(args.output_cap, max(1, n)) for n in draw]


def on_device(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    return {k: v.to(device=args.device, dtype=dtype) for k, v in loaded.weights.items()}


def run_headrace(args: argparse.Namespace, shape: str, loaded: LoadedModel) -> dict[str, Any]:
    config = EngineConfig(
        model=f"dummy:{shape}",
        cache=CacheConfig(block_size=16, memory_gib=args.kv_cache_memory_gib),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        device=DeviceConfig(device=args.device, dtype=args.dtype, async_output=args.async_output),
    )
    engine = Engine(config, loaded=replace(loaded, weights=on_device(loaded, args)))
    lens = output_lens(args, args.num_requests)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.generate(prompts(args, loaded.config.vocab_size, 2), warm)  # kernels compile here
    batch = prompts(args, loaded.config.vocab_size, args.num_requests)
    common.sync(args.device)
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    common.sync(args.device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    if tokens != sum(lens):
        raise RuntimeError(f"headrace produced {tokens} tokens")
    result = {
        "output_tok_s": round(tokens / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        "async_output": engine.async_output,
        "num_blocks": engine.num_blocks,
        "preemptions": engine.stats().num_preemptions,
    }
    del engine
    _free(args.device)
    return result


def hf_model(config: ModelConfig, loaded: LoadedModel, args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    if config.architecture != "llama":
        raise SystemExit(f"engine_gpu: {config.architecture} shapes are not supported (llama)")
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    with torch.device(args.device):
        model = LlamaForCausalLM(hf_config).to(getattr(torch, args.dtype))
    missing, unexpected = model.load_state_dict(on_device(loaded, args), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF weights: missing {missing}, unexpected {unexpected}")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_batch_tok_s(model, batch: list[list[int]], lens: list[int], args) -> float:
    """One static batch: generates its longest length for every row; the requested tokens
    (sum of ``lens``) per second."""
    ids = torch.tensor(batch, device=args.device)
    longest = max(lens)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **common.hf_generate_kwargs(longest)
        )
    common.sync(args.device)
    if out.shape[1] != ids.shape[1] + longest:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens")
    return sum(lens) / (time.perf_counter() - start)


def run_hf_static(args: argparse.Namespace, config: ModelConfig, loaded: LoadedModel) -> dict:
    model = hf_model(config, loaded, args)
    work = prompts(args, config.vocab_size, args.num_requests)
    lens = output_lens(args, args.num_requests)
    hf_batch_tok_s(model, work[:2], [8, 8], args)  # warm-up
    probes: dict[int, float | str] = {}
    for size in (int(s) for s in args.hf_batch_sizes.split(",")):
        if size > args.num_requests:
            continue
        try:
            probes[size] = round(hf_batch_tok_s(model, work[:size], lens[:size], args), 1)
        except torch.cuda.OutOfMemoryError:
            probes[size] = "out of memory"
            _free(args.device)
    fits = {s: v for s, v in probes.items() if isinstance(v, float)}
    if not fits:
        raise RuntimeError(f"HF: no batch size fits: {probes}")
    best = max(fits, key=fits.__getitem__)
    start = time.perf_counter()
    for first in range(0, len(work), best):
        hf_batch_tok_s(model, work[first : first + best], lens[first : first + best], args)
    elapsed = time.perf_counter() - start
    del model
    _free(args.device)
    tokens = sum(lens)
    return {
        "output_tok_s": round(tokens / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        "batch_size": best,
        "probes_tok_s": probes,
    }


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def plot_title(settings: dict[str, Any]) -> str:
    cap = settings["output_cap"]
    capped = f" (exp., cap {cap})" if cap > 0 else ""
    return (
        f"{settings['num_requests']} requests, {settings['prompt_len']}/"
        f"{settings['output_len']}{capped}"
    )


def plot(rows: list[dict], stamp: str, name: str, title: str) -> None:
    fig, axes = common.new_figure(len(rows))
    for ax, row in zip(axes, rows, strict=True):
        values = [row["headrace"]["output_tok_s"], row["hf_static"]["output_tok_s"]]
        hf_label = f"HF static (b{row['hf_static']['batch_size']})"
        common.bar_panel(ax, ["headrace", hf_label], values, "output tok/s", row["shape"])
    common.save_figure(fig, name, stamp, title)


def payload(rows: list[dict], args: argparse.Namespace, gpu: str) -> dict[str, Any]:
    """The JSON's payload; the top-level figures are the first shape's, once it is done."""
    first = rows[0] if rows else None
    return {
        "gpu": gpu,
        "headrace_tok_s": first["headrace"]["output_tok_s"] if first else None,
        "hf_static_tok_s": first["hf_static"]["output_tok_s"] if first else None,
        "ratio": first["ratio"] if first else None,
        "shapes_done": [r["shape"] for r in rows],
        "complete": len(rows) == len(args.shapes.split(",")),
        "rows": rows,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("engine_gpu: no CUDA device here (use --device cpu for a dry run)")
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    stamp = common.timestamp()
    name = f"{args.name}-{gpu.replace(' ', '_')}"
    title = plot_title(vars(args))
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        loaded = load_dummy(shape, torch.float32, "cpu", seed=args.seed)
        row = {"shape": shape}
        row["headrace"] = run_headrace(args, shape, loaded)
        print(shape, "headrace", row["headrace"], flush=True)
        row["hf_static"] = run_hf_static(args, loaded.config, loaded)
        print(shape, "hf-static", row["hf_static"], flush=True)
        row["ratio"] = round(row["headrace"]["output_tok_s"] / row["hf_static"]["output_tok_s"], 2)
        rows.append(row)
        # After every shape (same file, rewritten): a run killed at its time limit keeps
        # the shapes it finished.
        path = common.write_result(name, payload(rows, args, gpu), stamp, settings=vars(args))
        if not args.no_png:
            plot(rows, stamp, name, title)
        print(f"wrote {path}; {shape}: ratio {row['ratio']}", flush=True)


if __name__ == "__main__":
    main()
