"""The engine end to end on a CUDA device, through the CuPy kernels (gpu-marked).

Dummy weights of SmolLM2's shape (the real model does not travel to the GPU
machine), made once on the CPU in fp32 and copied to each engine, so every
engine runs the same function. Greedy tokens of a mixed batch of 16 prompts
(lengths 3..600, so prefills are chunked under a 256-token budget, decodes
and chunks share steps) are compared:

- with the CPU engine in fp32 on the torch path (the oracle: no CPU kernels to build);
- with the same GPU engine running the torch reference attention instead of
  the kernels (same dtype, same device: only the attention differs).

Random weights give near-tied logits, and a greedy run diverges for good after one flip,
so a share of agreeing tokens measures luck as much as the kernels (the CPU's own bf16
path agreed with its fp32 path at 82.8% of positions). What must hold instead: every row
agrees up to its first divergence, and there each run's token is among the other run's
TOP_K best (both saw the same context up to there, so only a near tie may flip); the share
of rows identical throughout is printed. A wrong kernel picks tokens far down the other's
ranking at once.

Also checked on the GPU: the prefill and decode kernels are both called
(counted), a second round of prompts sharing prefixes hits the prefix cache,
and aborting mid-run returns every block.

Engines run eagerly unless a test tests CUDA graphs (``graphs=True``): a capture
that fails then fails the test (compute/runner/cuda_graphs.py raises when graphs are asked
for), and no test captures what it does not test (the torch reference attention
synchronises, which no capture survives).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.loaders.dummy import load_dummy
from kernels import ops, reference
from kernels.cuda import attention_plan
from kernels.cuda import launch as cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda.is_available(), reason="needs a CUDA device and CuPy"),
]

NEW_TOKENS = 16
TOP_K = 5  # at the first divergence, each run's token is among the other's best TOP_K
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, top_logprobs=TOP_K)


@pytest.fixture(scope="module")
def cpu_weights():
    return load_dummy("smollm2-135m", torch.float32, "cpu", seed=0)


def make_engine(cpu_weights, device: str, dtype: torch.dtype, graphs: bool = False) -> Engine:
    """graphs=True: CUDA graphs asked for, so a failed capture raises (no eager fallback).
    On the CPU the torch path (the oracle; the CPU kernels are not built on the GPU machine)."""
    weights = {k: v.to(device=device, dtype=dtype) for k, v in cpu_weights.weights.items()}
    config = EngineConfig(
        model="dummy:smollm2-135m",
        cache=CacheConfig(block_size=16, num_blocks=2048),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        device=DeviceConfig(
            device=device,
            dtype=str(dtype).removeprefix("torch."),
            cuda_graphs=graphs,
            cpu_kernels="torch",
        ),
    )
    return Engine(config, loaded=replace(cpu_weights, weights=weights))


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 600, 40, 1, 255, 256, 257, 90, 5, 333, 64, 65, 128, 12, 480]
    return [[rng.randrange(4, 49152) for _ in range(n)] for n in lengths]


@dataclass
class Run:
    """One request's tokens and, per position, the ids of its TOP_K best tokens."""

    tokens: list[int]
    best: list[set[int]]


def as_run(tokens: list[int], logprobs) -> Run:
    return Run(list(tokens), [{i for i, _ in lp.top} if lp else set() for lp in logprobs])


def greedy_runs(engine: Engine, batch: list[list[int]]) -> list[Run]:
    return [as_run(out.token_ids, out.logprobs) for out in engine.generate(batch, GREEDY)]


