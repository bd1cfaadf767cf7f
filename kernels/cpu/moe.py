"""Launchers of the mixture-of-experts kernels (kernels/csrc/cpu/moe.cpp): the router, the
chosen experts, or both in one call; and the experts' table those calls read."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kernels.cpu.library import check_tensor, library


def moe_shape(layer) -> tuple[int, int, int] | None:
    """(experts, top_k, expert intermediate size) of a layer's MoE MLP; None: dense."""
    moe = layer.moe
    return None if moe is None else (len(moe.experts), moe.top_k, moe.inter)


def moe_table(experts: list) -> Tensor | None:
    """The int64 [E, 4] table hr_moe_experts reads (each expert's gate|up and down: block
    pointer, format), or None when some projection is not a single block format (dense,
    or a stack of formats): those run per op (compute/models/moe.py); None for no experts.

    ``experts``: compute.models.moe.Expert objects, their projections in their kernel's layout."""
    if not experts:
        return None
    rows = []
    for expert in experts:
        row = []
        for projection in (expert.gate_up, expert.down):
            weight = projection.quantized
            if weight is None or weight.parts or weight.tiled_layout != projection.int8:
                return None
            row += [weight.data.data_ptr(), weight.format.code]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def moe_scratch(tokens: int, h: int, shape: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """The float and int64 scratch of the MoE kernels for ``tokens`` rows of hidden size
    ``h`` and moe_shape ``shape`` (kernels/csrc/cpu/moe.cpp hr_moe_scratch_size)."""
    experts, top_k, inter = shape
    sizes = (ctypes.c_int64 * 2)()
    library().hr_moe_scratch_size(tokens, h, inter, top_k, experts, sizes)
    return torch.empty(sizes[0], dtype=torch.float32), torch.empty(sizes[1], dtype=torch.int64)


def moe_route(
    router: Tensor, x: Tensor, top_k: int, normalize: bool, check: bool = True
) -> tuple[Tensor, Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) of each row of x [T, H]: softmax of
    the router logits x . router[e] ([E, H]), the top k (ties to the lower id), renormalised
    to sum to 1 when ``normalize`` (kernels/csrc/cpu/moe.cpp)."""
    tokens, h = x.shape
    experts = router.shape[0]
    if check:
        check_tensor("x", x, torch.float32, (tokens, h))
        check_tensor("router", router, torch.float32, (experts, h))
        if not 0 < top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    probs = torch.empty(tokens, experts, dtype=torch.float32)
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    library().hr_moe_route(
        router.data_ptr(), experts, x.data_ptr(), tokens, h, top_k, int(normalize),
        probs.data_ptr(), ids.data_ptr(), weights.data_ptr(),
    )  # fmt: skip
    return weights, ids


def moe(
    router: Tensor, table: Tensor, int8: bool, x: Tensor, top_k: int, normalize: bool,
    inter: int, runs: Tensor, check: bool = True,
) -> Tensor:  # fmt: skip
    """A mixture-of-experts MLP in one call: moe_route, then moe_experts (the same bits as
    the two launchers); runs [1] int64 += the number of experts run."""
    tokens, h = x.shape
    experts = table.shape[0]
    if check:
        check_tensor("x", x, torch.float32, (tokens, h))
        check_tensor("router", router, torch.float32, (experts, h))
        check_tensor("table", table, torch.int64, (experts, 4))
        check_tensor("runs", runs, torch.int64, (1,))
        if not 0 < top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    out = torch.empty(tokens, h, dtype=torch.float32)
    if tokens:
        scratch, int_scratch = moe_scratch(tokens, h, (experts, top_k, inter))
        library().hr_moe(
            router.data_ptr(), experts, top_k, int(normalize), table.data_ptr(), int(int8),
            x.data_ptr(), tokens, h, inter, out.data_ptr(), scratch.data_ptr(),
            int_scratch.data_ptr(), runs.data_ptr(),
        )  # fmt: skip
    return out


def moe_experts(
    table: Tensor, int8: bool, x: Tensor, ids: Tensor, weights: Tensor, inter: int,
    check: bool = True, runs: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x [T, H] -> [T, H]: each token's experts ``ids`` [T, k] (int64) run on it, their
    outputs times ``weights`` [T, k] summed in ascending expert order
    (kernels/csrc/cpu/moe.cpp); each expert some token chose is read once. ``runs`` [1]
    int64, if given, += the number of experts run."""
    tokens, h = x.shape
    top_k = ids.shape[1]
    if check:
        check_tensor("x", x, torch.float32, (tokens, h))
        check_tensor("ids", ids, torch.int64, (tokens, top_k))
        check_tensor("weights", weights, torch.float32, (tokens, top_k))
        check_tensor("table", table, torch.int64, (None, 4))
        if runs is not None:
            check_tensor("runs", runs, torch.int64, (1,))
        if tokens and not 0 <= int(ids.min()) <= int(ids.max()) < table.shape[0]:
            raise ValueError(f"ids must be in [0, {table.shape[0]})")
    out = torch.zeros(tokens, h, dtype=torch.float32)
    if tokens:
        scratch, int_scratch = moe_scratch(tokens, h, (table.shape[0], top_k, inter))
        library().hr_moe_experts(
            table.data_ptr(), table.shape[0], int(int8), x.data_ptr(), tokens, h, inter, top_k,
            ids.data_ptr(), weights.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            int_scratch.data_ptr(), None if runs is None else runs.data_ptr(),
        )  # fmt: skip
    return out
