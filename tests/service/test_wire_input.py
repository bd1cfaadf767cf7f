"""Malformed wire input: bytes that do not parse are INVALID_ARGUMENT with a plain message
on every RPC (health and reflection included), and no message echoes unbounded input."""

from __future__ import annotations

import grpc
import pytest

from services.gen.headrace.v1 import generation_pb2 as pb
from services.server.status import MALFORMED_MESSAGE

TIMEOUT = 30
GENERATE = "/headrace.v1.GenerationService/Generate"
BATCH = "/headrace.v1.GenerationService/GenerateBatch"
TOKENIZE = "/headrace.v1.GenerationService/Tokenize"
INFO = "/headrace.v1.GenerationService/GetModelInfo"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def _patched(message, placeholder: bytes, bad: bytes) -> bytes:
    data = message.SerializeToString()
    assert data.count(placeholder) == 1
    return data.replace(placeholder, bad)


def _chat(content: str) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role="user", content=content)])


GOOD = pb.GenerateRequest(prompt="hello there").SerializeToString()
MALFORMED = [
    (GENERATE, _patched(pb.GenerateRequest(prompt="hello XX world"), b"XX", b"\xff\xfe")),
    (GENERATE, _patched(pb.GenerateRequest(chat=_chat("QQ")), b"QQ", b"\xc3\x28")),
    (GENERATE, GOOD[:-3]),  # truncated
    (GENERATE, b"\xff\xff\xff\xff"),  # corrupt
    (BATCH, _patched(pb.GenerateBatchRequest(requests=[pb.GenerateRequest(prompt="XX")]),
                     b"XX", b"\xff\xfe")),
    (TOKENIZE, _patched(pb.TokenizeRequest(prompt="hello XX"), b"XX", b"\xff\xfe")),
    (TOKENIZE, b"\x0a\x80"),  # truncated length prefix
    (INFO, b"\xff\xff\xff\xff"),
    (HEALTH_CHECK, b"\x0a\x02\xff\xfe"),  # service name, not UTF-8
    (HEALTH_WATCH, b"\x0a\x02\xff\xfe"),
]  # fmt: skip


def _raw(channel: grpc.Channel, method: str, streaming: bool):
    kind = channel.unary_stream if streaming else channel.unary_unary
    return kind(method, request_serializer=None, response_deserializer=None)


@pytest.mark.parametrize(("method", "data"), MALFORMED)
def test_malformed_bytes_are_invalid_argument(served, method: str, data: bytes) -> None:
    streaming = method in (GENERATE, BATCH, HEALTH_WATCH)
    call = _raw(served.channel(), method, streaming)
    with pytest.raises(grpc.RpcError) as info:
        response = call(data, timeout=TIMEOUT)
        if streaming:
            list(response)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == MALFORMED_MESSAGE
    assert served.pipeline.num_pending == 0


def test_malformed_reflection_request_is_invalid_argument(served) -> None:
    call = served.channel().stream_stream(
        REFLECTION, request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as info:
        list(call(iter([b"\x1a\x02\xff\xfe"]), timeout=TIMEOUT))  # list_services, not UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == MALFORMED_MESSAGE


def test_the_server_still_serves_after_malformed_input(served) -> None:
    for method, data in MALFORMED[:4]:
        with pytest.raises(grpc.RpcError):
            list(_raw(served.channel(), method, True)(data, timeout=TIMEOUT))
    responses = list(
        served.stub().Generate(
            pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_tokens=2)),
            timeout=TIMEOUT,
        )
    )
    assert responses[-1].HasField("complete")


def test_a_huge_chat_role_is_not_echoed(served) -> None:
    # A client with default settings must see the real error, not a metadata overflow.
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="r" * 100_000)]))
    with pytest.raises(grpc.RpcError) as info:
        list(served.stub().Generate(request, timeout=TIMEOUT))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert details.startswith("chat.messages[0].role: ") and len(details) < 200
    assert "Error" not in details and "<class" not in details
