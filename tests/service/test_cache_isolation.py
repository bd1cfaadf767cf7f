"""Per-tenant prefix caches: ``cache_salt`` (headrace.v1), ``x-cache-salt`` (worker
protocol) and ``--cache-isolation token``, over the real engine on dummy weights.

Two tenants sending the same long prompt must get 0 ``cached_prompt_tokens`` from each
other's blocks, while each tenant's own repeats hit the cache as before. Without the salt
in the block keys the second tenant would be served the first one's blocks (the
``cached`` counts below would be 48, not 0).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as worker_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as worker_grpc

from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc
from services.security.security_config import SecurityConfig
from services.server.server_config import ServerConfig
from tests.conftest import RunningServer
from tests.service.test_worker_kv_events import BLOCK, prompt, tiny_engine

TIMEOUT = 30
CACHEABLE = 3 * BLOCK  # prompt(seed) holds three full blocks and one token


def cached(
    running: RunningServer, ids: list[int], salt: str | None = None, token: str | None = None
) -> int:
    """``usage.cached_prompt_tokens`` of a headrace.v1 Generate."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        stopping=pb.StoppingCriteria(max_tokens=1, ignore_eos=True),
        cache_salt=salt,
    )
    metadata = [("authorization", f"Bearer {token}")] if token else None
    stub = pb_grpc.GenerationServiceStub(running.channel())
    *_, last = stub.Generate(request, timeout=TIMEOUT, metadata=metadata)
    return last.complete.usage.cached_prompt_tokens


def worker_cached(running: RunningServer, ids: list[int], salt: str | None = None) -> int:
    request = worker_pb.GenerateRequest(
        request_id=f"w{len(ids)}-{salt}",
        tokenized=worker_pb.TokenizedInput(input_ids=ids),
        sampling_params=worker_pb.SamplingParams(max_tokens=1, ignore_eos=True),
    )
    metadata = [("x-cache-salt", salt)] if salt else None
    stub = worker_grpc.VllmEngineStub(running.channel())
    *_, last = stub.Generate(request, timeout=TIMEOUT, metadata=metadata)
    return last.complete.cached_tokens


@pytest.fixture
def tiny(serve) -> RunningServer:
    return serve(tiny_engine())


def test_different_salts_get_nothing_from_each_other(tiny) -> None:
    ids = prompt(1)
    assert cached(tiny, ids, "tenant-a") == 0
    assert cached(tiny, ids, "tenant-b") == 0  # the same prompt, another namespace
    assert cached(tiny, ids) == 0  # the shared cache is one more
    assert cached(tiny, ids, "tenant-a") == CACHEABLE  # within a tenant: as before
    assert cached(tiny, ids) == CACHEABLE


def test_the_worker_protocol_takes_the_salt_from_call_metadata(tiny) -> None:
    ids = prompt(2)
    assert worker_cached(tiny, ids, "x") == 0
    assert worker_cached(tiny, ids, "y") == 0
    assert worker_cached(tiny, ids, "x") == CACHEABLE
    assert cached(tiny, ids, "x") == CACHEABLE  # one namespace whichever protocol names it


def test_a_salt_longer_than_256_characters_is_refused_naming_it(tiny) -> None:
    with pytest.raises(grpc.RpcError) as info:
        cached(tiny, prompt(3), "s" * 257)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("cache_salt:")


def _token_server(serve, tmp_path: Path) -> RunningServer:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nbob-token\n")
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        cache_isolation="token",
        security=SecurityConfig(auth_token_file=str(tokens)),
    )
    return serve(tiny_engine(), config)


def test_token_isolation_keeps_each_bearer_token_to_its_own_cache(serve, tmp_path) -> None:
    running = _token_server(serve, tmp_path)
    ids = prompt(4)
    assert cached(running, ids, token="alice-token") == 0
    assert cached(running, ids, token="bob-token") == 0  # bob never sees alice's blocks
    assert cached(running, ids, token="bob-token", salt="") == CACHEABLE
    assert cached(running, ids, token="alice-token") == CACHEABLE
    # A salt divides a tenant's cache further, and never reaches another tenant's.
    assert cached(running, ids, token="alice-token", salt="s") == 0
    assert cached(running, ids, token="bob-token", salt="s") == 0


def test_token_isolation_needs_token_auth() -> None:
    with pytest.raises(ValueError, match="--cache-isolation token needs --auth-token-file"):
        ServerConfig(cache_isolation="token")
    with pytest.raises(ValueError, match="cache_isolation must be one of none, token"):
        ServerConfig(cache_isolation="tenant")
