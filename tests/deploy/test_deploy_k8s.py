"""deploy/k8s against the Kubernetes 1.33 OpenAPI schemas (kubernetes-validate, pinned in
the test extra, ships them: no network), strict about unknown fields, plus the links
between the manifests and the server that the schemas cannot see."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from services.cli import cli_flags
from services.server.server import SERVICE_NAME

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.33.0"
MANIFESTS = ["configmap", "deployment", "service", "pdb", "hpa"]


def _load(name: str) -> dict:
    return yaml.safe_load((K8S / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_the_kubernetes_schema(name: str) -> None:
    kubernetes_validate.validate(_load(name), VERSION, strict=True)


def test_the_validator_rejects_a_misspelled_field() -> None:
    broken = copy.deepcopy(_load("deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_every_yaml_file_is_validated_or_named() -> None:
    files = {p.stem for p in K8S.glob("*.yaml")}
    assert files == {*MANIFESTS, "prometheus-adapter-rules"}


def _container() -> dict:
    return _load("deployment")["spec"]["template"]["spec"]["containers"][0]


def test_deployment_probes_drain_and_security() -> None:
    pod = _load("deployment")["spec"]["template"]["spec"]
    c = _container()
    settings = _load("configmap")["data"]
    grace = float(settings["HEADRACE_GRACE_PERIOD"])
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > grace + pre_stop
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": 50051, "service": SERVICE_NAME}
    assert c["livenessProbe"]["grpc"] == {"port": 50051}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9400}


def test_configmap_keys_are_serve_flags() -> None:
    known = {flag.env for flag in cli_flags.FLAGS}
    data = _load("configmap")["data"]
    assert set(data) <= known, set(data) - known
    assert data["HEADRACE_PORT"] == "50051" and data["HEADRACE_METRICS_PORT"] == "9400"


def test_service_ports_are_named_and_grpc() -> None:
    ports = _load("service")["spec"]["ports"]
    grpc_port = next(p for p in ports if p["name"] == "grpc")
    assert grpc_port["appProtocol"] == "grpc" and grpc_port["targetPort"] == "grpc"


def test_hpa_metric_is_exported_and_adapted() -> None:
    from services.telemetry.metrics import Metrics

    (metric,) = _load("hpa")["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    exported = {f.name for f in Metrics().registry.collect()}
    assert name in exported
    (rule,) = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    assert name in rule["seriesQuery"] and rule["name"]["as"] == name