def greedy_tokens(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    return [run.tokens for run in greedy_runs(engine, batch)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where both have a token and they differ (None: none)."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def assert_diverge_only_at_near_ties(a: list[Run], b: list[Run], what: str) -> None:
    """Row by row: equal up to the first divergence, and there each run's token among the
    other's TOP_K best. Prints how many rows are identical throughout."""
    failures, same = [], 0
    for row, (x, y) in enumerate(zip(a, b, strict=True)):
        j = first_divergence(x.tokens, y.tokens)
        if j is None:
            same += 1
        elif not (x.tokens[j] in y.best[j] and y.tokens[j] in x.best[j]):
            failures.append(
                f"row {row}, position {j}: {x.tokens[j]} (best {sorted(x.best[j])}) vs "
                f"{y.tokens[j]} (best {sorted(y.best[j])})"
            )
    print(f"\n{what}: {same}/{len(a)} rows identical; the rest diverge at near ties")
    assert not failures, f"{what}: a token outside the other's top {TOP_K}:\n" + "\n".join(failures)


@pytest.fixture
def launch_counts(monkeypatch) -> Counter:
    counts: Counter = Counter()
    real = cuda._launch

    def counting(device, file, name, *rest):
        counts[name] += 1
        return real(device, file, name, *rest)

    monkeypatch.setattr(cuda, "_launch", counting)
    return counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_greedy_tokens_agree_with_the_cpu_engine(cpu_weights, launch_counts, dtype):
    batch = prompts()
    expected = greedy_runs(make_engine(cpu_weights, "cpu", torch.float32), batch)
    gpu = make_engine(cpu_weights, "cuda", dtype)
    got = greedy_runs(gpu, batch)
    assert all(len(run.tokens) == NEW_TOKENS for run in got)
    assert launch_counts["paged_attention_prefill_" + cuda.ATTENTION_DTYPES[dtype] + "_d64"] > 0
    assert launch_counts[cuda.decode_kernel_name(cuda.ATTENTION_DTYPES[dtype], 64, 16)] > 0
    assert_diverge_only_at_near_ties(got, expected, f"{dtype} vs the CPU fp32 engine")


def test_kernels_match_the_reference_attention_on_the_gpu(cpu_weights, monkeypatch):
    batch = prompts(1)
    kernels = greedy_runs(make_engine(cpu_weights, "cuda", torch.bfloat16), batch)
    # The model calls ops.<op> at each layer: send CUDA tensors through the torch reference.
    monkeypatch.setattr(ops, "paged_attention", reference.paged_attention)
    monkeypatch.setattr(ops, "reshape_and_cache", reference.reshape_and_cache)
    torch_path = greedy_runs(make_engine(cpu_weights, "cuda", torch.bfloat16), batch)
    assert_diverge_only_at_near_ties(kernels, torch_path, "bf16, kernels vs torch attention")


def test_sdpa_prefill_matches_the_reference_attention_on_the_gpu(
    cpu_weights, monkeypatch, launch_counts
):
    """The engine with prefills through torch SDPA (kernels/cuda/prefill_sdpa.py) and
    decodes through the CuPy kernel, against the torch reference attention."""
    batch = prompts(5)
    monkeypatch.setattr(cuda, "prefill_variant", "sdpa")
    sdpa = greedy_runs(make_engine(cpu_weights, "cuda", torch.bfloat16), batch)
    assert not any(name.startswith("paged_attention_prefill_") for name in launch_counts)
    assert launch_counts[cuda.decode_kernel_name("bf16", 64, 16)] > 0
    monkeypatch.setattr(ops, "paged_attention", reference.paged_attention)
    monkeypatch.setattr(ops, "reshape_and_cache", reference.reshape_and_cache)
    torch_path = greedy_runs(make_engine(cpu_weights, "cuda", torch.bfloat16), batch)
    assert_diverge_only_at_near_ties(sdpa, torch_path, "bf16, SDPA prefill vs torch attention")


def gemma2_attention(loaded):
    """The same weights with Gemma 2's attention deltas: sliding and full layers in turn
    (a 48-token window, shorter than most prompts) and soft-capped scores."""
    n = loaded.config.num_layers
    config = replace(
        loaded.config,
        sliding_window=48,
        layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(n)),
        attn_logit_softcap=10.0,
    )
    return replace(loaded, config=config)


def test_windowed_softcapped_kernels_match_the_reference_attention_on_the_gpu(
    cpu_weights, monkeypatch
):
    """As above for a model whose kernels mask a window and cap scores; its whole context
    is served (no cap at the window on CUDA any more)."""
    model, batch = gemma2_attention(cpu_weights), prompts(2)
    engine = make_engine(model, "cuda", torch.bfloat16)
    assert engine.max_model_len == model.config.max_position_embeddings
    kernels = greedy_runs(engine, batch)
    monkeypatch.setattr(ops, "paged_attention", reference.paged_attention)
    monkeypatch.setattr(ops, "reshape_and_cache", reference.reshape_and_cache)
    torch_path = greedy_runs(make_engine(model, "cuda", torch.bfloat16), batch)
    assert_diverge_only_at_near_ties(kernels, torch_path, "bf16 windowed + soft-capped")


def test_prefix_cache_and_abort_on_the_gpu(cpu_weights, launch_counts):
    engine = make_engine(cpu_weights, "cuda", torch.bfloat16)
    first = prompts(2)
    greedy_tokens(engine, first)
    hits_before = engine.stats().prefix_cache_hit_tokens
    # Same prefixes, new endings: full cached blocks are reused, only the rest is computed.
    greedy_tokens(engine, [p[:-1] + [7] for p in first if len(p) > 40])
    assert engine.stats().prefix_cache_hit_tokens > hits_before
    total = engine.stats().num_blocks
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"abort-{i}", p, GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.stats().num_free_blocks < total
    for i in range(16):
        engine.abort(f"abort-{i}")
    assert engine.stats().num_free_blocks == total and not engine.has_unfinished()
    torch.cuda.synchronize()  # a kernel fault would surface here


def _run_mixed(
    engine: Engine, params: list[SamplingParams], abort_at: int | None, logprobs=None
) -> dict:
    """Step a seeded mixed batch by hand (as the step loop does), aborting request 3 at
    step `abort_at` (None: never): {request id: [tokens, finish reason]}. `logprobs`, a dict
    when given, gets each request's per-token logprobs."""
    for i, (prompt, p) in enumerate(zip(prompts(4), params, strict=True)):
        engine.add_request(f"m{i}", prompt, p)
    got: dict[str, list] = {f"m{i}": [[], None] for i in range(len(params))}
    for step in range(1000):
        if not engine.has_unfinished():
            break
        if step == abort_at:
            engine.abort("m3")
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1] = out.finish_reason
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    return got


