"""Logging setup: structlog JSON lines (a console renderer when stderr is a TTY).

Call ``configure`` once at start-up. Request lines carry ``request_id``; prompt
and output text are never logged at info level.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import structlog

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "json", "console")


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"  # debug, info, warning or error
    format: str = "auto"  # json, console, or auto (console when stderr is a TTY)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")

    @property
    def json(self) -> bool:
        return self.format == "json" or (self.format == "auto" and not sys.stderr.isatty())


def configure(config: LogConfig = LogConfig()) -> None:
    """Route structlog (and stdlib logging, which grpc uses) to stderr at ``config.level``."""
    level = getattr(logging, config.level.upper())
    renderer = (
        structlog.processors.JSONRenderer()
        if config.json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if config.json:
        # The console renderer prints tracebacks itself; JSON needs them as a string.
        processors.append(structlog.processors.format_exc_info)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr, force=True)
