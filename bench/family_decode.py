"""Single-stream decode on the CPU kernels: each model family's per-family work against the
plain Llama shape of the same size, so no family silently costs more than it should
(Mistral's and Gemma's sliding windows, shorter than the prompt, included).

Random weights (seeded) quantized to Q4_0 blocks in process, the shape of Qwen3-0.6B by
default; for each family the engine decodes one sequence (64-token prompt) with
``--weights quantized``; the families' steps are interleaved one by one and the median
step time is reported. Writes
``bench/results/family-decode-<stamp>.json``. Run: ``.venv/bin/python bench/family_decode.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import gguf
import numpy as np
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
from compute.loaders.dummy import dummy_weights
from kernels.cpu.quant import QuantizedWeight

LLAMA = ModelConfig(
    name="qwen3-0.6b-shape", architecture="llama", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
    rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip
WINDOW = 32  # shorter than the 64-token prompt, so the window masks (and skips) keys
GEMMA = dataclasses.replace(
    LLAMA, hidden_act="gelu_tanh", embed_scale=LLAMA.hidden_size**0.5, sandwich_norms=True,
    query_pre_attn_scalar=float(LLAMA.head_dim), sliding_window=WINDOW,
)  # fmt: skip
FAMILIES = {
    "llama": LLAMA,
    "llama3-rope": dataclasses.replace(LLAMA, rope_type="llama3", rope_factor=32.0),
    "qwen3": dataclasses.replace(LLAMA, architecture="qwen3", qk_norm=True),
    "mistral": dataclasses.replace(LLAMA, architecture="mistral", sliding_window=WINDOW),
    # Gemma 3: five sliding layers (their own RoPE base) to one global, q/k norms.
    "gemma3": dataclasses.replace(
        GEMMA, architecture="gemma3", qk_norm=True, rope_local_theta=1e4,
        layer_types=tuple("full" if i % 6 == 5 else "sliding" for i in range(LLAMA.num_layers)),
    ),
    # Gemma 2: sliding and global layers alternating, attention and final soft-caps.
    "gemma2": dataclasses.replace(
        GEMMA, architecture="gemma2", attn_logit_softcap=50.0, final_logit_softcap=30.0,
        layer_types=tuple("full" if i % 2 else "sliding" for i in range(LLAMA.num_layers)),
    ),
}  # fmt: skip


def quantized_model(config: ModelConfig, seed: int) -> LoadedModel:
    weights: dict = dummy_weights(config, torch.float32, "cpu", seed)
    for name, weight in weights.items():
        if weight.dim() == 2:
            blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0)
            data = torch.from_numpy(np.ascontiguousarray(blocks))
            weights[name] = QuantizedWeight.from_gguf("q4_0", data, weight.shape[1])
    return LoadedModel(config=config, weights=weights, tokenizer=None, source=config.name)


def decode_engine(config: ModelConfig, seed: int, steps: int) -> Engine:
    """An engine decoding one sequence (64-token prompt) of `config`, its prefill done."""
    engine = Engine(
        EngineConfig(
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4),
            device=DeviceConfig(device="cpu", cpu_kernels="native", weights="quantized"),
        ),
        loaded=quantized_model(config, seed),
    )
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request("r", list(range(100, 164)), params)
    engine.step()  # the prefill
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    # Every family's engine built first, then their decode steps interleaved one by one,
    # so a busy machine's noise falls on every family alike (the ratios hold under load).
    engines = {name: decode_engine(config, 0, args.steps) for name, config in FAMILIES.items()}
    results: dict[str, list[float]] = {name: [] for name in FAMILIES}
    for _ in range(args.steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            results[name].append(1e3 * (time.perf_counter() - start))
    summary = {name: statistics.median(ms) for name, ms in results.items()}
    for name, ms in summary.items():
        print(f"{name:12s} median {ms:.2f} ms/step, {ms / summary['llama']:.3f}x llama")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = common.RESULTS_DIR / f"family-decode-{stamp}.json"
    record = {
        "machine": common.machine_info(),
        "commit": common.git_commit(),
        "load_average_at_write": common.load_average(),
        "steps": args.steps,
        "shape": dataclasses.asdict(LLAMA),
        "families": {name: dataclasses.asdict(config) for name, config in FAMILIES.items()},
        "ms_per_step": results,
        "median": summary,
        "ratio_to_llama": {name: ms / summary["llama"] for name, ms in summary.items()},
    }
    out.write_text(json.dumps(record, indent=1))
    print(out)


if __name__ == "__main__":
    main()