def test_async_output_gives_the_bits_of_sync_output_at_the_same_batch_shapes(cpu_weights):
    """Asynchronous output (the default on CUDA, as CUDA graphs are) against synchronous
    output, when no request ends before its length cap and none is aborted: every step then
    holds the same sequences in both modes (async output only reads a step's ids one step
    later), so every GEMM, attention plan and graph bucket sees the same shapes, and the
    tokens must be identical, greedy and seeded alike."""
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=6 + i, ignore_eos=True)
        if i % 3 == 1
        else SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True)
        for i in range(16)
    ]
    sync = make_engine(cpu_weights, "cuda", torch.bfloat16, graphs=True)
    sync.async_output = False
    expected = _run_mixed(sync, params, abort_at=None)
    engine = make_engine(cpu_weights, "cuda", torch.bfloat16, graphs=True)
    assert engine.async_output  # on by default for CUDA
    got = _run_mixed(engine, params, abort_at=None)
    assert engine.runner.graphs.replays > 0
    assert got == expected
    torch.cuda.synchronize()


def test_async_output_gives_the_outputs_of_sync_output(cpu_weights, monkeypatch):
    """Asynchronous output against synchronous output on greedy, seeded, stop-token and
    length-capped requests, one aborted at a fixed step. The bookkeeping is checked exactly
    on the CPU (tests/engine/test_async_output.py); here the bits cannot be: a request stopped by a
    token runs one step more in async mode, so that step holds one sequence more than in
    sync mode. Pinned, so that this changes no attention bit: eager steps (no graph bucket)
    and the decode partition size (the planner would pick it from the batch; per sequence
    the kernel is then batch invariant, test_batch_invariance_gpu). Not pinnable: cuBLAS
    may round a GEMM of one row more differently, and random weights' near-tied logits make
    a greedy run diverge for good after one flip: every row must agree up to its first
    divergence and diverge there only between near ties (each token among the other run's
    TOP_K best; the seeded rows sample among their best 2, so theirs do too); what does not
    depend on the bits must hold exactly."""
    monkeypatch.setattr(attention_plan, "decode_partition_size", lambda *args: 128)
    reference = greedy_tokens(make_engine(cpu_weights, "cuda", torch.bfloat16), prompts(4))
    params = []
    for i in range(16):
        if i % 4 == 1:
            params.append(
                SamplingParams(
                    temperature=0.8, top_k=2, seed=i, max_tokens=12 + i, top_logprobs=TOP_K
                )
            )
        elif i % 4 == 2:  # stops on the token it would emit fifth
            stop = reference[i][4]
            params.append(
                SamplingParams(
                    temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=(stop,),
                    top_logprobs=TOP_K,
                )
            )  # fmt: skip
        else:
            params.append(
                SamplingParams(
                    temperature=0.0, max_tokens=4 + i, ignore_eos=True, top_logprobs=TOP_K
                )
            )
    sync = make_engine(cpu_weights, "cuda", torch.bfloat16)  # fresh: no prefix-cache hits
    sync.async_output = False
    expected_logprobs, got_logprobs = {}, {}
    expected = _run_mixed(sync, params, abort_at=6, logprobs=expected_logprobs)
    engine = make_engine(cpu_weights, "cuda", torch.bfloat16)
    assert engine.async_output  # on by default for CUDA
    got = _run_mixed(engine, params, abort_at=6, logprobs=got_logprobs)
    aborted, expected_aborted = got.pop("m3"), expected.pop("m3")
    assert len(expected_aborted[0]) - len(aborted[0]) in (0, 1)
    keys = sorted(got)
    assert_diverge_only_at_near_ties(
        [as_run(got[k][0], got_logprobs.get(k, [])) for k in keys],
        [as_run(expected[k][0], expected_logprobs.get(k, [])) for k in keys],
        "bf16, async vs sync output",
    )
    for i, p in enumerate(params):  # length caps: the same counts whatever the bits
        if i != 3 and p.ignore_eos and not p.stop_token_ids:
            assert len(got[f"m{i}"][0]) == len(expected[f"m{i}"][0]) == p.max_tokens
    for run in (got, expected):
        assert any(reason is not None and reason.value == "stop" for _, reason in run.values())
    torch.cuda.synchronize()


