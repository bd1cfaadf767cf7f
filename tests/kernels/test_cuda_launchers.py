"""kernels.cuda's launchers without a GPU: argument checks, clear errors, dispatch.

The launch itself is replaced by a recorder (`kernels.cuda.launch._launch`) and the
GPU entry check (`_require_gpu`) by a no-op, so CPU tensors go through every
check and through the grid and argument computation. The compile cache and
the stream hand-off run against a fake CuPy. The kernels' numbers are
tested in test_kernels_gpu.py.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch

from kernels.cuda import attention_plan
from kernels.cuda import launch as cuda
from kernels.metadata import AttentionMetadata
from tests.support.cuda_host.fake_cupy import FakeCupy


@dataclass
class Launch:
    device: torch.device
    file: str
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Any, ...]


@pytest.fixture
def launches(monkeypatch) -> list[Launch]:
    """Recorded launches; planned for a GPU of one SM, so decode partitions are 512 tokens
    (test_decode_partitions_fill_the_gpu plans for 132)."""
    recorded: list[Launch] = []
    monkeypatch.setattr(cuda, "_launch", lambda *args: recorded.append(Launch(*args)))
    monkeypatch.setattr(cuda, "_require_gpu", lambda t, name: None)
    monkeypatch.setattr(attention_plan, "sm_count", lambda device: 1)
    return recorded


@dataclass
class Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata

    def call(self, **changes):
        fields = {**vars(self), **changes}
        return cuda.paged_attention(
            fields["query"], fields["key_cache"], fields["value_cache"], fields["meta"], 0.125
        )


def attention_inputs(
    seqs=((1, 20),), heads=6, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, rows=None
) -> Inputs:
    """seqs: (query_len, context_len) pairs over consecutive cache blocks."""
    tables, next_block = [], 0
    for _, ctx in seqs:
        count = math.ceil(ctx / block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    meta = AttentionMetadata.build([q for q, _ in seqs], [c for _, c in seqs], tables, block_size)
    rows = rows if rows is not None else sum(q for q, _ in seqs)
    cache_shape = (next_block + 1, block_size, kv_heads, head_dim)
    return Inputs(
        query=torch.randn(rows, heads, head_dim).to(dtype),
        key_cache=torch.zeros(cache_shape, dtype=dtype),
        value_cache=torch.zeros(cache_shape, dtype=dtype),
        meta=meta,
    )


def cache_inputs(tokens=5, kv_heads=2, head_dim=64, dtype=torch.float16, misalign=0):
    """Arguments of reshape_and_cache; `misalign` elements of offset for key and value."""

    def rows(n):
        flat = torch.zeros(n * kv_heads * head_dim + misalign, dtype=dtype)
        return flat[misalign:].view(n, kv_heads, head_dim)

    cache = (4, 16, kv_heads, head_dim)
    return dict(
        key=rows(tokens),
        value=rows(tokens),
        key_cache=torch.zeros(cache, dtype=dtype),
        value_cache=torch.zeros(cache, dtype=dtype),
        slot_mapping=torch.arange(tokens, dtype=torch.int64),
    )


# ----------------------------------------------------------------------------- missing pieces


def test_missing_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    inputs = attention_inputs()
    with pytest.raises(RuntimeError, match="CuPy is not installed: pip install cupy-cuda13x"):
        inputs.call()
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        cuda.reshape_and_cache(**cache_inputs())
    assert not cuda.is_available()


def test_missing_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        attention_inputs().call()
    assert not cuda.is_available()


def test_cpu_tensors_are_rejected(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="query must be a CUDA tensor"):
        attention_inputs().call()
    with pytest.raises(ValueError, match="key must be a CUDA tensor"):
        cuda.reshape_and_cache(**cache_inputs())


# ----------------------------------------------------------------------------- argument checks


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t's shape that starts one element into its buffer."""
    return torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)


def _narrow_tables(i: Inputs):
    return {"meta": replace(i.meta, block_tables=i.meta.block_tables[:, :1])}


