"""Exceptions -> gRPC status codes, in one place.

``StatusInterceptor`` wraps every handler of headrace.v1 and of the worker protocol
(services/rpc.py ``mapped``): a ``RequestError``
becomes its status code with a message naming the field; anything unexpected
becomes INTERNAL "internal error" and is logged with its traceback (the client
never sees internals). Handlers raise; they never call ``context.abort``.

It also guards every service's request parsing (health and reflection included): a
request whose bytes do not parse (truncated or corrupt, or a string field that is not
valid UTF-8) is INVALID_ARGUMENT with a plain message, where grpc itself would answer
UNKNOWN with the parser's exception class and text.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kernels.log import get_logger
from services import rpc
from services.domain import RequestError
from services.rpc import Around, Continuation

MALFORMED_MESSAGE = (
    "request: the message could not be parsed (truncated or corrupt bytes, or a string "
    "field that is not valid UTF-8)"
)
_CODES = {code.name: code for code in grpc.StatusCode}

log = get_logger(__name__)


def status_of(exc: Exception, method: str = "") -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for ``exc``."""
    if isinstance(exc, RequestError):
        return _CODES.get(exc.code, grpc.StatusCode.INTERNAL), str(exc)
    log.error("unexpected error", method=method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error"


@dataclass(frozen=True)
class Malformed:
    """What the guarded deserializer returns for bytes that do not parse."""

    message: str = MALFORMED_MESSAGE


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # DecodeError, or a UnicodeDecodeError from a string field
            return Malformed()

    return parse


async def _checked(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _checked_stream(requests: AsyncIterator, context: grpc.aio.ServicerContext):
    async for request in requests:
        await _checked(request, context)
        yield request


def reject_malformed(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` (any kind) answering INVALID_ARGUMENT to unparsable requests."""
    codec = {
        "request_deserializer": _safe(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_checked_uu(handler.unary_unary), **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_checked_us(handler.unary_stream), **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_checked_su(handler.stream_unary), **codec)
    return grpc.stream_stream_rpc_method_handler(_checked_ss(handler.stream_stream), **codec)


def _checked_uu(behavior: Callable) -> Callable:
    async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _checked(request, context)
        return await behavior(request, context)

    return uu


def _checked_us(behavior: Callable) -> Callable:
    async def us(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        await _checked(request, context)
        responses = behavior(request, context)
        if not hasattr(responses, "__aiter__"):  # a coroutine writing with context.write,
            await responses  # e.g. grpc.health.v1's Watch
            return
        async with contextlib.aclosing(responses) as responses:
            async for response in responses:
                yield response

    return us


def _checked_su(behavior: Callable) -> Callable:
    async def su(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(_checked_stream(requests, context), context)

    return su


def _checked_ss(behavior: Callable) -> Callable:
    async def ss(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        responses = behavior(_checked_stream(requests, context), context)
        if hasattr(responses, "__aiter__"):
            async for response in responses:
                yield response
        else:  # a coroutine that writes its responses with context.write
            await responses

    return ss


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
        if handler is None:
            return None
        handler = reject_malformed(handler)
        if not rpc.mapped(details.method):
            return handler  # health and reflection report their own statuses
        return wrap_handler(handler, lambda context: mapped_errors(context, details.method))
