"""Makes this interpreter look like the GPU machine's image: the top-level modules named in
HEADRACE_BLOCKED_MODULES (comma-separated) cannot be imported, and the distributions named
in HEADRACE_BLOCKED_DISTS are not listed by importlib.metadata (so pytest loads no plugin
of theirs). tests/bench/test_gpu_check.py puts this folder first on PYTHONPATH of a subprocess;
Python imports ``sitecustomize`` at start-up. Nothing else uses it."""

import importlib.metadata
import os
import re
import sys

_MODULES = frozenset(filter(None, os.environ.get("HEADRACE_BLOCKED_MODULES", "").split(",")))
_DISTS = frozenset(filter(None, os.environ.get("HEADRACE_BLOCKED_DISTS", "").split(",")))


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _Blocker:
    """A meta path finder that refuses the blocked modules, as a missing package would."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _MODULES:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the GPU image)", name=name)
        return None


_real_distributions = importlib.metadata.distributions


def _distributions(**kwargs):
    for dist in _real_distributions(**kwargs):
        if _normal(dist.metadata["Name"] or "") not in _DISTS:
            yield dist


if _MODULES:
    sys.meta_path.insert(0, _Blocker())
if _DISTS:
    importlib.metadata.distributions = _distributions