BAD_ATTENTION_ARGS = {
    "query dtype": (lambda i: {"query": i.query.float()}, "query must be one of"),
    "query layout": (
        lambda i: {"query": i.query.repeat(1, 1, 2)[..., ::2]},
        "query must be contiguous",
    ),
    "query rank": (lambda i: {"query": i.query[0]}, r"query must have shape \[\*, \*, \*\]"),
    "head dim": (lambda i: {"query": i.query[..., :32].contiguous()}, "head dim must be one of"),
    "key_cache dtype": (
        lambda i: {"key_cache": i.key_cache.bfloat16()},
        "key_cache must be torch.float16",
    ),
    "key_cache type": (lambda i: {"key_cache": i.key_cache.numpy()}, "key_cache must be a torch"),
    "value_cache shape": (
        lambda i: {"value_cache": i.value_cache[:-1]},
        "value_cache must have shape",
    ),
    "value_cache layout": (
        lambda i: {"value_cache": i.value_cache.transpose(0, 1).contiguous().transpose(0, 1)},
        "value_cache must be contiguous",
    ),
    "block size": (
        lambda i: {
            "key_cache": i.key_cache.view(-1, 8, 2, 64),
            "value_cache": i.value_cache.view(-1, 8, 2, 64),
        },
        "block size must be one of",
    ),
    "heads vs kv heads": (lambda i: {"query": i.query[:, :5].contiguous()}, "not a multiple"),
    "cache alignment": (
        lambda i: {
            "key_cache": _misaligned(i.key_cache),
            "value_cache": _misaligned(i.value_cache),
        },
        "key_cache must start on a 16-byte boundary",
    ),
    "block_tables dtype": (
        lambda i: {"meta": replace(i.meta, block_tables=i.meta.block_tables.long())},
        "meta.block_tables must be torch.int32",
    ),
    "context_lens length": (
        lambda i: {"meta": replace(i.meta, context_lens=i.meta.context_lens[:0])},
        "meta.context_lens must have shape",
    ),
    "query_start_loc dtype": (
        lambda i: {"meta": replace(i.meta, query_start_loc=i.meta.query_start_loc.long())},
        "meta.query_start_loc must be torch.int32",
    ),
    "metadata device": (
        lambda i: {"meta": replace(i.meta, context_lens=i.meta.context_lens.to("meta"))},
        "meta.context_lens must be on cpu",
    ),
    "narrow block tables": (_narrow_tables, "too narrow"),
    "rows vs query_lens": (lambda i: {"query": i.query[:0]}, "meta.query_lens sum to 1"),
    "context shorter than query": (
        lambda i: {
            "query": i.query.repeat(3, 1, 1),
            "meta": replace(i.meta, query_lens=[3], context_lens_host=[2]),
        },
        "shorter than its query_len",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ATTENTION_ARGS))
def test_paged_attention_rejects(case, launches):
    change, message = BAD_ATTENTION_ARGS[case]
    inputs = attention_inputs(seqs=((1, 20),))
    with pytest.raises(ValueError, match=message):
        inputs.call(**change(inputs))
    assert launches == []


BAD_CACHE_ARGS = {
    "key dtype": (lambda a: {"key": a["key"].double()}, "key must be one of"),
    "key layout": (lambda a: {"key": a["key"].transpose(1, 2)}, "key must be contiguous"),
    "value shape": (lambda a: {"value": a["value"][:-1]}, "value must have shape"),
    "value dtype": (lambda a: {"value": a["value"].bfloat16()}, "value must be torch.float16"),
    "cache heads": (
        lambda a: {"key_cache": a["key_cache"].view(4, 16, 1, 128)},
        "key_cache must have shape",
    ),
    "value_cache shape": (
        lambda a: {"value_cache": a["value_cache"][:2]},
        "value_cache must have shape",
    ),
    "slot dtype": (
        lambda a: {"slot_mapping": a["slot_mapping"].int()},
        "slot_mapping must be torch.int64",
    ),
    "slot count": (
        lambda a: {"slot_mapping": a["slot_mapping"][:2]},
        "slot_mapping must have shape",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CACHE_ARGS))
def test_reshape_and_cache_rejects(case, launches):
    change, message = BAD_CACHE_ARGS[case]
    args = cache_inputs()
    with pytest.raises(ValueError, match=message):
        cuda.reshape_and_cache(**{**args, **change(args)})
    assert launches == []


