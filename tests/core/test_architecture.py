"""The layout is the architecture: checks that keep the folders honest.

- compute/core/ is torch-free (importing all of it loads no torch), so the scheduler and
  KV bookkeeping stay testable with fakes and usable by a process without the model;
- imports only run down the layers: services -> compute -> compute.core -> kernels, and
  kernels (called by the model) never import compute or services; the one logging style
  is the leaf kernels.log, at the bottom;
- inside each package, imports only run down its floors (``FLOORS``): a room (a folder,
  or a module at the package's top) imports rooms on lower floors only, never one on
  its own floor or above, and every room has a floor;
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


# Each package's rooms, top floor first; rooms on one floor never import each other. The
# package's own __init__ (the empty root) is the ground every room may stand on.
FLOORS = {
    "compute": (
        "step_loop",
        "engine",
        "loaders",
        "runner tokenizer",
        "sampling models device",
        "core",
    ),
    "kernels": ("ops", "cpu cuda", "reference", "metadata", "transfer log"),
    "services": (
        "cli codegen",
        "bench",
        "client server",
        "api worker",
        "pipeline security",
        "telemetry",
        "domain rpc gen",
    ),
}


def _room(module: str) -> tuple[str, str]:
    """(package, room): the folder or top-level module a module lives in ("" = the root)."""
    package, _, rest = module.partition(".")
    return package, rest.split(".")[0]


def _floor(package: str, room: str) -> int:
    if room == "":
        return len(FLOORS[package])
    return next(i for i, rooms in enumerate(FLOORS[package]) if room in rooms.split())


def test_every_room_has_a_floor() -> None:
    rooms = {_room(m) for m in _sources()}
    unplaced = sorted(
        f"{pkg}.{room}"
        for pkg, room in rooms
        if room and not any(room in floor.split() for floor in FLOORS[pkg])
    )
    assert not unplaced, f"add these rooms to FLOORS: {unplaced}"


def test_imports_only_run_down_the_floors_of_each_package() -> None:
    sideways_or_up = []
    for a, targets in import_graph().items():
        (pkg, room) = _room(a)
        for b in targets:
            (pkg_b, room_b) = _room(b)
            if pkg_b != pkg or room_b == room:
                continue
            if _floor(pkg, room_b) <= _floor(pkg, room):
                sideways_or_up.append(f"{a} -> {b}")
    assert not sideways_or_up, sideways_or_up


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
