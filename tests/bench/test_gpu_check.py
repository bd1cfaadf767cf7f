"""bench/gpu/gpu_check.sh, the one command of a GPU session's device call, dry-run on the CPU.

The GPU machine's image has torch, CuPy, pytest, transformers ... but not this project's
other packages; what `import compute, services` and the gpu-marked tests need beyond it
travels as wheels (the Makefile's GPU_WHEELS, `make gpu-wheels`, carried in .gpu-wheels/).
Checked here against the image's package list (tests/support/gpu_image/packages.txt):

- every runtime dependency of the project, and every dependency of a carried wheel (they
  are installed with --no-deps), is in the image or among the wheels;
- the script's imports step and its test collection succeed in a subprocess where every
  installed distribution the image lacks and no wheel carries cannot be imported
  (tests/support/gpu_image/sitecustomize.py), and collect gpu-marked tests, no errors;
- without the wheels the script stops at once, saying so; without a GPU the `ready` step
  stops it with its own verdict, and a fault of that check is never read as "no GPU"; the
  required steps' time limits fit the device's 600 s command limit; a step that would get
  too little of the budget is skipped, said so; what the call leaves in $OUT fits the 8
  files a device call returns.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "gpu_check.sh"
IMAGE_DIR = ROOT / "tests" / "support" / "gpu_image"
COMMAND_LIMIT_S = 600  # the device tool's limit on one command
# Image markers: its python3 is 3.12 on x86-64 Linux.
IMAGE_ENV = {
    "python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "implementation_name": "cpython", "extra": "",
}  # fmt: skip


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    text = (IMAGE_DIR / "packages.txt").read_text()
    return {
        normal(w) for line in text.splitlines() if not line.startswith("#") for w in line.split()
    }


def carried_wheels() -> dict[str, str]:
    """GPU_WHEELS from the Makefile: name -> pinned version."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    [line] = [ln for ln in text.splitlines() if ln.startswith("GPU_WHEELS ?=")]
    specs = line.split("?=", 1)[1].split()
    return {normal(s.split("==")[0]): s.split("==")[1] for s in specs}


def requirements(dist: str) -> set[str]:
    """What a distribution needs on the image (extras and other platforms' markers off)."""
    needed = set()
    for text in importlib.metadata.distribution(dist).requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(IMAGE_ENV):
            needed.add(normal(req.name))
    return needed


def test_the_image_and_the_wheels_hold_every_runtime_dependency() -> None:
    available = image_packages() | set(carried_wheels())
    missing = requirements("headrace") - available
    assert not missing, f"add to GPU_WHEELS in the Makefile: {sorted(missing)}"
    assert "smg-grpc-proto" in carried_wheels()  # services/server/server.py imports it


def test_every_carried_wheel_has_its_dependencies_there() -> None:
    available = image_packages() | set(carried_wheels())
    for name in carried_wheels():
        missing = requirements(name) - available
        assert not missing, f"{name} needs {sorted(missing)}: carry them too (--no-deps)"


def test_the_carried_versions_satisfy_every_pin_on_them() -> None:
    """The wheels are installed with --no-deps, so nothing checks their versions there: every
    requirement headrace and the carried wheels have on a carried wheel must hold here. (The
    pins need not equal .venv's: a patch release on PyPI must not fail CI.)"""
    pins = carried_wheels()
    for dist in ["headrace", *pins]:
        for text in importlib.metadata.distribution(dist).requires or []:
            req = Requirement(text)
            pinned = pins.get(normal(req.name))
            if pinned is not None and (req.marker is None or req.marker.evaluate(IMAGE_ENV)):
                assert req.specifier.contains(pinned), f"{dist} needs {req}; GPU_WHEELS: {pinned}"


