"""One long-context stream per KV cache dtype (--kv-cache-dtype) on the CPU, and llama.cpp's
server on the same GGUF file in the same run.

For each (--weights, --kv-cache-dtype) of --configs and each prompt length of --contexts:
time to first token (the whole prompt prefilled in chunks of --max-num-batched-tokens) and
decode tok/s over the next --new-tokens greedy tokens (EOS ignored), plus the KV bytes per
token; headrace runs in process (an Engine stepped by hand, no server around it). Then
llama-server (when one is found: --llama-server, PATH, or `make llama-server`) on the same
file with its default f16 KV cache, one slot, the same token ids over /completion, streamed:
time to first token and decode tok/s from the arrival of each token, and the server's own
timings beside them. Every configuration warms up on a short prompt first; one run each
(the JSON records the load average with every row), the JSON and PNG rewritten after every
configuration. Run: ``python -m bench.kv_dtype [--contexts 512,2048,4096,8128]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench import common
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.runner.model_runner import kv_bytes_per_block

CONFIGS = (  # --weights/--kv-cache-dtype
    "quantized/float32,quantized/float16,quantized/int8,"
    "quantized-int8/float32,quantized-int8/auto,quantized-int8/int8"
)
TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, counting the "
    "steps as his father had before him, and from the gallery watched the boats return. "
)
LLAMA = "llama.cpp (f16 KV)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--contexts", default="512,2048,4096,8128", help="prompt lengths (tokens)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens decoded per run")
    p.add_argument("--configs", default=CONFIGS, help="comma list of WEIGHTS/KV_DTYPE")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: embedded model)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of both systems")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill chunk")
    p.add_argument(
        "--llama-server", default=None,
        help="llama-server binary ('none': headrace only; default: PATH or make llama-server)",
    )  # fmt: skip
    p.add_argument("--name", default="kv-dtype", help="result file prefix in bench/results/")
    return p.parse_args(argv)


def prompt_ids(engine: Engine, length: int) -> list[int]:
    ids = engine.tokenizer.encode(TEXT * (length // 30 + 2))
    if len(ids) < length:
        raise SystemExit(f"kv_dtype: the text gives {len(ids)} tokens, not {length}")
    return ids[:length]


def timings(stamps: list[float], start: float) -> dict[str, float]:
    """Time to first token and decode tok/s over the tokens after the first."""
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"ttft_s": stamps[0] - start, "decode_tok_s": decode, "tokens": len(stamps)}


def run_headrace(engine: Engine, prompt: list[int], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    start = time.perf_counter()
    stamps: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            stamps.extend([time.perf_counter()] * len(out.new_token_ids))
    return timings(stamps, start)


def headrace_rows(
    args: argparse.Namespace, weights: str, kv: str, prompts: dict[int, list[int]]
) -> list[dict[str, Any]]:
    """One engine; fills ``prompts`` (context -> token ids) when empty."""
    contexts = [int(c) for c in args.contexts.split(",")]
    config = EngineConfig(
        model=str(args.gguf) if args.gguf else "default",
        cache=CacheConfig(num_blocks=-(-(max(contexts) + args.new_tokens + 16) // 16),
                          enable_prefix_caching=False, kv_cache_dtype=kv),
        scheduler=SchedulerConfig(max_num_seqs=1,
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        device=DeviceConfig(device="cpu", weights=weights, num_threads=args.threads),
    )  # fmt: skip
    engine = Engine(config)
    per_token = kv_bytes_per_block(engine.model_config, 16, engine.kv_dtype) // 16
    prompts |= {ctx: prompts.get(ctx) or prompt_ids(engine, ctx) for ctx in contexts}
    run_headrace(engine, prompts[min(contexts)][:64], 4)  # warm-up
    rows = []
    kv_name = str(engine.kv_dtype).removeprefix("torch.")
    for ctx in contexts:
        result = run_headrace(engine, prompts[ctx], args.new_tokens)
        row = {"system": "headrace", "weights": weights, "kv_cache_dtype": kv_name}
        row |= {"context": ctx, "kv_bytes_per_token": per_token, **result}
        rows.append(row | {"load_average": common.load_average()})
        print(rows[-1], flush=True)
    return rows


def llama_rows(args: argparse.Namespace, binary: str, prompts: dict[int, list[int]]):
    """llama-server, one slot of the longest prompt + new tokens, f16 KV (its default)."""
    from bench.cpu_compare.llama import LlamaSystem

    gguf = args.gguf or common.default_gguf_path()
    slot_ctx = max(prompts) + args.new_tokens + 16
    system = LlamaSystem(binary, gguf, args.threads, 1, slot_ctx)
    rows = []
    try:
        system.start(timeout=600, idle_wait=1)
        system.run(prompts[min(prompts)][:64], 4)  # warm-up
        for ctx, prompt in prompts.items():
            stamps, ids, start = system.run(prompt, args.new_tokens)
            row = {"system": "llama.cpp", "weights": "llama.cpp", "kv_cache_dtype": "f16"}
            row |= {"context": ctx, **timings(stamps, start), **system.last_server}
            row |= {"tokens_emitted": len(ids), "load_average": common.load_average()}
            rows.append(row)
            print(rows[-1], flush=True)
    finally:
        info = system.info()
        system.close()
    return rows, info


def label(row: dict[str, Any]) -> str:
    if row["system"] == "llama.cpp":
        return LLAMA
    return f"{row['weights']} / kv {row['kv_cache_dtype']}"


def plot(rows: list[dict[str, Any]], stamp: str, name: str, title: str) -> None:
    fig, axes = common.new_figure(2)
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(label(r), []).append(r)
    for text, mine in series.items():
        style = "k--" if text == LLAMA else "o-"
        x = [r["context"] for r in mine]
        axes[0].plot(x, [r["decode_tok_s"] for r in mine], style, label=text)
        axes[1].plot(x, [r["ttft_s"] for r in mine], style, label=text)
    axes[0].set(xlabel="context (tokens)", ylabel="decode tok/s, one stream", xscale="log")
    axes[1].set(xlabel="prompt (tokens)", ylabel="time to first token (s)", xscale="log")
    axes[0].legend(fontsize=7)
    common.save_figure(fig, name, stamp, title=title)


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per headrace configuration and context: decode tok/s over llama.cpp's, and how many
    times sooner its first token came."""
    llama = {r["context"]: r for r in rows if r["system"] == "llama.cpp"}
    out: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        base = llama.get(r["context"])
        if r["system"] == "headrace" and base and base["decode_tok_s"] and r["ttft_s"]:
            out.setdefault(label(r), {})[r["context"]] = {
                "decode_vs_llama": round(r["decode_tok_s"] / base["decode_tok_s"], 3),
                "ttft_sooner_than_llama": round(base["ttft_s"] / r["ttft_s"], 3),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.cpu_compare.llama import find_llama_server

    args = parse_args(argv)
    binary, why = find_llama_server(args.llama_server)
    stamp, rows, payload, prompts = common.timestamp(), [], {}, {}
    gguf = args.gguf or common.default_gguf_path()
    title = f"KV cache dtype, one stream: {gguf.name}, {args.threads} threads"
    for item in args.configs.split(","):
        weights, kv = item.split("/")
        rows += headrace_rows(args, weights, kv, prompts)
        payload = {"rows": rows, "llama_server": why or binary, "gguf": str(gguf)}
        common.write_result(args.name, payload, stamp, settings=vars(args))
        plot(rows, stamp, args.name, title)
    if binary:
        more, info = llama_rows(args, binary, prompts)
        rows += more
        payload = {"rows": rows, "llama_server": info, "gguf": str(gguf)}
    payload["vs_llama"] = ratios(rows)
    path = common.write_result(args.name, payload, stamp, settings=vars(args))
    plot(rows, stamp, args.name, title)
    print(path, flush=True)


if __name__ == "__main__":
    main()
