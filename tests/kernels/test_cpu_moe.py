"""The mixture-of-experts kernel (kernels/csrc/cpu/moe.cpp): every expert of a step in one
call, bit-identical to compute/models/moe.py's per-op path (the same kernels in the same order),
each token's output the same bits alone as in any batch, in every block format the
quantized linear kernels read, exact and int8."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from compute.models.decoder import Projection, fuse
from compute.models.moe import Expert, MoE
from kernels.cpu.library import available
from kernels.cpu.quant import FORMATS, QuantizedWeight
from tests.kernels.test_cpu_kquants import HALVES, random_blocks

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")

H, INTER, EXPERTS, TOP_K = 256, 256, 8, 3


def _weight(fmt: str, rows: int, cols: int, seed: int) -> QuantizedWeight:
    if fmt in HALVES:  # the formats kept in file order: random valid blocks
        return QuantizedWeight.from_gguf(fmt, random_blocks(fmt, rows, cols, seed=seed), cols)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    blocks = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, fmt.upper()))
    return QuantizedWeight.from_gguf(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), cols)


def _moe(fmt: str, int8: bool, native: bool = True, down_fmt: str | None = None) -> MoE:
    experts = []
    for e in range(EXPERTS):
        gate_up = fuse([_weight(fmt, INTER, H, 10 * e), _weight(fmt, INTER, H, 10 * e + 1)], int8)
        down = _weight(down_fmt or fmt, H, INTER, 10 * e + 2)
        experts.append(Expert(Projection(gate_up, int8=int8), Projection(down, int8=int8)))
    router = torch.randn(EXPERTS, H, generator=torch.Generator().manual_seed(5))
    return MoE(router, experts, TOP_K, normalize=True, native=native)


def _x(tokens: int) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)) * 0.2


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("int8", [False, True])
def test_one_call_equals_the_per_op_path_and_is_batch_invariant(fmt: str, int8: bool) -> None:
    moe = _moe(fmt, int8)
    assert moe.table is not None
    x = _x(37)
    fused = moe(x)
    table, moe.table = moe.table, None  # the per-op path
    assert torch.equal(fused, moe(x))
    moe.table = table
    alone = torch.cat([moe(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(alone, fused)
    assert torch.equal(torch.cat([moe(x[:5]), moe(x[5:])]), fused)
    # More token-expert pairs than kernels/csrc/cpu/moe.cpp runs side by side (1,024: here
    # 350 x 3) run the experts one after another, each on every thread: the same bits.
    many = _x(350)
    assert torch.equal(moe(many)[:37], moe(many[:37].contiguous()))


def test_only_the_chosen_experts_run_once_per_step() -> None:
    moe = _moe("q4_k", False)
    x = _x(6)
    _, ids = moe.route(x)
    before = moe.expert_runs
    moe(x)
    assert moe.expert_runs - before == len(set(ids.flatten().tolist())) <= EXPERTS


def test_matches_a_dense_torch_reference() -> None:
    """The weights dequantized, transformers' formula in torch (fp32, other summation order)."""
    moe = _moe("q8_0", False, down_fmt="q6_k")
    x = _x(9)
    weights, ids = moe.route(x)
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t], strict=True):
            expert = moe.experts[int(e)]
            gate, up = (x[t] @ expert.gate_up.quantized.dequantize().T).chunk(2)
            expected[t] += w * (
                expert.down.quantized.dequantize() @ (torch.nn.functional.silu(gate) * up)
            )
    torch.testing.assert_close(moe(x), expected, rtol=1e-4, atol=1e-5)


def test_mixed_formats_in_one_expert_fall_back_to_per_op() -> None:
    experts = _moe("q4_k", False).experts
    stacked = fuse([_weight("q4_k", INTER, H, 1), _weight("q6_k", INTER, H, 2)])
    experts[0] = Expert(Projection(stacked), experts[0].down)
    moe = MoE(torch.randn(EXPERTS, H), experts, TOP_K, normalize=False, native=True)
    assert moe.table is None
    assert moe(_x(4)).shape == (4, H)


def _reference_route(router, x, top_k, normalize, higher_ties=False):
    """compute/models/moe.py's torch router, with torch.topk (whose order among equal values is
    unspecified) replaced by a stable sort: ties to the lower expert id (or the higher)."""
    moe = MoE(router, [], top_k, normalize, native=False)
    logits = torch.cat([(x[i : i + 16, None, :] * router).sum(-1) for i in range(0, len(x), 16)])
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if higher_ties:
        probs = probs.flip(-1)
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if higher_ties:
        ids = router.shape[0] - 1 - ids
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    assert moe.table is None
    return top, ids


@pytest.mark.parametrize(
    ("experts", "top_k", "normalize", "h"),
    [(64, 8, True, 1024), (8, 2, True, 256), (10, 3, False, 200), (16, 4, True, 40)],
)
def test_the_router_kernel_chooses_the_torch_routers_experts(experts, top_k, normalize, h):
    """The kernel's router (kernels/csrc/cpu/moe.cpp) against the torch one on random inputs:
    the same experts in the same order, weights within float rounding; with forced ties
    (repeated router rows), the lower expert id first, which a rule sending ties to the
    higher id would not give."""
    g = torch.Generator().manual_seed(experts)
    router = torch.randn(experts, h, generator=g) * 0.05
    x = torch.randn(150, h, generator=g)
    native = MoE(router, [], top_k, normalize, native=True)
    weights, ids = native.route(x)
    torch_weights, torch_ids = MoE(router, [], top_k, normalize, native=False).route(x)
    assert torch.equal(ids, torch_ids)
    torch.testing.assert_close(weights, torch_weights, rtol=2e-6, atol=1e-7)

    tied = router[torch.arange(experts) // 3 * 3].contiguous()  # experts 0-2 alike, 3-5, ...
    weights, ids = MoE(tied, [], top_k, normalize, native=True).route(x)
    ref_weights, ref_ids = _reference_route(tied, x, top_k, normalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-6, atol=1e-7)
    higher = _reference_route(tied, x, top_k, normalize, higher_ties=True)[1]
    assert not torch.equal(higher.sort(-1).values, ids.sort(-1).values)
    # Alone or in any batch: the same bits.
    alone = [MoE(tied, [], top_k, normalize, native=True).route(x[i : i + 1]) for i in range(9)]
    assert torch.equal(torch.cat([w for w, _ in alone]), weights[:9])
    assert torch.equal(torch.cat([i for _, i in alone]), ids[:9])
