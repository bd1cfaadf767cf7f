"""hr_decoder_layers with mixture-of-experts layers (router and experts inside the one
call) against the per-op CPU path.

The models: the embedded model's attention (first layers) with random quantized experts
and routers in place of its MLPs, shaped like Qwen3-MoE (renormalised top-4 of 16, per-head
q/k norms, one dense layer; and its unnormalised default) and Mixtral (top-2 of 8). For
decodes, prefill chunks beside decodes and a long prefill, in the exact and the int8
numerics, the fused call's hidden states and K/V are the per-op path's bits, the experts
it counts are the per-op path's, and each sequence's rows are the same bits alone as in
the batch. With routers whose rows repeat (forced ties), the per-op path's own router and
expert loop agree with the fused call, and ties sent to the higher expert id do not.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from compute.loaders import load_model
from compute.models.decoder import DecoderModel
from compute.models.moe import MoE
from kernels.cpu import decoder as cpu_decoder
from kernels.cpu.library import available
from kernels.cpu.quant import QuantizedWeight
from kernels.metadata import AttentionMetadata
from tests.kernels.test_cpu_decoder import BLOCK, _caches

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")

LAYERS, INTER = 3, 128
# family -> (experts, top_k, norm_topk_prob, dense layers, per-head q/k norms)
FAMILIES = {
    "qwen3-moe": (16, 4, True, (1,), True),
    "qwen3-moe-unnormalised": (10, 3, False, (), False),
    "mixtral": (8, 2, True, (), False),
}
STEPS = [
    ([1], [1]),  # the first token of a sequence
    ([1, 1, 1], [40, 7, 130]),  # decodes: the experts side by side
    ([23, 1, 5, 1], [23, 60, 37, 17]),  # prefill chunks beside decodes
    # one long prefill: more token-expert pairs than moe.cpp runs side by side (1,024, here
    # 520 x 2 at the least), so the experts run one after another
    ([520], [520]),
]


@pytest.fixture(scope="module")
def embedded():
    return load_model("default", dtype=torch.float32, device=torch.device("cpu"), quantized=True)


def _quantized(rows: int, cols: int, fmt: str, g: torch.Generator) -> QuantizedWeight:
    w = torch.randn(rows, cols, generator=g) * 0.05
    blocks = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, fmt.upper()))
    return QuantizedWeight.from_gguf(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), cols)


def moe_model(embedded, family: str, int8: bool, ties: bool = False) -> DecoderModel:
    """The embedded model's first LAYERS layers with `family`'s experts. ``ties``: every
    router row repeated three times (experts 0-2 score alike, then 3-5, ...)."""
    experts, top_k, normalize, dense, qk_norm = FAMILIES[family]
    config = dataclasses.replace(
        embedded.config, num_layers=LAYERS, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=INTER, norm_topk_prob=normalize, dense_layers=dense,
        qk_norm=qk_norm,
    )  # fmt: skip
    weights = {k: v for k, v in embedded.weights.items() if "layers." not in k}
    h, g = config.hidden_size, torch.Generator().manual_seed(27)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights.update({k: v for k, v in embedded.weights.items() if k.startswith(p)})
        if qk_norm:
            for name in ("q_norm", "k_norm"):
                weights[f"{p}self_attn.{name}.weight"] = torch.rand(config.head_dim) + 0.5
        if not config.is_moe_layer(i):
            continue
        for name in ("gate", "up", "down"):
            del weights[f"{p}mlp.{name}_proj.weight"]
        router = torch.randn(experts, h, generator=g) * 0.05
        if ties:
            router = router[torch.arange(experts) // 3 * 3].contiguous()
        weights[f"{p}mlp.gate.weight"] = router
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            weights[q + "gate_proj.weight"] = _quantized(INTER, h, "q4_0", g)
            weights[q + "up_proj.weight"] = _quantized(INTER, h, "q4_0", g)
            weights[q + "down_proj.weight"] = _quantized(h, INTER, "q8_0", g)
    model = DecoderModel(config, weights, native=True, int8=int8)
    assert model.fused_layers  # every projection quantized, every MoE layer's experts too
    return model


def _batch(query_lens: list[int], context_lens: list[int]):
    """Each sequence's block table (scattered order), positions, blocks used."""
    tables, next_block = [], 0
    for ctx in context_lens:
        n = -(-ctx // BLOCK)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))
        next_block += n
    positions = [list(range(c - q, c)) for q, c in zip(query_lens, context_lens, strict=True)]
    return tables, positions, next_block


def _forward(model: DecoderModel, fused: bool, token_ids, query_lens, context_lens, tables,
             positions, blocks: int):  # fmt: skip
    """(hidden states, caches, experts run) of one forward on fresh random caches."""
    model.fused_layers = fused
    caches = _caches(model, blocks, seed=7)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK)
    runs = _expert_runs(model)
    pos = torch.tensor([p for seq in positions for p in seq], dtype=torch.int64)
    out = model.forward(token_ids, pos, caches, meta)
    model.fused_layers = True
    return out, caches, _expert_runs(model) - runs


