"""GGUF metadata of the model families: RoPE variants read into the config, Qwen3's q/k norms,
Phi-3's fused projections split, and every setting headrace does not honour refused at load
(tiny files written here; the converter's own files are in test_model_families_gguf.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from compute.loaders import ModelLoadError, load_model
from compute.loaders.dummy import dummy_weights
from compute.models.rope import default_inv_freq, inv_freq
from tests.engine.test_loaders import TINY, _gguf_name, _write_gguf


def _tiny_gguf(path: Path, extra=None, config=TINY, weights=None, arch="llama") -> Path:
    weights = weights if weights is not None else dummy_weights(config, torch.float32, "cpu", 0)
    _write_gguf(path, config, weights, arch, extra)
    return path


def _load(path: Path):
    return load_model(str(path), progress=False)


def test_unsupported_architecture_lists_the_supported(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "falcon.gguf", arch="falcon")
    match = (
        r"unsupported architecture 'falcon' "
        r"\(supported: llama, mistral, qwen2, qwen3, phi3, qwen3moe, gemma2, gemma3\)"
    )
    with pytest.raises(ModelLoadError, match=match):
        _load(path)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
            r"llama\.rope\.scaling\.type: 'yarn' is not supported \(supported: none, linear",
        ),
        (
            lambda w: w.add_rope_dimension_count(8),
            r"llama\.rope\.dimension_count: RoPE on 8 of 16 dims",
        ),
        # Expert metadata without expert tensors (a file with them serves as MoE:
        # tests/engine/test_model_families_moe_gguf.py).
        (lambda w: w.add_expert_count(8), r"llama\.expert_count: 8 experts but no expert"),
    ],
)
def test_settings_headrace_does_not_honour_are_refused(tmp_path: Path, extra, match) -> None:
    with pytest.raises(ModelLoadError, match=r"refused\.gguf: " + match):
        _load(_tiny_gguf(tmp_path / "refused.gguf", extra))


def test_linear_rope_and_sliding_window_metadata(tmp_path: Path) -> None:
    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)
        writer.add_sliding_window(64)

    cfg = _load(_tiny_gguf(tmp_path / "linear.gguf", extra)).config
    assert (cfg.rope_type, cfg.rope_factor, cfg.sliding_window) == ("linear", 4.0, 64)
    torch.testing.assert_close(inv_freq(cfg), default_inv_freq(16, cfg.rope_theta) / 4)


def test_rope_freqs_tensor_divides_the_frequencies(tmp_path: Path) -> None:
    """Llama 3.1's scaling as llama.cpp's converter stores it: per-frequency divisors."""
    factors = np.array([1, 1.5, 2, 4, 8, 8, 8, 8], dtype=np.float32)

    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", factors)

    cfg = _load(_tiny_gguf(tmp_path / "llama3.gguf", extra)).config
    assert cfg.rope_freq_factors == tuple(float(f) for f in factors)
    expected = default_inv_freq(16, cfg.rope_theta) / torch.from_numpy(factors)
    assert torch.equal(inv_freq(cfg), expected)


def test_qwen3_q_k_norms(tmp_path: Path) -> None:
    config = dataclasses.replace(TINY, architecture="qwen3", qk_norm=True, head_dim=32)
    weights = dummy_weights(config, torch.float32, "cpu", 5)
    for name in weights:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            weights[name] = torch.randn(32)

    def norms(writer: gguf.GGUFWriter) -> None:
        for i in range(config.num_layers):
            for part in "qk":
                name = f"model.layers.{i}.self_attn.{part}_norm.weight"
                writer.add_tensor(f"blk.{i}.attn_{part}_norm.weight", weights[name].numpy())

    written = {n: w for n, w in weights.items() if "_norm." not in n}
    writer_config = dataclasses.replace(config, qk_norm=False)
    path = tmp_path / "qwen3.gguf"
    _write_gguf(path, writer_config, written, "qwen3", lambda w: (w.add_key_length(32), norms(w)))
    loaded = _load(path)
    assert loaded.config.qk_norm and loaded.config.head_dim == 32
    for i in range(config.num_layers):
        name = f"model.layers.{i}.self_attn.k_norm.weight"
        assert torch.equal(loaded.weights[name], weights[name])


@pytest.mark.parametrize("quantized", [False, True])
def test_phi3_fused_projections_are_split(tmp_path: Path, quantized: bool) -> None:
    """Phi-3's attn_qkv and ffn_up (gate|up, twice the rows) come out as the usual names."""
    weights = dummy_weights(TINY, torch.float32, "cpu", 9)
    fused = {"attn_qkv": ("q", "k", "v"), "ffn_up": ("gate", "up")}
    plain = {n: w for n, w in weights.items() if not n.endswith(("q_proj.weight", "k_proj.weight",
             "v_proj.weight", "gate_proj.weight", "up_proj.weight"))}  # fmt: skip

    def extra(writer: gguf.GGUFWriter) -> None:
        for i in range(TINY.num_layers):
            for gguf_part, parts in fused.items():
                kind = "self_attn" if gguf_part == "attn_qkv" else "mlp"
                rows = [weights[f"model.layers.{i}.{kind}.{p}_proj.weight"] for p in parts]
                array = torch.cat(rows).numpy()
                data = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(
                    f"blk.{i}.{gguf_part}.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0
                )

    path = _tiny_gguf(tmp_path / "phi3.gguf", extra, weights=plain, arch="phi3")
    loaded = load_model(str(path), progress=False, quantized=quantized)
    assert set(loaded.weights) == set(weights)
    for name, weight in weights.items():
        got = loaded.weights[name]
        got = got.dequantize() if hasattr(got, "dequantize") else got
        tolerance = 0 if _gguf_name(name).endswith("norm.weight") else 0.01
        torch.testing.assert_close(got.float(), weight, atol=tolerance, rtol=0)