# ----------------------------------------------------------------------------- dispatch


def _pointers(launch: Launch) -> list[int]:
    return [int(a) for a in launch.args if isinstance(a, np.uint64)]


def test_short_decode_is_one_launch(launches):
    inputs = attention_inputs(seqs=((1, 20), (1, 512), (1, 1)), heads=6, kv_heads=2)
    out = inputs.call()
    (launch,) = launches
    assert launch.file == "paged_attention_decode.cu"
    assert launch.name == "paged_attention_decode_f16_d64_b16"
    assert launch.grid == (2, 3, 1) and launch.block == (cuda.DECODE_THREADS, 1, 1)
    kinds = [type(a) for a in launch.args]
    assert kinds == [np.uint64] * 10 + [np.float32] * 2 + [np.int32] * 6
    pointers = _pointers(launch)
    assert pointers[0] == out.data_ptr() and pointers[1:4] == [0, 0, 0]  # no workspaces
    assert pointers[4:7] == [
        t.data_ptr() for t in (inputs.query, inputs.key_cache, inputs.value_cache)
    ]
    assert launch.args[10] == pytest.approx(0.125 * math.log2(math.e))
    assert launch.args[11] == 0  # no soft-cap
    width = inputs.meta.block_tables.shape[1]
    # window (none), kv heads, group, table width, partitions, partition size
    assert [int(a) for a in launch.args[12:]] == [0, 2, 3, width, 1, 512]


