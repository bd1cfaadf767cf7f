"""Exceptions -> gRPC status codes, in one place.

``StatusInterceptor`` wraps every GenerationService handler: a ``RequestError``
becomes its status code with a message naming the field; anything unexpected
becomes INTERNAL "internal error" and is logged with its traceback (the client
never sees internals). Handlers raise; they never call ``context.abort``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

from compute.log import get_logger
from services.domain import RequestError

SERVICE_PREFIX = "/headrace.v1.GenerationService/"
_CODES = {code.name: code for code in grpc.StatusCode}

log = get_logger(__name__)

Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


def status_of(exc: Exception, method: str = "") -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for ``exc``."""
    if isinstance(exc, RequestError):
        return _CODES.get(exc.code, grpc.StatusCode.INTERNAL), str(exc)
    log.error("unexpected error", method=method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error"


def wrap_handler(handler: grpc.RpcMethodHandler | None, around: Around):
    """A copy of a unary-request handler whose behavior runs inside ``around(context)``."""
    if handler is None or not (handler.unary_unary or handler.unary_stream):
        return handler  # unknown method, or a client-streaming kind the API does not have
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        behavior = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(context):
                return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    streaming = handler.unary_stream

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        # aclosing: when grpc stops iterating, the servicer's generator (and with it the
        # pipeline's) is closed now, not whenever it is garbage-collected.
        async with around(context), contextlib.aclosing(streaming(request, context)) as responses:
            async for response in responses:
                yield response

    return grpc.unary_stream_rpc_method_handler(stream, **codec)


@contextlib.asynccontextmanager
async def mapped_errors(context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    """Ends the call with the status code of whatever exception escapes the block."""
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        await context.abort(*status_of(exc, method))


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by GenerationService handlers to status codes."""

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if not details.method.startswith(SERVICE_PREFIX):
            return handler  # health and reflection report their own statuses
        return wrap_handler(handler, lambda context: mapped_errors(context, details.method))
