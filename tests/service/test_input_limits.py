"""Bounded work before admission: size limits checked before tokenizing, and the early
stop for a prompt too long to fit the context, with the issue's sizes (a 15 MiB prompt)."""

from __future__ import annotations

import threading

import grpc
import pytest

from services.api.input_limits import MIB, InputLimits
from services.gen.headrace.v1 import generation_pb2 as pb
from services.server.server_config import ServerConfig
from tests.conftest import fake_engine

TIMEOUT = 60
HUGE_PROMPT = "a " * 7_864_320  # 15 MiB: under the 16 MiB message limit
USER = pb.ChatMessage(role="user", content="Hi")


def _config(**limits) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, limits=InputLimits(**limits))


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _generate(stub, request):
    return list(stub.Generate(request, timeout=TIMEOUT))


def _request(**kwargs) -> pb.GenerateRequest:
    kwargs.setdefault("stopping", pb.StoppingCriteria(max_tokens=2))
    return pb.GenerateRequest(**kwargs)


def test_default_prompt_limit_refuses_the_15_mib_prompt(serve) -> None:
    stub = serve().stub()
    error = _error(lambda: _generate(stub, _request(prompt=HUGE_PROMPT)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"prompt: at most {MIB} bytes (got {len(HUGE_PROMPT)})"
    error = _error(lambda: stub.Tokenize(pb.TokenizeRequest(prompt=HUGE_PROMPT), timeout=TIMEOUT))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _generate(stub, _request(prompt="Hello"))[-1].HasField("complete")


def test_a_prompt_that_cannot_fit_is_never_tokenized(serve) -> None:
    """With the byte limits raised, the context bound refuses it without tokenizing it, and
    two such requests do not hold up a normal one."""
    engine = fake_engine()
    encoded: list[int] = []
    real_encode = engine.tokenizer.encode

    def spy(text: str, *args, **kwargs):
        encoded.append(len(text))
        return real_encode(text, *args, **kwargs)

    engine.tokenizer.encode = spy
    running = serve(engine, config=_config(max_request_bytes=16 * MIB, max_prompt_bytes=16 * MIB))
    stub = running.stub()
    errors: list[grpc.RpcError] = []

    def huge() -> None:
        errors.append(_error(lambda: _generate(stub, _request(prompt=HUGE_PROMPT))))

    threads = [threading.Thread(target=huge) for _ in range(2)]
    for thread in threads:
        thread.start()
    assert _generate(stub, _request(prompt="Hello"))[-1].HasField("complete")
    for thread in threads:
        thread.join(TIMEOUT)
    assert len(errors) == 2
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("prompt: prompt of at least ")
        assert "max_model_len 2048" in error.details()
    assert max(encoded) < 100  # only "Hello" was ever tokenized


@pytest.mark.parametrize(
    ("limits", "request_", "message"),
    [
        ({"max_prompt_bytes": 10}, _request(prompt="x" * 11), "prompt: at most 10 bytes (got 11)"),
        ({"max_prompt_bytes": 10}, _request(prompt="é" * 6), "prompt: at most 10 bytes (got 12)"),
        ({"max_chat_messages": 3}, _request(chat=pb.Chat(messages=[USER] * 4)),
         "chat.messages: at most 3 messages (got 4)"),
        ({}, _request(chat=pb.Chat(messages=[USER] * 300)),
         "chat.messages: at most 256 messages (got 300)"),
        ({"max_chat_bytes": 20}, _request(chat=pb.Chat(messages=[USER] * 4)),
         "chat.messages: at most 20 bytes of role and content (got 24)"),
        ({"max_stop_strings": 2},
         _request(prompt="Hi", stopping=pb.StoppingCriteria(stop=["a", "b", "c"])),
         "stopping.stop: at most 2 strings (got 3)"),
        ({"max_stop_string_chars": 4},
         _request(prompt="Hi", stopping=pb.StoppingCriteria(stop=["abcde"])),
         "stopping.stop: at most 4 characters per string (got 5)"),
        ({"max_request_bytes": 100}, _request(prompt="x" * 200),
         "request: at most 100 bytes (got 207)"),
    ],
)  # fmt: skip
def test_each_limit_is_invalid_argument_naming_the_field(serve, limits, request_, message):
    stub = serve(config=_config(**limits)).stub()
    error = _error(lambda: _generate(stub, request_))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == message


def test_batch_limits_name_the_request(serve) -> None:
    stub = serve(config=_config(max_prompt_bytes=10)).stub()
    batch = pb.GenerateBatchRequest(requests=[_request(prompt="ok"), _request(prompt="x" * 11)])
    error = _error(lambda: list(stub.GenerateBatch(batch, timeout=TIMEOUT)))
    assert error.details() == "requests[1].prompt: at most 10 bytes (got 11)"
    stub = serve(config=_config(max_request_bytes=100)).stub()
    batch = pb.GenerateBatchRequest(requests=[_request(prompt="x" * 60)] * 2)
    error = _error(lambda: list(stub.GenerateBatch(batch, timeout=TIMEOUT)))
    assert error.details().startswith("request: at most 100 bytes")


def test_limits_cannot_exceed_the_engine_caps() -> None:
    with pytest.raises(ValueError, match="max_stop_strings"):
        InputLimits(max_stop_strings=65)
    with pytest.raises(ValueError, match="max_prompt_bytes"):
        InputLimits(max_prompt_bytes=0)
