"""A model larger than the memory available is refused at load, with the bytes it needs
and the bytes available, before any weight is read (compute/loaders/memory_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compute.loaders import ModelLoadError, load_model, memory_check
from compute.loaders.base import LoadedModel
from kernels.cpu.quant import QuantizedWeight

pytestmark = pytest.mark.slow


def test_available_bytes_reads_this_machine() -> None:
    available = memory_check.available_bytes()
    assert available is None or available > 0


def _weight_bytes(loaded: LoadedModel) -> int:
    return sum(
        w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
        for w in loaded.weights.values()
    )


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny Qwen3-MoE checkpoint directory, its q8_0 GGUF or None without the converter)."""
    pytest.importorskip("transformers")
    from tests.engine.test_model_families_gguf import CONVERTER_DIR, convert
    from tests.engine.test_model_families_moe import build_moe_model

    root = tmp_path_factory.mktemp("memory")
    build_moe_model(root / "hf", "qwen3-moe-unnormalised")
    if not (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file():
        return root / "hf", None
    return root / "hf", convert(root / "hf", root / "model-q8_0.gguf", "q8_0")


@pytest.mark.parametrize("source", ["safetensors", "gguf-quantized", "gguf-dense"])
def test_too_large_a_model_is_refused_with_both_figures(moe_files, monkeypatch, source) -> None:
    hf_dir, q8 = moe_files
    if source != "safetensors" and q8 is None:
        pytest.skip("llama.cpp's converter is not there: make llama-cpp-convert")
    path, quantized = (hf_dir, False) if source == "safetensors" else (q8, "quantized" in source)
    needed = _weight_bytes(load_model(str(path), progress=False, quantized=quantized))
    # Exactly enough loads; a byte less is refused, naming what it needs and what there is.
    monkeypatch.setattr(memory_check, "available_bytes", lambda: needed)
    load_model(str(path), progress=False, quantized=quantized)
    monkeypatch.setattr(memory_check, "available_bytes", lambda: needed - 1)
    match = rf"needs {needed:,} bytes .* only {needed - 1:,} bytes .* available"
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(path), progress=False, quantized=quantized)


def test_no_weight_is_read_before_the_check(moe_files, monkeypatch) -> None:
    hf_dir, _ = moe_files
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 1)
    read = []
    monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: read.append(1))
    with pytest.raises(ModelLoadError, match="needs"):
        load_model(str(hf_dir), progress=False)
    assert not read
