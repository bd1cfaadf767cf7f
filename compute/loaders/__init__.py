"""Model loading: one entry point from a `--model` source to config, weights and tokenizer.

`load_model` dispatches on the source ("default", a `.gguf` file, a Hugging Face checkpoint
directory, or `dummy:<shape>`) to the loader for that format (gguf.py, hf.py, dummy.py); the
types they share are in base.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from compute.loaders.base import (
    DUMMY_PREFIX,
    PICKLE_SUFFIXES,
    LoadedModel,
    ModelLoadError,
    read_template_flag,
    with_chat_template,
)

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "load_model",
    "read_template_flag",
    "with_chat_template",
]


def load_model(
    source: str = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: bool = True,
    quantized: bool = False,
) -> LoadedModel:
    """Load `source`: "default", a `.gguf` file, an HF directory, or `dummy:<shape>`.

    ``quantized``: keep a GGUF file's block-quantized matrices in their blocks (for the CPU
    kernels; the formats of kernels.cpu.quant.FORMATS); other sources and formats load
    dense either way."""
    # Format loaders are imported when used: only GGUF users pay for gguf, and so on.
    if source.startswith(DUMMY_PREFIX):
        from compute.loaders.dummy import load_dummy

        return load_dummy(source[len(DUMMY_PREFIX) :], dtype=dtype, device=device, seed=seed)
    if source == "default":
        from compute.loaders.default_model import default_model_path

        path = default_model_path()
    else:
        path = Path(source).expanduser()
    if path.is_dir():
        from compute.loaders.hf import load_hf_dir

        return load_hf_dir(path, dtype=dtype, device=device, progress=progress)
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise ModelLoadError(f"{path}: pickled checkpoints are refused (unsafe); use safetensors")
    if path.is_file():
        from compute.loaders.gguf import load_gguf

        return load_gguf(path, dtype=dtype, device=device, progress=progress, quantized=quantized)
    raise ModelLoadError(
        f"{source}: no such file or directory (expected 'default', a .gguf file, "
        f"a Hugging Face checkpoint directory, or '{DUMMY_PREFIX}<shape>')"
    )
