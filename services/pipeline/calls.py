"""What both gRPC adapters (services/api, services/worker) do around one pipeline call.

They count the requests they refuse before the pipeline sees them, log how each request
ended, and name a bad field by their own request's path (``request_field``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from compute.core.errors import FieldError
from kernels.log import get_logger
from services.domain import Complete, RequestError
from services.telemetry.metrics import Metrics

log = get_logger(__name__)


@contextlib.contextmanager
def counting_rejection(metrics: Metrics) -> Iterator[None]:
    """Counts a FieldError raised in the block (the pipeline counts those it refuses)."""
    try:
        yield
    except FieldError:
        metrics.observe_rejected("invalid_argument")
        raise


async def logged(
    request_id: str, events: AsyncIterator, request_field: Callable[[str], str]
) -> AsyncIterator:
    """``events`` with the request's end logged; a FieldError names its request path."""
    try:
        async for event in events:
            if isinstance(event, Complete):
                log_complete(request_id, event)
            yield event
    except RequestError as exc:
        log.info("request failed", request_id=request_id, code=exc.code, error=str(exc))
        if isinstance(exc, FieldError):
            raise exc.at(request_field(exc.field)) from None
        raise


def log_complete(request_id: str, complete: Complete) -> None:
    usage, timing = complete.usage, complete.timing
    log.info(
        "request complete",
        request_id=request_id,
        finish_reason=complete.finish_reason,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        tokenize_s=round(timing.tokenize_seconds, 6),
        queue_s=round(timing.queue_seconds, 6),
        ttft_s=round(timing.time_to_first_token_seconds, 6),
        total_s=round(timing.total_seconds, 6),
    )
