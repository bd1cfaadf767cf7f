"""Whole models whose matrices are K-quants and Q5_x (a Q4_K_M file's mix) or IQ4_NL / IQ4_XS,
loaded in their blocks: the loader keeps them (an unsupported type loads dense, named in one
warning), the fused q|k|v of mixed formats stays quantized, the fused decoder call gives the
per-op path's bits, and the result is the dense model's; int8 mode reads each of them
(Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) in its own tiled layout.

The files are tiny llamas written here with random blocks (gguf-py cannot quantize to
K-quants); transformers loads the same files for the greedy parity checks.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from compute.core.config import ModelConfig
from compute.loaders import load_model
from compute.models.decoder import DecoderModel
from kernels.cpu.library import available
from kernels.cpu.quant import QuantizedWeight
from tests.engine import test_loaders
from tests.kernels.test_cpu_decoder import _caches, _step
from tests.kernels.test_cpu_kquants import random_blocks

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels do not build here")

Q = gguf.GGMLQuantizationType
CONFIG = ModelConfig(
    name="kquant", architecture="llama", vocab_size=260, hidden_size=256, intermediate_size=512,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-5,
    tie_word_embeddings=True, qkv_bias=False, eos_token_ids=(2,),
)  # fmt: skip
# Matrix shape -> type: q and o Q4_K, k and v Q6_K (q|k|v mixes formats, as attn_v does in
# a Q4_K_M file), gate and up Q5_K, down Q5_0 (or Q2_K: a type without a CPU kernel).
SUPPORTED = {(256, 256): Q.Q4_K, (128, 256): Q.Q6_K, (512, 256): Q.Q5_K, (256, 512): Q.Q5_0}
WITH_Q2_K = {**SUPPORTED, (256, 512): Q.Q2_K}


def _blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    if qtype == Q.Q2_K:  # 84 bytes: 16 scales, 64 code bytes, d, dmin
        g = np.random.default_rng(seed)
        raw = g.integers(0, 256, (rows, cols // 256, 84), dtype=np.uint8)
        halves = (g.random((rows, cols // 256, 2)) * 0.002 - 0.001).astype(np.float16)
        raw[:, :, 80:84] = halves.view(np.uint8).reshape(rows, -1, 4)
        return raw.reshape(rows, -1)
    return random_blocks(qtype.name.lower(), rows, cols, seed=seed).numpy()


def _write(path: Path, types: dict, monkeypatch) -> Path:
    """test_loaders' tiny-llama writer, with the matrices of `types`' shapes in random blocks."""
    seeds = iter(range(1000))
    plain = test_loaders._quantized

    def quantized(array: np.ndarray):
        qtype = types.get(array.shape)
        if array.ndim == 1 or qtype is None:
            return plain(array)
        return _blocks(qtype, array.shape[0], array.shape[1], next(seeds)), qtype

    with monkeypatch.context() as m:
        m.setattr(test_loaders, "_quantized", quantized)
        test_loaders._write_gguf(path, CONFIG, _dummy(), "llama")
    return path


def _dummy() -> dict[str, torch.Tensor]:
    from compute.loaders.dummy import dummy_weights

    return dummy_weights(CONFIG, torch.float32, "cpu", seed=0)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory) -> Path:
    mp = pytest.MonkeyPatch()
    try:
        return _write(tmp_path_factory.mktemp("kq") / "kquant.gguf", SUPPORTED, mp)
    finally:
        mp.undo()


def _warnings(monkeypatch) -> list:
    from compute.loaders import gguf as gguf_loader

    records: list = []
    monkeypatch.setattr(gguf_loader.log, "warning", lambda *a, **kw: records.append((a, kw)))
    return records


def test_the_loader_keeps_every_supported_type_in_blocks(kquant_file, monkeypatch):
    warnings = _warnings(monkeypatch)
    kept = load_model(str(kquant_file), progress=False, quantized=True)
    assert warnings == []
    dense = load_model(str(kquant_file), progress=False)
    formats = {}
    for name, weight in kept.weights.items():
        if len(weight.shape) == 2 and name != "model.embed_tokens.weight":
            assert isinstance(weight, QuantizedWeight), name
            formats[name.split(".")[-2]] = weight.format.name
            # Blocks, un-permuted like the dense rows: the same weights, bit for bit.
            assert torch.equal(weight.dequantize(), dense.weights[name]), name
    assert formats == {
        "q_proj": "q4_k", "k_proj": "q6_k", "v_proj": "q6_k", "o_proj": "q4_k",
        "gate_proj": "q5_k", "up_proj": "q5_k", "down_proj": "q5_0",
    }  # fmt: skip


def test_an_unsupported_type_loads_dense_named_in_one_warning(tmp_path, monkeypatch):
    path = _write(tmp_path / "q2k.gguf", WITH_Q2_K, monkeypatch)
    records = _warnings(monkeypatch)
    loaded = load_model(str(path), progress=False, quantized=True)
    assert len(records) == 1
    (message,), fields = records[0]
    assert "no CPU kernel" in message
    assert fields["tensors"] == {"Q2_K": "blk.0.ffn_down.weight, blk.1.ffn_down.weight"}
    down = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, torch.Tensor) and down.dtype == torch.float32
    assert isinstance(loaded.weights["model.layers.0.mlp.up_proj.weight"], QuantizedWeight)


@pytest.mark.parametrize(
    ("query_lens", "context_lens"), [([1], [1]), ([1, 1], [40, 7]), ([23, 1, 40], [23, 60, 40])]
)
def test_the_fused_decoder_call_runs_the_mixed_formats(kquant_file, query_lens, context_lens):
    loaded = load_model(str(kquant_file), progress=False, quantized=True)
    model = DecoderModel(loaded.config, loaded.weights, native=True)
    assert model.fused_layers and model.layers[0].qkv.quantized.format.name == "stacked"
    dense = load_model(str(kquant_file), progress=False)
    reference = DecoderModel(dense.config, dense.weights, native=True)
    meta, positions, blocks = _step(query_lens, context_lens)
    tokens = int(sum(query_lens))
    token_ids = torch.randint(0, CONFIG.vocab_size, (tokens,), generator=torch.Generator())
    results = []
    for m, fused in ((model, False), (model, True), (reference, False)):
        m.fused_layers = fused
        caches = _caches(m, blocks, seed=3)
        results.append((m.forward(token_ids, positions, caches, meta), caches))
    (per_op, per_op_caches), (fused_out, fused_caches), (ref, _) = results
    assert torch.equal(fused_out, per_op)
    for (k0, v0), (k1, v1) in zip(per_op_caches, fused_caches, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    torch.testing.assert_close(fused_out, ref, rtol=1e-4, atol=1e-4)


def test_int8_mode_converts_them_to_its_formats(kquant_file):
    """kernels/cpu/quant.py for_int8: the int8 kernel's formats, every projection quantized, so
    the fused decoder call runs; its bits are the per-op path's."""
    loaded = load_model(str(kquant_file), progress=False, quantized=True)
    down = loaded.weights["model.layers.0.mlp.down_proj.weight"]
    o_proj = loaded.weights["model.layers.0.self_attn.o_proj.weight"]
    model = DecoderModel(loaded.config, loaded.weights, native=True, int8=True)
    assert model.fused_layers
    layer = model.layers[0]
    formats = [p.quantized.format.name for p in (layer.qkv, layer.o_proj, layer.gate_up)]
    # q|k|v: Q4_K beside Q6_K, a stack of the two tiled; o Q4_K kept (the int8 kernel's
    # tiled Q4_K: the file's 144 bytes per 256 weights); gate|up Q5_K kept (176 bytes per
    # 256); down Q5_0 kept (the int8 kernel's tiled Q5_0: the file's 22 bytes per 32)
    assert formats == ["stacked", "q4_k", "q5_k"] and layer.down.quantized.format.name == "q5_0"
    assert [p.format.name for p in layer.qkv.quantized.parts] == ["q4_k", "q6_k", "q6_k"]
    assert layer.o_proj.quantized.tiled_layout
    assert layer.o_proj.quantized.nbytes == -(-o_proj.rows // 16) * 16 * o_proj.cols // 256 * 144
    assert torch.equal(layer.o_proj.quantized.dequantize(), o_proj.dequantize())
    gate_up = layer.gate_up.quantized
    assert gate_up.tiled_layout and gate_up.nbytes == gate_up.rows * gate_up.cols // 256 * 176
    assert layer.down.quantized.tiled_layout and layer.down.quantized.nbytes == down.nbytes
    assert torch.equal(layer.down.quantized.dequantize(), down.dequantize())
    meta, positions, blocks = _step([5, 1], [5, 30])
    token_ids = torch.tensor([1, 2, 3, 4, 5, 6])
    outs = []
    for fused in (False, True):
        model.fused_layers = fused
        outs.append(model.forward(token_ids, positions, _caches(model, blocks, seed=1), meta))
    assert torch.equal(outs[0], outs[1])


def test_int8_mode_keeps_q5_0_and_q5_1_exact(tmp_path, monkeypatch):
    """The q5_x mix: q Q5_1 over k, v Q5_0 (one fused q|k|v) and down Q5_0. q|k|v is a
    stack of q in Q5_1 and k|v in Q5_0, both tiled: every row is the file's weights (the
    file's 24 and 22 bytes per 32); down stays Q5_0. The fused call gives the per-op bits."""
    path = _write(tmp_path / "q5x.gguf", MIXES["q5_x"], monkeypatch)
    loaded = load_model(str(path), progress=False, quantized=True)
    exact = {name: w.dequantize() for name, w in loaded.weights.items() if "_proj" in name}
    model = DecoderModel(loaded.config, loaded.weights, native=True, int8=True)
    assert model.fused_layers
    q_rows = loaded.config.num_heads * loaded.config.head_dim
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        qkv = layer.qkv.quantized
        assert qkv.format.name == "stacked" and layer.down.quantized.format.name == "q5_0"
        assert [p.format.name for p in qkv.parts] == ["q5_1", "q5_0", "q5_0"]
        q, k, v = (exact[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv")
        assert torch.equal(qkv.dequantize(), torch.cat([q, k, v]))
        assert qkv.parts[0].nbytes == -(-q_rows // 16) * 16 * q.shape[1] // 32 * 24
        down = exact[prefix + "mlp.down_proj.weight"]
        assert torch.equal(layer.down.quantized.dequantize(), down)
    meta, positions, blocks = _step([5, 1], [5, 30])
    token_ids = torch.tensor([1, 2, 3, 4, 5, 6])
    outs = []
    for fused in (False, True):
        model.fused_layers = fused
        outs.append(model.forward(token_ids, positions, _caches(model, blocks, seed=1), meta))
    assert torch.equal(outs[0], outs[1])


def test_int8_mode_keeps_q6_k_in_its_blocks(tmp_path, monkeypatch):
    """The q6_k mix (every matrix Q6_K): the int8 kernel reads Q6_K in its tiled layout,
    fused q|k|v and gate|up included (the file's 210 bytes per 256 weights, the same
    weights); the fused call gives the per-op bits."""
    path = _write(tmp_path / "q6k.gguf", MIXES["q6_k"], monkeypatch)
    loaded = load_model(str(path), progress=False, quantized=True)
    exact = {name: w.dequantize() for name, w in loaded.weights.items() if "_proj" in name}
    model = DecoderModel(loaded.config, loaded.weights, native=True, int8=True)
    assert model.fused_layers
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        for proj, names in ((layer.qkv, ["self_attn.q_proj", "self_attn.k_proj",
                             "self_attn.v_proj"]), (layer.down, ["mlp.down_proj"])):  # fmt: skip
            w = proj.quantized
            assert w.format.name == "q6_k" and w.tiled_layout
            expected = torch.cat([exact[prefix + n + ".weight"] for n in names])
            assert torch.equal(w.dequantize(), expected)
            assert w.nbytes == -(-w.rows // 16) * 16 * w.cols // 256 * 210
    meta, positions, blocks = _step([5, 1], [5, 30])
    token_ids = torch.tensor([1, 2, 3, 4, 5, 6])
    outs = []
    for fused in (False, True):
        model.fused_layers = fused
        outs.append(model.forward(token_ids, positions, _caches(model, blocks, seed=1), meta))
    assert torch.equal(outs[0], outs[1])


def test_int8_mode_keeps_iq4_in_its_blocks(tmp_path, monkeypatch):
    """The iq4 mix with an IQ4_XS token embedding (tied: the lm_head too): q IQ4_XS over
    IQ4_NL k and v (a stack of the two tiled), gate|up IQ4_XS, down IQ4_NL, none
    requantized to Q8_0: the int8 kernel reads each in its tiled layout (the file's 18
    bytes per 32 weights, 136 per 256), every row the file's weights, the embedding lookup
    the file's rows; the fused call gives the per-op bits."""
    path = _write(tmp_path / "iq4.gguf", {**MIXES["iq4"], (260, 256): Q.IQ4_XS}, monkeypatch)
    loaded = load_model(str(path), progress=False, quantized=True)
    exact = {name: w.dequantize() for name, w in loaded.weights.items() if len(w.shape) == 2}
    model = DecoderModel(loaded.config, loaded.weights, native=True, int8=True)
    assert model.fused_layers
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        qkv = layer.qkv.quantized
        assert qkv.format.name == "stacked" and qkv.tiled_layout
        assert [p.format.name for p in qkv.parts] == ["iq4_xs", "iq4_nl", "iq4_nl"]
        q, k, v = (exact[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv")
        assert torch.equal(qkv.dequantize(), torch.cat([q, k, v]))
        gate_up, down = layer.gate_up.quantized, layer.down.quantized
        assert gate_up.format.name == "iq4_xs" and down.format.name == "iq4_nl"
        assert gate_up.tiled_layout and down.tiled_layout
        assert gate_up.nbytes == gate_up.rows * gate_up.cols // 256 * 136
        assert down.nbytes == down.rows * down.cols // 32 * 18
        assert torch.equal(down.dequantize(), exact[prefix + "mlp.down_proj.weight"])
    embed = exact["model.embed_tokens.weight"]
    assert model.embed_tokens is model.lm_head.quantized
    assert model.embed_tokens.format.name == "iq4_xs" and model.embed_tokens.tiled_layout
    token_ids = torch.tensor([1, 2, 3, 4, 5, 259])
    assert torch.equal(model._embed(token_ids), embed[token_ids])
    meta, positions, blocks = _step([5, 1], [5, 30])
    outs = []
    for fused in (False, True):
        model.fused_layers = fused
        outs.append(model.forward(token_ids, positions, _caches(model, blocks, seed=1), meta))
    assert torch.equal(outs[0], outs[1])


# Tiny files of each K-quant mix, against transformers loading the same file (it
# dequantizes with gguf-py, the kernels' oracle): greedy tokens must be identical.
MIXES = {
    "q4_k_m": SUPPORTED,
    "q5_k_m": {(256, 256): Q.Q5_K, (128, 256): Q.Q6_K, (512, 256): Q.Q5_K, (256, 512): Q.Q6_K},
    "q6_k": {(256, 256): Q.Q6_K, (128, 256): Q.Q6_K, (512, 256): Q.Q6_K, (256, 512): Q.Q6_K},
    "q5_x": {(256, 256): Q.Q5_1, (128, 256): Q.Q5_0, (512, 256): Q.Q5_1, (256, 512): Q.Q5_0},
    "iq4": {(256, 256): Q.IQ4_XS, (128, 256): Q.IQ4_NL, (512, 256): Q.IQ4_XS, (256, 512): Q.IQ4_NL},
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_greedy_parity_with_transformers_on_the_same_file(mix, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
    from compute.core.sampling_params import SamplingParams
    from compute.engine import Engine

    path = _write(tmp_path / f"{mix}.gguf", MIXES[mix], monkeypatch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    engine = Engine(
        EngineConfig(
            model=str(path),
            cache=CacheConfig(num_blocks=64),
            device=DeviceConfig(device="cpu", cpu_kernels="native", weights="quantized"),
        )
    )
    assert engine.weights == "quantized" and engine.runner.model.fused_layers
    prompts = [[5, 77, 140, 9], [200, 3, 3, 18, 250, 61, 7], [42]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for ids in prompts:
        ours = engine.generate([ids], params)[0].token_ids
        ref = _hf_greedy(hf, ids, 12)
        assert ours == ref, (mix, ids)


def _hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    """A bare argmax loop over HF's KV cache (generate()'s min_new_tokens would mask EOS,
    which ignore_eos does not): the reference tests/engine/test_parity.py uses too."""
    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens
