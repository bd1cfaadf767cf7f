"""hr_decoder_layers (every layer in one call) against the per-op CPU path it replaces.

It chains the same kernels with the same arguments, so on the embedded model, for a mixed
batch of prefill chunks and decodes, its hidden states and the K/V it writes must be
bit-identical to the per-op launchers', for the exact and the int8 numerics alike, and for
every KV cache dtype.
"""

from __future__ import annotations

import pytest
import torch

from compute.loaders import load_model
from compute.models.decoder import DecoderModel
from kernels import reference
from kernels.cpu import decoder as cpu_decoder
from kernels.cpu.library import available
from kernels.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")

BLOCK = 16


@pytest.fixture(scope="module", params=["quantized", "quantized-int8"])
def model(request) -> DecoderModel:
    loaded = load_model("default", dtype=torch.float32, device=torch.device("cpu"), quantized=True)
    model = DecoderModel(
        loaded.config, loaded.weights, native=True, int8=request.param.endswith("8")
    )
    assert model.fused_layers  # every projection of the default model is quantized
    return model


def _caches(
    model: DecoderModel, num_blocks: int, seed: int, kv_dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, ...]]:
    """Random caches: the keys before each sequence's new tokens must hold something."""
    cfg, g = model.config, torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [
        (
            reference.to_cache(torch.randn(shape, generator=g), kv_dtype),
            reference.to_cache(torch.randn(shape, generator=g), kv_dtype),
        )
        for _ in range(cfg.num_layers)
    ]


def _step(query_lens: list[int], context_lens: list[int]):
    tables, next_block = [], 0
    for ctx in context_lens:
        n = -(-ctx // BLOCK)
        tables.append(list(range(next_block + n - 1, next_block - 1, -1)))  # scattered order
        next_block += n
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BLOCK)
    positions = torch.tensor(
        [p for q, c in zip(query_lens, context_lens, strict=True) for p in range(c - q, c)],
        dtype=torch.int64,
    )
    return meta, positions, next_block


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([1], [1]),  # the first token of a sequence
        ([1, 1, 1], [40, 7, 130]),  # decodes
        ([23, 1, 5, 1], [23, 60, 37, 17]),  # prefill chunks beside decodes
        ([200], [200]),  # one long prefill: the buffered GEMM kernels
    ],
)
@pytest.mark.parametrize(
    "kv_dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.int8],
    ids=lambda t: "kv_" + str(t).removeprefix("torch."),
)
def test_fused_layers_are_bit_identical_to_the_per_op_path(
    model, query_lens, context_lens, kv_dtype, monkeypatch
):
    calls = []
    fused_call = cpu_decoder.decoder_layers

    def counted(*args, **kwargs):
        calls.append(1)
        return fused_call(*args, **kwargs)

    monkeypatch.setattr(cpu_decoder, "decoder_layers", counted)
    meta, positions, blocks = _step(query_lens, context_lens)
    tokens = int(sum(query_lens))
    g = torch.Generator().manual_seed(tokens)
    token_ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g)
    results = []
    for fused in (False, True):
        model.fused_layers = fused
        caches = _caches(model, blocks, seed=7, kv_dtype=kv_dtype)
        out = model.forward(token_ids, positions, caches, meta)
        results.append((out, caches))
    model.fused_layers = True
    (ref, ref_caches), (out, caches) = results
    assert calls == [1]  # the second forward took the fused path, the first did not
    assert torch.equal(out, ref)
    for (k0, v0), (k1, v1) in zip(ref_caches, caches, strict=True):
        assert k1.dtype == kv_dtype
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_the_table_rejects_a_dense_projection(model) -> None:
    layer = model.layers[0]
    saved = layer.o_proj.quantized
    layer.o_proj.quantized = None
    try:
        with pytest.raises(ValueError, match="every projection must be quantized"):
            cpu_decoder.decoder_table(model.layers, model.norm, _caches(model, 1, seed=0))
    finally:
        layer.o_proj.quantized = saved


