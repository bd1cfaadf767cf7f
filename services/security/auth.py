"""Token auth for the gRPC server: the outermost interceptor, so nothing runs before it.

A call must carry ``authorization: Bearer <token>`` metadata with a token from
``--auth-token-file`` (services/security/auth_tokens.py); otherwise it ends UNAUTHENTICATED
with a plain message, before any other interceptor, handler or request parser runs
(the refusal never reads the request). grpc.health.v1 is always open (probes and
load balancers carry no token); reflection is open only with ``--no-auth-reflection``.
Everything else -- headrace.v1 and the vLLM worker protocol -- needs the token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kernels.log import get_logger
from services import rpc
from services.rpc import Continuation
from services.security.auth_tokens import TokenFile
from services.telemetry.metrics import NO_METRICS, Metrics

SCHEME = "bearer"
MISSING = "missing credentials: send metadata 'authorization: Bearer <token>'"
MALFORMED = "authorization metadata must be 'Bearer <token>'"
INVALID = "invalid token"

log = get_logger(__name__)


def bearer_token(value: str) -> str | None:
    """The token of an ``authorization`` value ``Bearer <token>`` (scheme any case), else None."""
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == SCHEME and token else None


def refusal(metadata: Sequence[tuple[str, Any]] | None, tokens: TokenFile) -> str | None:
    """Why a call with ``metadata`` is refused, or None when its token is accepted.

    Only the first ``authorization`` entry counts, so one call cannot try many tokens.
    """
    value = next((v for k, v in metadata or () if k == "authorization"), None)
    if value is None:
        return MISSING
    if isinstance(value, bytes):  # only "-bin" keys are bytes; be safe anyway
        value = value.decode("latin-1")
    token = bearer_token(value)
    if token is None:
        return MALFORMED
    return None if tokens.accepts(token) else INVALID


def _refuse(message: str) -> grpc.RpcMethodHandler:
    # A stream-stream handler ends a call of any kind; without a deserializer and never
    # reading, it does not parse the request at all.
    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without an accepted bearer token (open methods excepted)."""

    def __init__(
        self, tokens: TokenFile, auth_reflection: bool, metrics: Metrics = NO_METRICS
    ) -> None:
        self._tokens = tokens
        self._auth_reflection = auth_reflection
        self._metrics = metrics

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if not rpc.needs_token(details.method, self._auth_reflection):
            return await continuation(details)
        reason = refusal(details.invocation_metadata, self._tokens)
        if reason is None:
            return await continuation(details)
        self._metrics.observe_rejected("unauthenticated")
        log.debug("call refused", method=details.method[:128], reason=reason)
        return _refuse(reason)
