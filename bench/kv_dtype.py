"""One long-context stream per KV cache dtype (--kv-cache-dtype), in process, on the CPU.

For each (--weights, --kv-cache-dtype) and prompt length: time to first token (the whole
prompt prefilled in chunks of --max-num-batched-tokens) and decode tok/s over the next
--new-tokens greedy tokens, plus the KV bytes per token. One run each after a warm-up:
on a shared machine the figures carry the neighbours' load (the JSON records the load
average). Run by hand:

    .venv/bin/python bench/kv_dtype.py [--contexts 512,2048,4096] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/kv_dtype.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import load_average, new_figure, save_figure, timestamp, write_result  # noqa: E402
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig  # noqa: E402
from compute.core.sampling_params import SamplingParams  # noqa: E402
from compute.engine import Engine  # noqa: E402
from compute.model_runner import kv_bytes_per_block  # noqa: E402

CONFIGS = [  # (--weights, --kv-cache-dtype)
    ("quantized", "float32"),
    ("quantized", "float16"),
    ("quantized", "int8"),
    ("quantized-int8", "float32"),
    ("quantized-int8", "auto"),  # float16
    ("quantized-int8", "int8"),
]
TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, counting the "
    "steps as his father had before him, and from the gallery watched the boats return. "
)


def run_one(engine: Engine, prompt: list[int], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    start = time.perf_counter()
    times: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            times.extend([time.perf_counter()] * len(out.new_token_ids))
    ttft = times[0] - start
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {"ttft_s": ttft, "decode_tok_s": decode, "tokens": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for weights, kv in CONFIGS:
        config = EngineConfig(
            cache=CacheConfig(num_blocks=-(-(max(contexts) + args.new_tokens + 16) // 16),
                              enable_prefix_caching=False, kv_cache_dtype=kv),
            scheduler=SchedulerConfig(max_num_seqs=1,
                                      max_num_batched_tokens=args.max_num_batched_tokens),
            device=DeviceConfig(device="cpu", weights=weights, num_threads=args.threads),
        )  # fmt: skip
        engine = Engine(config)
        ids = engine.tokenizer.encode(TEXT * (max(contexts) // 30 + 2))
        cfg = engine.model_config
        per_token = kv_bytes_per_block(cfg, 16, engine.kv_dtype) // 16
        run_one(engine, ids[:64], 4)  # warm-up
        for ctx in contexts:
            result = run_one(engine, ids[:ctx], args.new_tokens)
            kv_name = str(engine.kv_dtype).removeprefix("torch.")
            row = {"weights": weights, "kv_cache_dtype": kv_name, "context": ctx}
            row.update(kv_bytes_per_token=per_token, **result, load_average=load_average())
            print(row, flush=True)
            rows.append(row)
        del engine
    stamp = timestamp()
    path = write_result("kv-dtype", {"rows": rows}, stamp, settings=vars(args))
    fig, axes = new_figure(2)
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(f"{r['weights']} / kv {r['kv_cache_dtype']}", []).append(r)
    for label, mine in series.items():
        x = [r["context"] for r in mine]
        axes[0].plot(x, [r["decode_tok_s"] for r in mine], "o-", label=label)
        axes[1].plot(x, [r["ttft_s"] for r in mine], "o-", label=label)
    axes[0].set(xlabel="context (tokens)", ylabel="decode tok/s, one stream", xscale="log")
    axes[1].set(xlabel="prompt (tokens)", ylabel="time to first token (s)", xscale="log")
    axes[0].legend(fontsize=7)
    title = "KV cache dtype: SmolLM2-135M Q4_1, one run each, on a shared 2-core machine"
    png = save_figure(fig, "kv-dtype", stamp, title=title)
    print(path, png)


if __name__ == "__main__":
    main()
