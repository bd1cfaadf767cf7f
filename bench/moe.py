"""Mixture-of-experts decode on the CPU kernels against the dense model of the same
active-parameter size: single-stream tok/s, and the weight bytes a decode step reads.

The MoE shape: hidden 1024, 64 experts of moe_intermediate 512, top-8 (a token's experts
are 8 x 512 = 4096 wide), 12 layers, 16 query / 8 KV heads of 64, vocabulary 32768
(tied). The dense model: the same with one SwiGLU MLP of intermediate 4096, so both
compute the same multiply-adds per token; the MoE holds 8x the MLP weights. Every matrix
is random Q4_K blocks (seeded; the router random fp32, as a GGUF file keeps it), run
with ``--weights quantized`` (exact fp32 math on the blocks) by the Engine, one sequence
(64-token prompt) decoding; the two models alternate ``--rounds`` times (the machine is
shared: a busy spell hits both) and the best median step time of each is reported.

Bytes read per decode step: attention, router, the experts some token of the step chose
(each read once per step, however many of the step's tokens chose it) and the lm_head,
counted from the experts the engine really ran (compute/models/moe.py expert_runs) against the
active weights' bytes (top-k experts per token). Also for 8 sequences decoding together,
where tokens share experts and the step reads fewer experts than 8 x top-k.

Run: ``python -m bench.moe``; writes bench/results/moe-<stamp>.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

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
from compute.loaders.base import LoadedModel, expected_shapes
from kernels.cpu.quant import FORMATS, QuantizedWeight

MOE = ModelConfig(
    name="moe-64x512-top8", architecture="llama", vocab_size=32768, hidden_size=1024,
    intermediate_size=4096, num_layers=12, num_heads=16, num_kv_heads=8, head_dim=64,
    rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, norm_topk_prob=True,
)  # fmt: skip
DENSE = dataclasses.replace(
    MOE, name="dense-4096", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0
)
PROMPT = list(range(100, 164))


def q4_k_blocks(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Valid random Q4_K blocks: random codes and 6-bit scales, small fp16 d and dmin."""
    f = FORMATS["q4_k"]
    nb = cols // f.block_values
    raw = torch.randint(0, 256, (rows, nb, f.block_bytes), dtype=torch.uint8, generator=g)
    for offset in (0, 2):
        half = ((torch.rand(rows, nb, generator=g) - 0.5) * 0.001).half()
        raw[:, :, offset : offset + 2] = half.view(torch.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


def random_model(config: ModelConfig, seed: int) -> LoadedModel:
    g = torch.Generator().manual_seed(seed)
    weights: dict = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape)
        elif name.endswith("mlp.gate.weight"):  # the router: fp32 in GGUF files too
            weights[name] = torch.randn(shape, generator=g) * 0.05
        else:
            weights[name] = QuantizedWeight.from_gguf("q4_k", q4_k_blocks(*shape, g), shape[1])
    return LoadedModel(config=config, weights=weights, tokenizer=None, source=config.name)


def engine_for(config: ModelConfig, seed: int) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(num_blocks=128),
            scheduler=SchedulerConfig(max_num_seqs=8),
            device=DeviceConfig(device="cpu", cpu_kernels="native", weights="quantized"),
        ),
        loaded=random_model(config, seed),
    )


def _nbytes(p) -> int:
    return p.quantized.nbytes if p.quantized is not None else p.weight.nbytes


def step_bytes(engine: Engine, expert_runs: int | None) -> dict[str, int]:
    """Weight bytes of one decode step: the attention and lm_head matrices, the routers,
    and ``expert_runs`` experts (None: the dense MLPs)."""
    model = engine.runner.model
    fixed = _nbytes(model.lm_head)
    experts = 0
    for layer in model.layers:
        fixed += _nbytes(layer.qkv) + _nbytes(layer.o_proj)
        if layer.moe is None:
            fixed += _nbytes(layer.gate_up) + _nbytes(layer.down)
        else:
            fixed += layer.moe.router.nbytes
            experts = layer.moe.nbytes // len(layer.moe.experts)
    return {"fixed": fixed, "per_expert": experts, "total": fixed + (expert_runs or 0) * experts}