def test_async_step_never_waits_for_work_queued_after_the_step_it_reads(cpu_weights):
    """The point of asynchronous output: step() launches step N+1 and reads step N's ids
    without waiting for anything queued after step N (a sleeping kernel here), so no
    host-to-device copy of the inputs and no read of the outputs synchronizes the stream."""
    engine = make_engine(cpu_weights, "cuda", torch.bfloat16)
    engine.add_request("a", prompts()[1], GREEDY)
    engine.step()  # step 1 (the prefill) launched, nothing read
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued before step 2
    slept = torch.cuda.Event()
    slept.record()
    outputs = engine.step()  # launches step 2 behind the sleep, reads step 1
    assert not slept.query(), "step() waited for the GPU work queued after step 1"
    assert [len(o.new_token_ids) for o in outputs] == [1]
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()


def test_device_tensor_is_queued_not_waited_for():
    from kernels.transfer import device_tensor

    torch.cuda._sleep(2_000_000_000)
    slept = torch.cuda.Event()
    slept.record()
    t = device_tensor([[1, 2], [3, 4]], torch.int32, "cuda")
    assert not slept.query(), "the copy waited for the kernel queued before it"
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, 4]]


def _joining_and_leaving(engine: Engine, seed: int, logprobs=None) -> dict[str, list[int]]:
    """Greedy requests arriving over 20 steps with varied lengths: the decode batch grows
    and shrinks through every bucket up to 16 (so it crosses bucket boundaries). `logprobs`,
    a dict when given, gets each request's per-token logprobs (TOP_K best)."""
    rng = random.Random(seed)
    work = [
        (rng.randrange(0, 20), [rng.randrange(4, 49152) for _ in range(rng.randrange(3, 80))],
         SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 40), ignore_eos=True,
                        top_logprobs=TOP_K))
        for _ in range(16)
    ]  # fmt: skip
    tokens: dict[str, list[int]] = {f"j{i}": [] for i in range(len(work))}
    for step in range(400):
        for i, (arrival, prompt, params) in enumerate(work):
            if arrival == step:
                engine.add_request(f"j{i}", prompt, params)
        if step > 20 and not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    return tokens


