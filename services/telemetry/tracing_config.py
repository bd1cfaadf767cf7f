"""Whether and where to export OpenTelemetry traces: the config, and starting tracing.

Off by default. On when ``--otlp-endpoint`` (HEADRACE_OTLP_ENDPOINT) is set, or when the
standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables are
(as an OpenTelemetry operator injects them); the flag wins. OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES name the service (default ``headrace``). OpenTelemetry itself
is imported only once tracing is on (services/telemetry/tracing.py, the ``tracing`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels.log import get_logger

if TYPE_CHECKING:
    from services.telemetry.tracing import Tracing

STANDARD_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXTRA_HINT = "pip install 'headrace[tracing]'"

log = get_logger(__name__)


@dataclass(frozen=True)
class TracingConfig:
    # OTLP/gRPC collector to send spans to: http://HOST:4317 (plaintext) or https://...
    # (TLS); "" = off unless the standard OTEL_EXPORTER_OTLP_*ENDPOINT variables are set.
    otlp_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(
                "otlp_endpoint must start with http:// (plaintext) or https:// (TLS), "
                f"e.g. http://otel-collector:4317; got {self.otlp_endpoint[:200]!r}"
            )

    def enabled(self, environ: Mapping[str, str]) -> bool:
        return bool(self.otlp_endpoint) or any(environ.get(name) for name in STANDARD_ENDPOINTS)


def start_tracing(
    config: TracingConfig, environ: Mapping[str, str] | None = None
) -> Tracing | None:
    """The started tracing, or None when it is off.

    ValueError when ``--otlp-endpoint`` asks for it and OpenTelemetry is not installed;
    with only the standard variables set, a warning and no tracing (they may be meant for
    other processes of the pod).
    """
    environ = os.environ if environ is None else environ
    if not config.enabled(environ):
        return None
    try:
        from services.telemetry.tracing import Tracing
    except ImportError as exc:
        if config.otlp_endpoint:
            raise ValueError(f"--otlp-endpoint needs OpenTelemetry: {EXTRA_HINT}") from exc
        log.warning("OTEL_EXPORTER_OTLP_*ENDPOINT is set but OpenTelemetry is not installed; "
                    f"tracing is off ({EXTRA_HINT})")  # fmt: skip
        return None
    tracing = Tracing.otlp(config.otlp_endpoint or None)
    log.info("tracing on", endpoint=config.otlp_endpoint or "from OTEL_EXPORTER_OTLP_*")
    return tracing
