"""One logging style for every module: structlog with the module as ``component``.

``log = get_logger(__name__)`` at the top of a module; services configure the output
(JSON lines, or a console renderer on a TTY) once at start-up. It lives at the bottom
layer so that the kernels, which import nothing from compute or services, can log too.
"""

from __future__ import annotations

import structlog


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger whose lines carry ``component=name``; it follows later configuration."""
    # A lazy proxy: binding here would freeze whatever configuration exists at import time.
    return structlog.get_logger(component=name)