def test_cuda_graphs_replay_gives_the_tokens_of_the_same_buffers_run_eagerly(cpu_weights):
    """Every bucket's graph (batch 1..16, joins and leaves) against the same padded buffers
    run eagerly (capture=False): same kernels, same shapes, and on CUDA the same attention
    plan (both plan every row at the graphs' context cap), so the same tokens; and against
    plain eager steps (other row counts, so bf16 GEMMs may round differently, and random
    weights' near-tied logits make a greedy run diverge for good after one flip: rows
    diverge only at near ties, as in the CPU comparison above)."""
    from compute.runner.cuda_graphs import DecodeGraphs

    engine = make_engine(cpu_weights, "cuda", torch.bfloat16, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and engine.cuda_graph_batch_sizes == (1, 2, 4, 8, 16)
    replayed_logprobs, plain_logprobs = {}, {}
    replayed = _joining_and_leaving(engine, seed=5, logprobs=replayed_logprobs)
    assert graphs.replays > 0

    buffers = make_engine(cpu_weights, "cuda", torch.bfloat16)
    runner = buffers.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.kv_caches, buffers.block_size, 16, buffers.max_model_len,
        capture=False,
    )  # fmt: skip
    assert _joining_and_leaving(buffers, seed=5) == replayed

    eager = make_engine(cpu_weights, "cuda", torch.bfloat16)
    assert eager.runner.graphs is None
    plain = _joining_and_leaving(eager, seed=5, logprobs=plain_logprobs)
    assert_diverge_only_at_near_ties(
        [as_run(plain[k], plain_logprobs[k]) for k in sorted(plain)],
        [as_run(replayed[k], replayed_logprobs[k]) for k in sorted(plain)],
        "graph replay vs eager steps",
    )


def test_cuda_graphs_replay_windowed_layers_as_the_same_buffers_run_eagerly(cpu_weights):
    """A windowed, soft-capped model's decode graphs: the captured grid covers the
    partitions a window reaches at any context, so replay gives the eager buffers' tokens."""
    from compute.runner.cuda_graphs import DecodeGraphs

    model = gemma2_attention(cpu_weights)
    engine = make_engine(model, "cuda", torch.bfloat16, graphs=True)
    replayed = _joining_and_leaving(engine, seed=7)
    assert engine.runner.graphs.replays > 0
    buffers = make_engine(model, "cuda", torch.bfloat16)
    runner = buffers.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.kv_caches, buffers.block_size, 16, buffers.max_model_len,
        capture=False,
    )  # fmt: skip
    assert _joining_and_leaving(buffers, seed=7) == replayed


def test_abort_during_graph_replayed_decoding_frees_blocks(cpu_weights):
    engine = make_engine(cpu_weights, "cuda", torch.bfloat16, graphs=True)
    total = engine.stats().num_blocks
    for i, p in enumerate(prompts(6)[:6]):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
    while engine.stats().num_waiting or engine.runner.graphs.replays < 5:
        engine.step()
    for i in range(6):
        engine.abort(f"g{i}")
    assert engine.stats().num_free_blocks == total and not engine.has_unfinished()
    torch.cuda.synchronize()
