"""CUDA graphs of decode steps (compute/runner/cuda_graphs.py), what the CPU can check: the
buckets, and the static buffers a graph replays, run eagerly (``capture=False``). A step
copied into a bucket and padded must give the tokens of the eager step, for every bucket,
as sequences join and leave between steps and the batch crosses bucket boundaries; a
step the graphs cannot serve (prefill, mixed, too many sequences, too long a context)
runs eagerly. The capture and replay themselves are tested on a GPU
(tests/engine/test_engine_gpu.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders import LoadedModel, load_model
from compute.runner.cuda_graphs import DecodeGraphs, bucket_sizes

pytestmark = pytest.mark.slow


def test_bucket_sizes_are_powers_of_two_then_the_cap() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert bucket_sizes(256)[-3:] == [64, 128, 256]


def make_engine(max_num_seqs: int = 12, max_model_len: int = 256, blocks: int = 80) -> Engine:
    """The embedded model as served (quantized weights on the CPU kernels, whose sums do
    not depend on the batch's row count, so padding must not change a bit); a real
    model's tokens depend on every input of the step (a tiny random one did not notice
    stale positions)."""
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=max_model_len
            ),
            device=DeviceConfig(device="cpu", cuda_graphs=True),  # ignored on the CPU
        ),
        loaded=quantized_model(),
    )


_quantized: LoadedModel | None = None


def quantized_model() -> LoadedModel:
    """The embedded model in its GGUF blocks, loaded once; each engine gets its own dict."""
    global _quantized
    if _quantized is None:
        _quantized = load_model("default", progress=False, quantized=True)
    w = _quantized
    return LoadedModel(w.config, dict(w.weights), w.tokenizer, w.source)


def with_buffers(engine: Engine) -> DecodeGraphs:
    runner = engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, engine.block_size,
        engine.config.scheduler.max_num_seqs, engine.max_model_len, capture=False,
    )  # fmt: skip
    runner.graphs = graphs
    return graphs


def workload(seed: int) -> list[tuple[int, list[int], SamplingParams]]:
    """(arrival step, prompt, params): staggered arrivals and lengths, so the decode batch
    grows and shrinks across 1..12 sequences."""
    rng = random.Random(seed)
    out = []
    for i in range(12):
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randrange(2, 40))]
        if i % 3 == 2:
            params = SamplingParams(temperature=0.9, seed=i, max_tokens=rng.randrange(4, 30))
        else:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 30),
                                    ignore_eos=True)  # fmt: skip
        out.append((rng.randrange(0, 25), prompt, params))
    return out


def run(engine: Engine, seed: int) -> dict[str, list[int]]:
    work = workload(seed)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(work))}
    for step in range(500):
        for i, (arrival, prompt, params) in enumerate(work):
            if arrival == step:
                engine.add_request(f"r{i}", prompt, params)
        if step > 25 and not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert engine.stats().kv_usage == 0.0
    return tokens


def test_cuda_graphs_are_ignored_on_the_cpu() -> None:
    engine = make_engine()
    assert engine.runner.graphs is None and engine.cuda_graph_batch_sizes == ()


@pytest.mark.parametrize("seed", [0, 1])
def test_padded_decode_buffers_compute_the_eager_step(seed: int) -> None:
    """Every step the buffers serve writes the cache at the step's slots only (padding
    rows write nowhere) and gives the hidden rows of the same step run eagerly on the
    unpadded batch, bit for bit; and the whole run gives the tokens of an engine without
    the buffers (greedy and seeded requests)."""
    engine = make_engine()
    graphs = with_buffers(engine)
    model, caches = engine.runner.model, engine.runner.kv_caches
    served: list[int] = []
    real_run = graphs.run

    def checked(batch):
        before = [(k.clone(), v.clone()) for k, v in caches]
        hidden = real_run(batch)
        if hidden is not None:
            hidden = hidden.clone()
            assert_only_slots_written(before, caches, batch.meta.slot_mapping)
            eager = model.forward(batch.token_ids, batch.positions, caches, batch.meta)
            assert torch.equal(hidden, eager)
            served.append(batch.meta.num_seqs)
        return hidden

    graphs.run = checked
    tokens = run(engine, seed)
    assert tokens == run(make_engine(), seed)
    sizes = set(served)
    assert graphs.replays == len(served) > 0
    assert len(sizes) >= 5 and any(n not in graphs.buckets for n in sizes), sizes  # padded


def assert_only_slots_written(before, caches, slot_mapping: torch.Tensor) -> None:
    written = torch.zeros(caches[0][0].shape[0] * caches[0][0].shape[1], dtype=torch.bool)
    written[slot_mapping[slot_mapping >= 0]] = True
    for (k0, v0), (k1, v1) in zip(before, caches, strict=True):
        for old, new in ((k0, k1), (v0, v1)):
            old, new = old.flatten(0, 1), new.flatten(0, 1)
            assert torch.equal(old[~written], new[~written]), "a slot outside the step written"


def test_steps_the_buffers_cannot_serve_run_eagerly() -> None:
    engine = make_engine(max_num_seqs=4, max_model_len=2048)
    graphs = with_buffers(engine)
    graphs.max_context = 40  # as if the cap were 40 tokens
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("long", list(range(3, 33)), params)  # 30-token prompt
    engine.step()  # the prefill: not a decode step
    assert graphs.replays == 0
    for _ in range(5):
        engine.step()  # contexts 31..35: decode steps the buffers serve
    assert graphs.replays == 5
    while engine.has_unfinished():
        engine.step()  # past 40 tokens: eager again
    assert graphs.replays == 10  # contexts 36..40 only
