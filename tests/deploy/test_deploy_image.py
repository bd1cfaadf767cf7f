"""The Dockerfile without Docker: hadolint lints it, and the cpu target's commands (the
wheel build, every `pip install`, the ENTRYPOINT and the HEALTHCHECK) run in a fresh venv.

download.pytorch.org is out of reach here, so the torch line runs without its
--index-url: the same torch 2.13.0+cpu wheel then comes from pip's configured
find-links, as in `make setup`. Everything else runs as written in the Dockerfile.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kernels.cpu.build import ISA_LEVELS
from services.server.server_config import ServerConfig
from tests.conftest import RunningServer

ROOT = Path(__file__).resolve().parents[2]
HADOLINT = Path(sys.executable).with_name("hadolint")


def _stages() -> dict[str, list[str]]:
    """Instructions per stage name, line continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.match(r"FROM \S+ AS (\w+)", line):
            current = m.group(1)
            stages[current] = []
        stages[current].append(line)
    return stages


def _args(stage: list[str]) -> dict[str, str]:
    found = {}
    for line in _stages()[""] + stage:
        if m := re.match(r'ARG (\w+)="([^"]*)"', line):
            found[m.group(1)] = m.group(2)
    return found


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [str(HADOLINT), "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_targets_are_non_root_with_probe_signal_and_ports() -> None:
    stages = _stages()
    assert {"wheels", "kernels", "cpu", "gpu"} <= set(stages)
    for name in ("cpu", "gpu"):
        text = "\n".join(stages[name])
        assert "USER 10001" in text and "STOPSIGNAL SIGTERM" in text
        assert "EXPOSE 50051 9400" in text
        assert 'CMD ["headrace", "health", "--timeout", "4"]' in text
        assert 'ENTRYPOINT ["headrace"]' in text
    gpu = "\n".join(stages["gpu"])
    assert "nvidia/cuda:" in gpu and "/whl/cu12" in gpu and "cupy-cuda12x" in gpu


@pytest.mark.slow
def test_cpu_target_commands_run_in_a_fresh_venv(tmp_path: Path, serve) -> None:
    stages = _stages()
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bindir = env_dir / "bin"
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    wheels = tmp_path / "wheels"
    (build,) = [line[4:] for line in stages["wheels"] if line.startswith("RUN ")]
    build = build.replace("/wheels", str(wheels))
    _sh(build, env, cwd=ROOT)
    args = _args(stages["cpu"])
    (install,) = [line[4:] for line in stages["cpu"] if line.startswith("RUN ")]
    for command in install.split(" && "):
        if not command.startswith("pip install"):
            continue  # rm -rf /wheels, useradd: image housekeeping
        for name, value in args.items():
            command = command.replace(f'"${{{name}}}"', shlex.quote(value))
        command = re.sub(r"--index-url \S+ ", "", command)  # see the module docstring
        _sh(command.replace("/wheels", str(wheels)), env, cwd=tmp_path)
    # The kernels stage's build (its apt-get line is image housekeeping), then the installed
    # package must load those prebuilt libraries: no compiler may be needed at run time.
    (build_kernels,) = [l[4:] for l in stages["kernels"] if "kernels.cpu.build" in l]
    kernel_dir = tmp_path / "kernels"
    _sh(build_kernels.replace("/kernels", str(kernel_dir)), env, cwd=ROOT)
    assert sorted(p.name.split("-")[1] for p in kernel_dir.glob("*.so")) == sorted(ISA_LEVELS)
    runtime = {**env, "HEADRACE_KERNEL_DIR": str(kernel_dir), "CXX": "/bin/false"}
    check = "from kernels.cpu import library; assert library.available()"
    _sh(f"python -c '{check}'", runtime, cwd=tmp_path)
    # ENTRYPOINT + a flag: the console script starts and parses its flags.
    _sh("headrace serve --help", env, cwd=tmp_path)
    # The tracing extra came along, so HEADRACE_OTLP_ENDPOINT works in the image.
    _sh('python -c "import services.telemetry.tracing"', env, cwd=tmp_path)
    # HEALTHCHECK against a live server, through the image's HEADRACE_SERVER variable.
    running: RunningServer = serve(config=ServerConfig(host="127.0.0.1", port=0, metrics_port=-1))
    health = json.loads(
        next(l for l in stages["cpu"] if l.startswith("HEALTHCHECK")).split("CMD ", 1)[1]
    )
    probe = subprocess.run(
        health, env={**env, "HEADRACE_SERVER": running.target}, timeout=60, capture_output=True
    )
    assert probe.returncode == 0, probe
    assert probe.stdout.decode().strip() == "SERVING"


def _sh(command: str, env: dict[str, str], cwd: Path) -> None:
    result = subprocess.run(
        command, shell=True, env=env, cwd=cwd, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