def _expert_runs(model: DecoderModel) -> int:
    return sum(layer.moe.expert_runs for layer in model.layers if layer.moe is not None)


@pytest.fixture(scope="module", params=[(f, m) for f in FAMILIES for m in ("exact", "int8")],
                ids=lambda p: f"{p[0]}-{p[1]}")  # fmt: skip
def model(request, embedded) -> DecoderModel:
    family, mode = request.param
    return moe_model(embedded, family, mode == "int8")


@pytest.mark.parametrize(("query_lens", "context_lens"), STEPS)
def test_fused_moe_layers_are_bit_identical_to_the_per_op_path(
    model, query_lens, context_lens, monkeypatch
):
    calls, fused_call = [], cpu_decoder.decoder_layers
    monkeypatch.setattr(
        cpu_decoder, "decoder_layers", lambda *a, **k: calls.append(1) or fused_call(*a, **k)
    )
    tables, positions, blocks = _batch(query_lens, context_lens)
    g = torch.Generator().manual_seed(sum(query_lens))
    token_ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=g)
    args = (token_ids, query_lens, context_lens, tables, positions, blocks)
    ref, ref_caches, ref_runs = _forward(model, False, *args)
    out, caches, runs = _forward(model, True, *args)
    assert calls == [1]  # the second forward took the fused path, the first did not
    assert torch.equal(out, ref)
    for (k0, v0), (k1, v1) in zip(ref_caches, caches, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    moe_layers = sum(layer.moe is not None for layer in model.layers)
    assert runs == ref_runs >= moe_layers  # at least one expert per MoE layer


def test_fused_moe_layers_give_each_sequence_its_bits_alone(model) -> None:
    query_lens, context_lens = [23, 1, 5, 1], [23, 60, 37, 17]
    tables, positions, blocks = _batch(query_lens, context_lens)
    token_ids = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator())
    batched, _, _ = _forward(model, True, token_ids, query_lens, context_lens, tables,
                             positions, blocks)  # fmt: skip
    start = 0
    for i, q in enumerate(query_lens):
        alone, _, _ = _forward(model, True, token_ids[start : start + q], [q],
                               [context_lens[i]], [tables[i]], [positions[i]], blocks)  # fmt: skip
        assert torch.equal(alone, batched[start : start + q])
        start += q


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_forced_ties_go_to_the_lower_expert_id(embedded, family: str, monkeypatch) -> None:
    """Routers whose rows repeat: the per-op path's own router and expert loop (no experts'
    table) gives the fused call's bits; the same loop with ties sent to the higher id, which
    chooses other experts for some tokens, does not."""
    model = moe_model(embedded, family, int8=False, ties=True)
    query_lens, context_lens = [23, 1, 1], [60, 70, 9]
    tables, positions, blocks = _batch(query_lens, context_lens)
    token_ids = torch.randint(0, model.config.vocab_size, (25,), generator=torch.Generator())
    args = (token_ids, query_lens, context_lens, tables, positions, blocks)
    fused, _, _ = _forward(model, True, *args)
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.table = None  # the per-op loop over experts (compute/models/moe.py)
    loop, _, _ = _forward(model, False, *args)
    assert torch.equal(loop, fused)

    route, changed = MoE.route, []

    def ties_to_the_higher_id(self, x, check=True):
        weights, ids = route(self, x, check)
        experts = self.router.shape[0]
        flipped = route(_flipped(self), x, check)[1]
        higher = experts - 1 - flipped  # the same probabilities, ties the other way
        changed.append(bool((higher.sort(-1).values != ids.sort(-1).values).any()))
        return weights, higher

    monkeypatch.setattr(MoE, "route", ties_to_the_higher_id)
    mutated, _, _ = _forward(model, False, *args)
    assert any(changed)  # the ties reach the top-k boundary
    assert not torch.equal(mutated, fused)


def _flipped(moe: MoE) -> MoE:
    """A shallow copy of ``moe`` whose router lists the experts in reverse order."""
    copy = MoE.__new__(MoE)
    copy.__dict__.update(moe.__dict__, router=moe.router.flip(0).contiguous())
    return copy


def test_the_table_rejects_experts_without_a_table(embedded) -> None:
    model = moe_model(embedded, "mixtral", int8=False)
    model.layers[2].moe.table = None
    with pytest.raises(ValueError, match="every expert must be quantized"):
        cpu_decoder.decoder_table(model.layers, model.norm, _caches(model, 1, seed=0))