def blocked() -> tuple[list[str], list[str]]:
    """(top-level modules, distributions) installed here that the GPU machine lacks: not in
    its image, not needed by a package of its image (which has them there, in its own
    versions), not a carried wheel."""
    installed = {normal(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    there, todo = set(), [n for n in image_packages() if n in installed]
    while todo:
        name = todo.pop()
        if name not in there:
            there.add(name)
            todo += [n for n in requirements(name) if n in installed]
    allowed = there | set(carried_wheels()) | {"headrace"}
    modules = [
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not any(normal(d) in allowed for d in dists)
    ]
    return sorted(modules), sorted(set(installed) - allowed)


def run_script(tmp_path: Path, *steps: str, image: bool = False, **env: str):
    """bash bench/gpu/gpu_check.sh STEPS with this interpreter; image=True: as on the GPU image."""
    full = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), **env}
    if image:
        modules, dists = blocked()
        full["HEADRACE_BLOCKED_MODULES"] = ",".join(modules)
        full["HEADRACE_BLOCKED_DISTS"] = ",".join(dists)
        full["PYTHONPATH"] = str(IMAGE_DIR)
    return subprocess.run(
        ["bash", str(SCRIPT), *steps], cwd=ROOT, env=full, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip


def test_the_block_list_holds_what_the_image_lacks() -> None:
    modules, dists = blocked()
    # What made collecting all of tests/ fail there.
    assert {"cryptography", "jsonschema", "kubernetes_validate", "grpc_tools"} <= set(modules)
    assert "opentelemetry" in modules and "opentelemetry-sdk" in dists
    # What the wheels and the image provide stays importable.
    assert not {"torch", "grpc", "structlog", "smg_grpc_proto", "gguf", "pytest"} & set(modules)


def test_the_gpu_steps_import_and_collect_with_only_the_image_and_the_wheels(tmp_path) -> None:
    done = run_script(tmp_path, "install", "collect", image=True, GPU_WHEELS_DIR="installed")
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text()
    log = (out / "pytest.log").read_text()
    assert done.returncode == 0, summary + (out / "setup.log").read_text() + log
    assert "step imports: ok" in summary and "step collect: ok" in summary
    [counts] = re.findall(r"^(\d+)/(\d+) tests collected.*$", log, re.MULTILINE)
    assert int(counts[0]) > 50  # the gpu-marked tests (the rest deselected)
    assert "error" not in log.lower()
    for test in (
        "test_engine_gpu.py::",
        "test_kernels_gpu.py::",
        "test_kernels_gpu_window.py::",
        "test_sampler.py::",
    ):
        assert test in log


def test_the_block_list_works(tmp_path) -> None:
    """The same subprocess set-up cannot import what the image lacks (else the test above
    would prove nothing)."""
    modules, dists = blocked()
    env = {
        **os.environ, "PYTHONPATH": str(IMAGE_DIR),
        "HEADRACE_BLOCKED_MODULES": ",".join(modules), "HEADRACE_BLOCKED_DISTS": ",".join(dists),
    }  # fmt: skip
    code = (
        "import importlib.metadata as m\n"
        "try:\n    import cryptography\nexcept ModuleNotFoundError:\n    print('blocked')\n"
        "print(any(d.metadata['Name'] == 'opentelemetry-sdk' for d in m.distributions()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["blocked", "False"], done.stderr


def test_without_the_wheels_it_stops_at_once_saying_so(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    done = run_script(tmp_path, GPU_WHEELS_DIR=str(tmp_path / "empty"))
    assert done.returncode == 2
    assert "no wheels in" in done.stdout and "carry" in done.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "STOPPED" in summary and "step " not in summary  # nothing ran, versions neither


def test_an_unknown_step_is_refused(tmp_path) -> None:
    done = run_script(tmp_path, "call", "benchmark")
    assert done.returncode == 2 and "unknown step benchmark" in done.stderr


def test_without_a_gpu_the_call_stops_before_the_tests(tmp_path) -> None:
    """Every gpu-marked test would skip, and pytest pass: the `ready` step stops the run,
    and says so with the check's own verdict (bench/gpu/ready.py), not a guess."""
    done = run_script(tmp_path, "call", GPU_WHEELS_DIR="installed")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    setup = (tmp_path / "out" / "setup.log").read_text()
    own = "NOT READY: no CUDA device (torch.cuda.is_available() is False)"
    assert own in setup and "Traceback" not in setup, setup
    assert done.returncode == 3
    assert f"STOPPED: no CUDA device or no CuPy: {own}" in summary, summary
    assert "step imports: ok" in summary and "step ready: FAILED (exit 3)" in summary
    assert "step compile" not in summary and "step kernel-tests" not in summary


def test_a_fault_of_the_ready_check_is_not_read_as_no_gpu(tmp_path) -> None:
    """The check of before (kernels.cuda.is_available(), gone from the package when it
    became one): AttributeError, exit 1. The summary names the check's fault, not the GPU."""
    broken = tmp_path / "python"
    broken.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'from kernels import cuda; cuda.is_available()'\n"
    )
    broken.chmod(0o755)
    done = run_script(tmp_path, "ready", GPU_WHEELS_DIR="installed", PYTHON=str(broken))
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "AttributeError" in (tmp_path / "out" / "setup.log").read_text()
    assert done.returncode == 1
    assert "STOPPED: the ready check itself failed (exit 1;" in summary, summary
    assert "no CUDA device" not in summary


def test_optional_steps_without_time_are_not_run_and_do_not_fail(tmp_path) -> None:
    done = run_script(tmp_path, "bench-engine", GPU_WHEELS_DIR="installed", GPU_CHECK_BUDGET_S="30")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert done.returncode == 0, summary
    assert "step bench-engine: not run (optional;" in summary


def test_a_step_the_budget_cannot_hold_is_skipped(tmp_path) -> None:
    done = run_script(tmp_path, "install", GPU_WHEELS_DIR="installed", GPU_CHECK_BUDGET_S="5")
    assert done.returncode == 124
    assert "step imports: SKIPPED" in (tmp_path / "out" / "summary.txt").read_text()


def limits() -> dict[str, int]:
    """The script's default limits: NAME=${GPU_CHECK_..._S:-N}."""
    found = re.findall(r"^(\w+_S)=\$\{GPU_CHECK_\w+:-(\d+)\}", SCRIPT.read_text(), re.MULTILINE)
    return {name: int(value) for name, value in found}


REQUIRED = ["INSTALL_S", "IMPORTS_S", "READY_S", "COMPILE_S", "KERNEL_TESTS_S", "ENGINE_TESTS_S",
            "BENCH_KERNELS_S", "BENCH_GRAPHS_S", "BENCH_GAP_S"]  # fmt: skip


def test_the_call_fits_the_command_limit() -> None:
    """One device call: its required steps' limits within the budget, the budget within
    the 600 s a command gets (the optional steps get only what is left)."""
    found = limits()
    budget = found.pop("BUDGET_S")
    assert budget <= COMMAND_LIMIT_S - 60  # versions' own limits, the copy back
    assert sum(found[s] for s in REQUIRED) <= budget - 20  # 20 s: versions
    text = SCRIPT.read_text()
    order = re.search(r"^    call\)\n      EXPANDED\+=\(([^)]*)\)", text, re.MULTILINE)
    assert order is not None
    assert order.group(1).split() == [
        "versions", "install", "ready", "compile", "kernel-tests", "engine-tests",
        "bench-kernels", "bench-graphs", "bench-gap", "sanitize", "bench-engine",
    ]  # fmt: skip
    assert "call1" not in text and "call2" not in text  # one call, not three


def test_the_call_returns_at_most_eight_files() -> None:
    """A device call returns at most 8 files from $OUT: the script's four logs and the
    JSON of its four benchmarks, which therefore draw no PNG there (replot does, later)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    logs = set(re.findall(r"(?:step|optional) [\w-]+ \"\$\w+\" (\w+\.log)", text))
    assert logs == {"setup.log", "pytest.log", "bench.log"}
    commands = re.findall(r'"\$PYTHON" -m bench\.gpu\.(\w+)([^\n]*)', text)
    writers = {name for name, args in commands if name not in ("ready", "compile_kernels")}
    assert writers == {"cuda_kernels", "cuda_graphs", "step_gap", "engine_gpu"}
    for name, args in commands:
        if name in writers:
            assert "--no-png" in args.split(), name
    assert 1 + len(logs) + len(writers) <= 8  # summary.txt, the logs, one JSON each


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_benchmark_commands_parse_their_arguments(monkeypatch) -> None:
    """Each `"$PYTHON" -m bench.gpu.x ARGS` of the script: ARGS are options it takes."""
    import importlib

    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = re.findall(r'"\$PYTHON" -m bench\.gpu\.(\w+)([^\n]*)', text)
    names = {name for name, _ in commands}
    assert names == {
        "ready", "compile_kernels", "cuda_kernels", "step_gap", "cuda_graphs", "engine_gpu",
    }  # fmt: skip
    commands = [(n, rest) for n, rest in commands if n not in ("ready", "compile_kernels")]
    for name, rest in commands:
        argv = rest.split()
        module = importlib.import_module(f"bench.gpu.{name}")
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        try:
            args = module.parse_args(argv)
        except TypeError:  # bench/gpu/cuda_kernels.py reads sys.argv
            args = module.parse_args()
        assert args is not None, name


@pytest.mark.parametrize("script", ["step_gap", "cuda_graphs", "engine_gpu"])
def test_the_benchmarks_start_with_the_repo_on_pythonpath(script) -> None:
    """As gpu_check.sh runs them, with the repo root on PYTHONPATH: each starts (a bench
    module named like a package, as bench/kernels.py once was, would shadow it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", f"bench.gpu.{script}", "--help"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_kernel_benchmark_runs_each_decode_kernel_and_restores_the_engines() -> None:
    from bench.gpu import cuda_kernels
    from kernels.cuda import launch as cuda

    seen = []
    engine_default = cuda.decode_variant
    for variant in cuda.DECODE_VARIANTS:
        cuda_kernels.with_variant(variant, lambda: seen.append(cuda.decode_variant))()
        assert cuda.decode_variant == engine_default
    assert seen == list(cuda.DECODE_VARIANTS)

    def broken():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError):
        cuda_kernels.with_variant("one-pass", broken)()
    assert cuda.decode_variant == engine_default


def test_the_kernel_benchmark_names_the_kernels_a_call_launched(monkeypatch) -> None:
    """`kernels` of every variant (and so `kernel`) is what the launcher was asked to run."""
    from bench.gpu import cuda_kernels
    from kernels.cuda import launch as cuda

    monkeypatch.setattr(cuda, "_launch", lambda device, file, name, *rest: None)
    launcher = cuda._launch

    def call():
        cuda._launch(None, "paged_attention_decode.cu", "paged_attention_decode_f16_d64_b16")
        cuda._launch(None, "paged_attention_decode.cu", "paged_attention_decode_reduce_f16_d64")

    assert cuda_kernels.launched_kernels(call) == [
        "paged_attention_decode_f16_d64_b16", "paged_attention_decode_reduce_f16_d64",
    ]  # fmt: skip
    assert cuda._launch is launcher
    sdpa = cuda_kernels.with_variant("sdpa", lambda: cuda.prefill_variant, "prefill_variant")
    assert sdpa() == "sdpa" and cuda.prefill_variant == "cupy"


def test_the_prefill_cases_and_their_flops() -> None:
    from bench.gpu import cuda_kernels

    assert cuda_kernels.parse_prefill("4x512/4096") == (4, 512, 4096)
    with pytest.raises(ValueError, match="2 <= Q <= C"):
        cuda_kernels.parse_prefill("1x1/10")
    # 2 queries over 3 keys: the first sees 2 keys, the second 3: 5 pairs of 4 x 9 x 64 FLOPs.
    assert cuda_kernels.prefill_flops((9, 3, 64), 1, 2, 3) == 5 * 4 * 9 * 64