def test_fused_layers_apply_each_layers_sliding_window(model) -> None:
    """The table carries each layer's window (Mistral: every layer; here every other one):
    the fused call masks as the per-op path does, and the window changes the result."""
    meta, positions, blocks = _step([23, 1, 1], [60, 70, 9])
    token_ids = torch.randint(0, model.config.vocab_size, (25,), generator=torch.Generator())
    outs = []
    try:
        for window in (None, 16):
            for i, layer in enumerate(model.layers):
                layer.window = window if i % 2 == 0 else None
            model._table = None  # rebuilt with the windows
            for fused in (False, True):
                model.fused_layers = fused
                outs.append(model.forward(token_ids, positions, _caches(model, blocks, 7), meta))
    finally:
        for layer in model.layers:
            layer.window = None
        model._table, model.fused_layers = None, True
    full_per_op, full_fused, window_per_op, window_fused = outs
    assert torch.equal(full_per_op, full_fused) and torch.equal(window_per_op, window_fused)
    assert not torch.allclose(full_fused, window_fused)


def test_fused_layers_apply_per_head_q_and_k_norms(model) -> None:
    """Qwen3's RMSNorm of each q and k head before RoPE, in the table: the fused call gives
    the per-op path's bits, and the norms change the result."""
    meta, positions, blocks = _step([23, 1, 1], [60, 70, 9])
    token_ids = torch.randint(0, model.config.vocab_size, (25,), generator=torch.Generator())
    dim = model.config.head_dim
    g = torch.Generator().manual_seed(3)
    outs = []
    try:
        for norms in (False, True):
            for layer in model.layers:
                layer.q_norm = torch.rand(dim, generator=g) + 0.5 if norms else None
                layer.k_norm = torch.rand(dim, generator=g) + 0.5 if norms else None
            model._table = None  # rebuilt with the norms
            for fused in (False, True):
                model.fused_layers = fused
                outs.append(model.forward(token_ids, positions, _caches(model, blocks, 7), meta))
    finally:
        for layer in model.layers:
            layer.q_norm = layer.k_norm = None
        model._table, model.fused_layers = None, True
    plain_per_op, plain_fused, normed_per_op, normed_fused = outs
    assert torch.equal(plain_per_op, plain_fused) and torch.equal(normed_per_op, normed_fused)
    assert not torch.allclose(plain_fused, normed_fused)


def test_fused_layers_apply_gemmas_deltas(model) -> None:
    """Gemma 2/3's deltas in the table: norms of the attention and MLP outputs, tanh-GELU,
    the attention soft-cap and the sliding layers' own RoPE tables. The fused call gives the
    per-op path's bits, and the deltas change the result."""
    import dataclasses

    from compute.models import rope
    from compute.models.decoder import RotaryEmbedding

    meta, positions, blocks = _step([23, 1, 1], [60, 70, 9])
    token_ids = torch.randint(0, model.config.vocab_size, (25,), generator=torch.Generator())
    config, h = model.config, model.config.hidden_size
    g = torch.Generator().manual_seed(4)
    outs = []
    try:
        for gemma in (False, True):
            if gemma:
                model.config = dataclasses.replace(
                    config, hidden_act="gelu_tanh", attn_logit_softcap=5.0
                )
                model.local_rope = RotaryEmbedding(
                    rope.default_inv_freq(config.head_dim, 10_000.0),
                    config.max_position_embeddings, model.device, model.dtype,
                )  # fmt: skip
            for i, layer in enumerate(model.layers):
                layer.attn_out_norm = torch.rand(h, generator=g) + 0.5 if gemma else None
                layer.mlp_out_norm = torch.rand(h, generator=g) + 0.5 if gemma else None
                layer.local_rope = gemma and i % 2 == 0
                layer.window = 16 if gemma and i % 2 == 0 else None
            model._table = None  # rebuilt with the deltas
            for fused in (False, True):
                model.fused_layers = fused
                outs.append(model.forward(token_ids, positions, _caches(model, blocks, 7), meta))
    finally:
        model.config, model.local_rope = config, None
        for layer in model.layers:
            layer.attn_out_norm = layer.mlp_out_norm = layer.window = None
            layer.local_rope = False
        model._table, model.fused_layers = None, True
    plain_per_op, plain_fused, gemma_per_op, gemma_fused = outs
    assert torch.equal(plain_per_op, plain_fused) and torch.equal(gemma_per_op, gemma_fused)
    assert not torch.allclose(plain_fused, gemma_fused)
