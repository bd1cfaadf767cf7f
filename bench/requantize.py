"""The embedded SmolLM2 requantized by llama.cpp's ``llama-quantize`` (K-quant test and
benchmark files), cached in ~/.cache/headrace/models/.

``make llama-quantize`` builds the tool (from the llama-cpp-python sdist's vendored
llama.cpp); HEADRACE_LLAMA_QUANTIZE names another binary. The source is the embedded Q4_1
file (``--allow-requantize``: the weights are quantized twice, fine for comparing two
engines on one file). Run: ``python bench/requantize.py Q4_K_M`` prints the file's path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the Makefile's LLAMA_CPP_PYTHON


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "headrace"


def quantize_tool() -> Path | None:
    """The llama-quantize binary, or None when it has not been built."""
    named = os.environ.get("HEADRACE_LLAMA_QUANTIZE")
    path = Path(named) if named else (
        cache_dir() / f"llama-quantize-{LLAMA_CPP_PYTHON}" / "build" / "bin" / "llama-quantize"
    )  # fmt: skip
    return path if path.is_file() and os.access(path, os.X_OK) else None


def requantized(kind: str = "Q4_K_M") -> Path:
    """The embedded model as `kind` (a llama-quantize type name); made once, then cached.
    RuntimeError naming what to run when the tool is missing or fails."""
    from compute.loaders.default_model import default_model_path

    source = default_model_path()
    out = cache_dir() / "models" / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if out.is_file():
        return out
    tool = quantize_tool()
    if tool is None:
        raise RuntimeError("llama-quantize is not built: run `make llama-quantize`")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [str(tool), "--allow-requantize", str(source), str(tmp), kind]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(requantized(sys.argv[1] if len(sys.argv) > 1 else "Q4_K_M"))