@pytest.mark.parametrize(
    "heads,kv_heads,name",
    [
        (6, 2, "paged_attention_decode_onepass_f16_d64_b16_g4"),  # group 3
        (8, 2, "paged_attention_decode_onepass_f16_d64_b16_g4"),  # group 4
        (10, 2, "paged_attention_decode_onepass_f16_d64_b16_g8"),  # group 5
        (32, 2, "paged_attention_decode_onepass_f16_d64_b16_g8"),  # group 16: two chunks of 8
    ],
)
def test_the_one_pass_kernel_is_sized_for_the_group(launches, monkeypatch, heads, kv_heads, name):
    monkeypatch.setattr(cuda, "decode_variant", "one-pass")
    inputs = attention_inputs(seqs=((1, 20), (1, 3)), heads=heads, kv_heads=kv_heads)
    inputs.call()
    (launch,) = launches
    assert launch.name == name
    assert name in cuda.kernel_names()["paged_attention_decode.cu"]
    # Same grid and arguments as the two-pass kernel's.
    assert launch.grid == (kv_heads * -(-(heads // kv_heads) // 8), 2, 1)


def test_an_unknown_decode_variant_is_refused():
    with pytest.raises(ValueError, match="decode variant"):
        cuda.decode_kernel_name("f16", 64, 16, 3, "three-pass")


def test_warm_up_loads_the_decode_kernels_a_model_can_launch(monkeypatch):
    monkeypatch.setattr(cuda, "decode_variant", "one-pass")
    names = {name for _, name in cuda.kernels_for(torch.float16, 128, 32)}
    assert {"paged_attention_decode_onepass_f16_d128_b32_g4",
            "paged_attention_decode_onepass_f16_d128_b32_g8"} <= names  # fmt: skip
    monkeypatch.setattr(cuda, "decode_variant", "two-pass")
    assert "paged_attention_decode_f16_d128_b32" in {
        n for _, n in cuda.kernels_for(torch.float16, 128, 32)
    }


def test_long_decode_adds_the_partition_merge(launches):
    inputs = attention_inputs(
        seqs=((1, 513), (1, 1100)),
        heads=8,
        kv_heads=2,
        head_dim=128,
        block_size=32,
        dtype=torch.bfloat16,
    )
    inputs.call()
    decode, merge = launches
    assert decode.name == "paged_attention_decode_bf16_d128_b32"
    assert decode.grid == (2, 2, 3)  # ceil(1100 / 512) partitions
    assert all(p != 0 for p in _pointers(decode)[1:4])
    assert merge.name == "paged_attention_decode_reduce_bf16_d128"
    assert merge.grid == (8, 2, 1) and merge.block == (128, 1, 1)
    assert [int(a) for a in merge.args[-3:]] == [8, 3, 512]  # query heads, partitions, size
    assert _pointers(merge)[:4] == _pointers(decode)[:4]  # same output and workspaces


@pytest.mark.parametrize(
    "seqs,kv_heads,size,parts",
    [
        ([(1, 2048)], 3, 64, 32),  # SmolLM2 at batch 1: 96 blocks instead of 12
        ([(1, 2048)] * 2, 8, 128, 16),  # Llama-8B-like at batch 2: 256 blocks
        ([(1, 2048)] * 8, 8, 512, 4),  # ... at batch 8: 256 blocks at 512 already
        ([(1, 2048)] * 64, 3, 512, 4),  # fills 132 SMs at 512 already: 768 blocks
        ([(1, 100)], 3, 64, 2),  # too short to fill anything: the smallest split
        ([(1, 40)], 3, 64, 1),
    ],
)
def test_decode_partitions_fill_the_gpu(launches, monkeypatch, seqs, kv_heads, size, parts):
    monkeypatch.setattr(attention_plan, "sm_count", lambda device: 132)
    attention_inputs(seqs=seqs, heads=3 * kv_heads, kv_heads=kv_heads).call()
    decode = launches[0]
    assert decode.grid == (kv_heads, len(seqs), parts)
    assert [int(a) for a in decode.args[-2:]] == [parts, size]
    if parts > 1:
        assert [int(a) for a in launches[1].args[-2:]] == [parts, size]
    else:
        assert len(launches) == 1


@pytest.mark.parametrize("blocks,longest", [(1, 1), (3, 2048), (9, 700), (200, 100), (1, 10**5)])
def test_partition_size_is_the_largest_that_fills(blocks, longest):
    size = attention_plan.decode_partition_size(blocks, longest, 132)
    fills = [s for s in attention_plan.PARTITION_SIZES if blocks * math.ceil(longest / s) >= 132]
    assert size == (max(fills) if fills else 64)


def test_checks_and_plan_run_once_per_metadata(launches, monkeypatch):
    """30 layers of a step share one metadata record: one check of it, not 30."""
    calls = []
    real = attention_plan.check_metadata
    monkeypatch.setattr(attention_plan, "check_metadata", lambda *a: calls.append(1) or real(*a))
    inputs = attention_inputs(seqs=((1, 20), (5, 40)))
    for _ in range(30):  # a new query and new caches per layer, as in the model
        layer = attention_inputs(seqs=((1, 20), (5, 40)))
        inputs.call(query=layer.query, key_cache=layer.key_cache, value_cache=layer.value_cache)
    assert len(calls) == 1 and len(launches) == 60
    # A new step (a new metadata record) is checked again, and so is a bad layer tensor.
    inputs.call(meta=replace(inputs.meta))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="query must be contiguous"):
        inputs.call(query=inputs.query.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="key_cache must start on a 16-byte boundary"):
        inputs.call(key_cache=_misaligned(inputs.key_cache))


def test_groups_over_eight_heads_split_across_blocks(launches):
    attention_inputs(heads=32, kv_heads=2).call()
    assert launches[0].grid == (2 * 2, 1, 1)


def test_prefill_is_one_launch(launches):
    inputs = attention_inputs(seqs=((37, 37), (100, 300)), heads=9, kv_heads=3)
    inputs.call()
    (launch,) = launches
    assert launch.name == "paged_attention_prefill_f16_d64"
    assert launch.grid == (math.ceil(100 * 3 / cuda.PREFILL_ROWS), 2, 3)
    assert launch.block == (cuda.PREFILL_THREADS, 1, 1)
    assert [int(a) for a in launch.args[-4:]] == [3, 3, 16, inputs.meta.block_tables.shape[1]]


def _windowed(inputs: Inputs, window=None, softcap=None):
    return cuda.paged_attention(
        inputs.query, inputs.key_cache, inputs.value_cache, inputs.meta, 0.125, window, softcap
    )


def test_window_and_softcap_are_kernel_arguments(launches):
    """Both kernels take (scale, softcap) times log2(e) and the window, the merge the window."""
    inputs = attention_inputs(seqs=((1, 1100), (1, 30), (9, 300)), heads=6, kv_heads=2)
    _windowed(inputs, window=100, softcap=30.0)
    decode, merge, prefill = launches
    log2e = math.log2(math.e)
    for launch, first in ((decode, 10), (prefill, 7)):  # after the pointers
        scores = launch.args[first : first + 3]
        assert [type(a) for a in scores] == [np.float32, np.float32, np.int32]
        assert scores[0] == pytest.approx(0.125 * log2e)
        assert scores[1] == pytest.approx(30.0 * log2e)
        assert int(scores[2]) == 100
    # 100 keys can straddle a partition boundary: 2 of the context's 3 partitions of 512.
    assert decode.grid[2] == 2 and [int(a) for a in decode.args[-2:]] == [2, 512]
    assert [int(a) for a in merge.args[-4:]] == [100, 6, 2, 512]  # window, heads, parts, size
    assert _pointers(merge)[:4] == _pointers(decode)[:4]


@pytest.mark.parametrize(
    "window,size,parts",
    [
        (None, 64, 18),  # ceil(1100 / 64)
        (1, 64, 1),
        (64, 64, 2),  # 64 keys straddle two partitions unless aligned
        (65, 64, 2),
        (66, 64, 3),
        (200, 64, 5),
        (5000, 64, 18),  # longer than the context: every partition
        (100, 512, 2),
        (600, 512, 3),  # more than the context's partitions: capped at them
    ],
)
def test_decode_grid_covers_only_what_a_window_reaches(launches, monkeypatch, window, size, parts):
    monkeypatch.setattr(attention_plan, "decode_partition_size", lambda *args: size)
    inputs = attention_inputs(seqs=((1, 1100), (1, 3)))
    _windowed(inputs, window=window)
    decode = launches[0]
    assert decode.grid[2] == parts
    assert [int(a) for a in decode.args[-2:]] == [parts, size]
    assert len(launches) == (2 if parts > 1 else 1)


@pytest.mark.parametrize("size", [64, 512])
def test_the_window_grid_holds_every_partition_the_kernel_runs(size):
    """The decode kernel runs, for a context ctx, the partitions from the one holding key
    ctx - window to the last (paged_attention_decode.cu, decode_work): never more than the
    grid the plan gives a window, whatever the context."""
    plan = attention_plan.AttentionPlan(
        num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, table_width=1,
        dtype_suffix="f16", covered=True, decode_partition_size=size,
        decode_partitions=math.ceil(3000 / size), prefill_longest=0,
    )  # fmt: skip
    for window in [*range(1, 2 * size + 3), 1000, 2999, 3000, 5000]:
        grid = plan.decode_partitions_within(window)
        runs = [math.ceil(c / size) - max(0, c - window) // size for c in range(1, 3001)]
        assert max(runs) == grid  # enough, and not one more than some context needs


def test_no_window_and_no_softcap_pass_zeros(launches):
    inputs = attention_inputs(seqs=((1, 40), (5, 40)))
    _windowed(inputs)
    decode, prefill = launches
    for launch, first in ((decode, 10), (prefill, 7)):
        assert launch.args[first + 1] == 0 and int(launch.args[first + 2]) == 0
    _windowed(inputs, window=2**40)  # longer than any context: the most an int32 holds
    assert int(launches[-2].args[12]) == 2**31 - 1


@pytest.mark.parametrize(
    "window,softcap,message",
    [
        (0, None, "window must be positive"),
        (-3, None, "window must be positive"),
        (2.5, None, "window must be an int"),
        (True, None, "window must be an int"),
        (None, 0.0, "softcap must be positive"),
        (None, -1.0, "softcap must be positive"),
        (None, math.inf, "softcap must be positive and finite"),
        (None, math.nan, "softcap must be positive and finite"),
    ],
)
def test_bad_window_or_softcap_is_rejected(launches, window, softcap, message):
    with pytest.raises(ValueError, match=message):
        _windowed(attention_inputs(), window=window, softcap=softcap)
    assert launches == []


def test_mixed_batch_runs_both_kernels(launches):
    # The prefill's long context must not widen the decode grid: only decode rows count.
    attention_inputs(seqs=((1, 100), (40, 2000), (1, 30))).call()
    assert [launch.name for launch in launches] == [
        "paged_attention_decode_f16_d64_b16",
        "paged_attention_prefill_f16_d64",
    ]
    assert launches[0].grid[2] == 1


def test_a_batch_of_no_sequences_launches_nothing(launches):
    inputs = attention_inputs()
    empty = AttentionMetadata.build([], [], [], 16)
    assert inputs.call(query=inputs.query[:0], meta=empty).shape == (0, 6, 64)
    assert launches == []


def test_rows_no_sequence_owns_are_zero(launches):
    out = attention_inputs(seqs=((1, 20), (3, 5)), rows=7).call()
    assert out.shape[0] == 7 and (out[4:] == 0).all()


@pytest.mark.parametrize(
    "dtype,misalign,suffix,width",
    [
        (torch.float16, 0, "w16", 16),
        (torch.float16, 1, "w2", 2),
        (torch.float16, 2, "w4", 4),
        (torch.float32, 1, "w4", 4),
        (torch.bfloat16, 8, "w16", 16),
    ],
)
def test_cache_write_picks_the_widest_copy_word(launches, dtype, misalign, suffix, width):
    args = cache_inputs(tokens=5, kv_heads=3, head_dim=64, dtype=dtype, misalign=misalign)
    cuda.reshape_and_cache(**args)
    (launch,) = launches
    words = 3 * 64 * args["key"].element_size() // width
    assert launch.name == f"reshape_and_cache_{suffix}"
    assert launch.grid == (5, 1, 1) and launch.block == (min(256, math.ceil(words / 32) * 32), 1, 1)
    assert int(launch.args[-1]) == words
    assert _pointers(launch) == [
        args[k].data_ptr() for k in ("key", "value", "key_cache", "value_cache", "slot_mapping")
    ]


def test_cache_write_of_no_tokens_launches_nothing(launches):
    cuda.reshape_and_cache(**cache_inputs(tokens=0))
    assert launches == []


# ----------------------------------------------------------------------------- fake CuPy


def test_each_source_compiles_once_per_device(monkeypatch):
    monkeypatch.setattr(cuda, "_kernels", {})
    fake = FakeCupy()
    cuda._kernel(fake, "reshape_and_cache.cu", "reshape_and_cache_w16", 0)
    cuda._kernel(fake, "reshape_and_cache.cu", "reshape_and_cache_w2", 0)
    cuda._kernel(fake, "reshape_and_cache.cu", "reshape_and_cache_w16", 0)
    assert len(fake.compiles) == 1
    cuda._kernel(fake, "reshape_and_cache.cu", "reshape_and_cache_w16", 1)
    cuda._kernel(fake, "paged_attention_decode.cu", "paged_attention_decode_f16_d64_b16", 1)
    assert [device for _, _, device in fake.compiles] == [0, 1, 1]
    code, options, _ = fake.compiles[0]
    assert code == cuda.kernel_source("reshape_and_cache.cu")
    assert "--std=c++17" in options


def test_kernel_source_pastes_local_headers_in():
    # CuPy's disk cache keys on the source text: an #include "..." would hide header edits.
    for file in cuda.kernel_names():
        source = cuda.kernel_source(file)
        assert '#include "' not in source and "#pragma once" not in source
        assert "namespace hr" in source and "#include <cuda_fp16.h>" in source


def test_launch_runs_on_torchs_current_stream(monkeypatch):
    monkeypatch.setattr(cuda, "_kernels", {})
    fake = FakeCupy()
    monkeypatch.setattr(cuda, "_import_cupy", lambda: fake)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda index: types.SimpleNamespace(cuda_stream=777)
    )
    args = (np.uint64(1), np.int32(2))
    cuda._launch(
        torch.device("cuda", 1),
        "reshape_and_cache.cu",
        "reshape_and_cache_w4",
        (3, 1, 1),
        (32, 1, 1),
        args,
    )
    assert fake.streams == [(777, 1)]
    assert fake.calls == [("reshape_and_cache_w4", (3, 1, 1), (32, 1, 1), args, 1)]
