"""The layout is the architecture: checks that keep the folders honest.

- compute/core/ is torch-free (importing all of it loads no torch), so the scheduler and
  KV bookkeeping stay testable with fakes and usable by a process without the model;
- imports only run down the layers: services -> compute -> compute.core -> kernels, and
  kernels (called by the model) never import compute or services; the one logging style
  is the leaf kernels.log, at the bottom;
- no import circle anywhere.
Both rules count every import: lazy, function-level ones and those under
``if TYPE_CHECKING`` too (a type-only import is still a dependency of the code that
names the type), with no exemption.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compute", "services", "kernels")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return {_module_name(p): p for p in files if "gen" not in p.relative_to(ROOT).parts}


def _imports(tree: ast.AST) -> set[str]:
    """Names imported anywhere in a module, type-only imports included."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports."""
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        names = _imports(ast.parse(path.read_text(), str(path)))
        graph[name] = {n for n in names if n in sources and n != name}
    return graph


def _layer(module: str) -> int:
    if module.startswith("kernels"):
        return 0
    if module.startswith("compute.core"):
        return 1
    return 2 if module.startswith("compute") else 3


def test_imports_only_run_down_the_layers() -> None:
    # kernels (0) <- compute.core (1) <- compute (2) <- services (3); the model in compute/
    # calls the kernels, so that edge runs down too.
    upward = [
        f"{a} -> {b}"
        for a, targets in import_graph().items()
        for b in targets
        if _layer(b) > _layer(a)
    ]
    assert not upward, upward
    assert not import_graph()["kernels.log"], "kernels.log must stay a leaf"


def test_no_import_circle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_core_is_torch_free() -> None:
    modules = sorted(m for m in _sources() if m.startswith("compute.core"))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert len(modules) >= 10 and out.stdout.strip() == "False"
