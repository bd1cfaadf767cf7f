"""Deployment files: compose.yaml against the Compose Specification schema, its (and the
Dockerfile's) grpc health probe against a live server. HAProxy runs in test_loadbalancer.py.

Docker cannot run here, so this checks what can be checked without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from services.cli import cli_flags
from tests.conftest import RunningServer

ROOT = Path(__file__).resolve().parents[2]
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


def test_compose_services_env_and_drain_window() -> None:
    compose = _load("compose.yaml")
    known = {flag.env for flag in cli_flags.FLAGS}
    for name in ("headrace", "headrace-gpu"):
        service = compose["services"][name]
        assert set(service["environment"]) <= known, set(service["environment"]) - known
        grace = float(service["environment"]["HEADRACE_GRACE_PERIOD"])
        assert float(service["stop_grace_period"].removesuffix("s")) > grace + 5
        assert service["stop_signal"] == "SIGTERM"
        assert service["healthcheck"]["test"] == ["CMD", "headrace", "health", "--timeout", "4"]
        assert "models:/models:ro" in service["volumes"]
    assert compose["services"]["headrace"]["deploy"]["replicas"] >= 2
    gpu = compose["services"]["headrace-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["target"] == "gpu"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    assert "headrace" in gpu["networks"]["default"]["aliases"]


def test_compose_proxy_and_prometheus_use_the_repo_configs() -> None:
    services = _load("compose.yaml")["services"]
    assert (
        "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro"
        in (services["haproxy"]["volumes"])
    )
    assert (
        "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in (services["prometheus"]["volumes"])
    )
    haproxy = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert "headrace:50051" in haproxy and "bind :8080 proto h2" in haproxy


def test_prometheus_scrapes_every_replica_by_dns() -> None:
    config = _load("deploy/prometheus.yml")
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    port = next(f for f in cli_flags.FLAGS if f.option == "--metrics-port")
    assert sd == {"names": ["headrace"], "type": "A", "port": 9400, "refresh_interval": "10s"}
    assert port.env in _load("compose.yaml")["x-headrace-env"]
    assert job["metrics_path"] == "/metrics"


def test_haproxy_config_is_valid() -> None:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not os.path.exists(haproxy):
        pytest.skip("haproxy is not installed (make setup installs it as root)")
    result = subprocess.run(
        [haproxy, "-c", "-f", str(ROOT / "deploy" / "haproxy.cfg")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_health_probe_of_compose_follows_the_server(serve) -> None:
    running: RunningServer = serve()
    test = _load("compose.yaml")["services"]["headrace"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    command = [str(Path(sys.executable).with_name(test[1])), *test[2:]]
    env = {**os.environ, "HEADRACE_SERVER": running.target}
    assert subprocess.run(command, env=env, timeout=60).returncode == 0
