"""The RPC table: which gRPC methods each interceptor applies to (the one table they all
read), and the interceptors' own types.

    method                               token    drain gate  status mapping  traced
    /headrace.v1.GenerationService/*     needed   gated       mapped          yes
    /vllm.grpc.engine.VllmEngine/Generate needed  gated       mapped          yes
    /vllm.grpc.engine.VllmEngine/Abort   needed   open        mapped          yes
    /vllm.grpc.engine.VllmEngine/*       needed   open        mapped          no (polls)
    /grpc.health.v1.Health/*             open     open        its own         no
    /grpc.reflection.*                   needed*  open        its own         no

    * open with ``--no-auth-reflection``.

Abort, health and the worker protocol's info calls keep answering while draining (a
gateway keeps polling a draining worker); the worker protocol's polls (GetLoads every
10 s, HealthCheck...) would drown the traces, so only its request-carrying calls get spans.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

import grpc

SERVICE = "/headrace.v1.GenerationService/"
WORKER = "/vllm.grpc.engine.VllmEngine/"  # services/worker
HEALTH = "/grpc.health.v1.Health/"
REFLECTION = "/grpc.reflection."  # v1alpha and v1

# What an interceptor wraps a handler in, and what it calls to reach the next one.
Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]

_GATED = (SERVICE, WORKER + "Generate")
_MAPPED = (SERVICE, WORKER)
_WORKER_TRACED = (WORKER + "Generate", WORKER + "Abort")


def needs_token(method: str, auth_reflection: bool) -> bool:
    return not method.startswith((HEALTH,) if auth_reflection else (HEALTH, REFLECTION))


def gated(method: str) -> bool:
    return method.startswith(_GATED)


def mapped(method: str) -> bool:
    return method.startswith(_MAPPED)


def traced(method: str) -> bool:
    return method.startswith(SERVICE) or method in _WORKER_TRACED