def _runs(engine: Engine) -> int:
    return sum(layer.moe.expert_runs for layer in engine.runner.model.layers if layer.moe)


def decode(engine: Engine, steps: int, streams: int = 1) -> tuple[float, float]:
    """(median ms per decode step, mean experts run per step) with `streams` sequences."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(streams)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [p + i for p in PROMPT], params)
    engine.step()  # the prefills (one step: 64 tokens each, within the token budget)
    times, runs = [], []
    for _ in range(steps):
        before = _runs(engine)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        runs.append(_runs(engine) - before)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return 1e3 * statistics.median(times), statistics.mean(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="the models alternate this often")
    parser.add_argument("--layers", type=int, default=MOE.num_layers)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    moe_cfg = dataclasses.replace(MOE, num_layers=args.layers)
    dense_cfg = dataclasses.replace(DENSE, num_layers=args.layers)
    engines = {"moe": engine_for(moe_cfg, 0), "dense": engine_for(dense_cfg, 0)}
    ms: dict[str, list[float]] = {name: [] for name in engines}
    runs: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            step_ms, mean_runs = decode(engine, args.steps)
            ms[name].append(step_ms)
            runs[name] = mean_runs
            print(f"{name:6s} {step_ms:.2f} ms/step ({1e3 / step_ms:.1f} tok/s)", flush=True)
    batch_ms, batch_runs = decode(engines["moe"], args.steps, streams=8)
    best = {name: min(v) for name, v in ms.items()}
    moe, dense = engines["moe"], engines["dense"]
    layers = moe_cfg.num_layers
    active = step_bytes(moe, layers * moe_cfg.num_experts_per_tok)
    read_single = step_bytes(moe, round(runs["moe"]))
    read_batch = step_bytes(moe, round(batch_runs))
    all_experts = step_bytes(moe, layers * moe_cfg.num_experts)
    payload = {
        "shapes": {"moe": dataclasses.asdict(moe_cfg), "dense": dataclasses.asdict(dense_cfg)},
        "ms_per_step": ms,
        "best_ms_per_step": best,
        "tok_s": {name: round(1e3 / v, 2) for name, v in best.items()},
        "moe_vs_dense_tok_s": round(best["dense"] / best["moe"], 3),
        "bytes_per_decode_step": {
            "moe_single_stream_read": read_single["total"],
            "moe_active_weights": active["total"],
            "moe_all_weights": all_experts["total"],
            "dense": step_bytes(dense, None)["total"],
            "moe_8_streams_read": read_batch["total"],
            "moe_8_streams_if_per_token": step_bytes(moe, 8 * layers * 8)["total"],
        },
        "experts_run_per_step": {"single_stream": runs["moe"], "8_streams": batch_runs},
        "moe_8_streams_ms_per_step": round(batch_ms, 2),
        "load_average": common.load_average(),
    }
    for key, value in payload["bytes_per_decode_step"].items():
        print(f"{key:28s} {value / 2**20:8.1f} MiB")
    print(f"moe {payload['tok_s']['moe']} tok/s, dense {payload['tok_s']['dense']} tok/s: "
          f"{payload['moe_vs_dense_tok_s']}x")  # fmt: skip

    def draw(stamp: str) -> None:
        fig, (ax1, ax2) = common.new_figure(2)
        common.bar_panel(
            ax1, ["MoE 64x top-8", "dense 4096"], [payload["tok_s"]["moe"],
            payload["tok_s"]["dense"]], "tok/s", "single-stream decode, Q4_K, CPU kernels"
        )  # fmt: skip
        b = payload["bytes_per_decode_step"]
        labels = ["MoE read", "MoE active", "dense", "MoE 8 str.\nread", "MoE all"]
        keys = ["moe_single_stream_read", "moe_active_weights", "dense", "moe_8_streams_read",
                "moe_all_weights"]  # fmt: skip
        common.bar_panel(ax2, labels, [b[k] / 2**20 for k in keys], "MiB", "bytes per step")
        common.save_figure(fig, "moe", stamp, title=f"{moe_cfg.name}, {layers} layers")

    common.publish("moe", payload, draw, settings=vars(args))


if __name__ == "__main__":
    main()
