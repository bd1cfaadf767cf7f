"""GetTokenizer, StartProfile and StopProfile against the generated stubs (in-process).

GetTokenizer streams the zip a gateway that cannot read the replica's files builds its
tokenizer from: exactly the files ``headrace export-tokenizer`` writes (the operator's
chat template included), chunked, the sha256 of the whole zip on the last chunk. The
profile calls write sampled thread stacks into ``--profile-dir``, and are refused with
FAILED_PRECONDITION naming the flag when it is not set.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from services.server.server_config import ServerConfig
from services.worker.tokenizer_bundle import TokenizerBundle
from services.worker.tokenizer_export import FILES, export_tokenizer
from tests.conftest import RunningServer, fake_engine

TIMEOUT = 30
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def stub(running: RunningServer) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(running.channel())


def error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def fetch_tokenizer(running: RunningServer) -> tuple[list[common_pb2.GetTokenizerChunk], bytes]:
    chunks = list(stub(running).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT))
    return chunks, b"".join(c.data for c in chunks)


def test_get_tokenizer_streams_the_exported_files_zipped_with_their_digest(
    serve, tmp_path: Path
) -> None:
    engine = fake_engine()
    engine.tokenizer = engine.tokenizer.with_chat_template(TEMPLATE)  # as --chat-template does
    running = serve(engine)
    chunks, data = fetch_tokenizer(running)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(c.sha256 == "" for c in chunks[:-1])
    export_tokenizer(engine.tokenizer, tmp_path, running.pipeline.model_info().max_model_len)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert sorted(archive.namelist()) == sorted(FILES)  # at the root, as SMG extracts
        for name in FILES:  # byte for byte what export-tokenizer writes
            assert archive.read(name) == (tmp_path / name).read_bytes()
        assert json.loads(archive.read("tokenizer_config.json"))["chat_template"] == TEMPLATE
    assert fetch_tokenizer(running)[1] == data  # the same bytes every time


def test_the_bundle_is_chunked_with_the_digest_on_the_last_chunk_only() -> None:
    text = " ".join(str(i * 7919 % 10007) for i in range(3000))  # does not compress away
    bundle = TokenizerBundle.of({"b.json": text, "a.json": "y"})
    chunks = list(bundle.chunks(size=1000))
    assert len(chunks) > 1 and b"".join(d for d, _ in chunks) == bundle.data
    assert [bool(s) for _, s in chunks] == [False] * (len(chunks) - 1) + [True]
    assert TokenizerBundle.of({"a.json": "y", "b.json": text}) == bundle  # deterministic


def test_get_tokenizer_without_a_tokenizer_is_a_failed_precondition(serve) -> None:
    from tests.support.fake_engine import FakeEngine

    running = serve(FakeEngine(None, [5]))
    failure = error(lambda: fetch_tokenizer(running))
    assert failure.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--tokenizer-path" in failure.details()


def test_profiling_is_refused_without_a_profile_dir(served: RunningServer) -> None:
    for call in (
        lambda: stub(served).StartProfile(common_pb2.StartProfileRequest(), timeout=TIMEOUT),
        lambda: stub(served).StopProfile(common_pb2.StopProfileRequest(), timeout=TIMEOUT),
    ):
        failure = error(call)
        assert failure.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--profile-dir" in failure.details()


@pytest.fixture
def profiled(serve, tmp_path: Path) -> RunningServer:
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, profile_dir=str(tmp_path))
    return serve(fake_engine(step_delay=0.002), config)


def test_a_profile_of_the_step_loop_lands_in_the_profile_dir(profiled, tmp_path: Path) -> None:
    api = stub(profiled)
    started = api.StartProfile(common_pb2.StartProfileRequest(output_dir="run1"), timeout=TIMEOUT)
    assert started.success and str(tmp_path / "run1") in started.message
    again = error(lambda: api.StartProfile(common_pb2.StartProfileRequest(), timeout=TIMEOUT))
    assert again.code() == grpc.StatusCode.FAILED_PRECONDITION
    request = pb.GenerateRequest(
        request_id="p",
        tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=pb.SamplingParams(max_tokens=50, ignore_eos=True),
    )
    list(api.Generate(request, timeout=TIMEOUT))
    stopped = api.StopProfile(common_pb2.StopProfileRequest(), timeout=TIMEOUT)
    assert stopped.success
    (folded,) = (tmp_path / "run1").glob("*.folded")
    (summary,) = (tmp_path / "run1").glob("*.txt")
    stacks = folded.read_text().splitlines()
    assert any(line.startswith("headrace-step-loop;") for line in stacks)
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in stacks)  # "frames count"
    assert "== headrace-step-loop:" in summary.read_text()
    stop_again = error(lambda: api.StopProfile(common_pb2.StopProfileRequest(), timeout=TIMEOUT))
    assert stop_again.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"activities": ["CPU", "GPU"]}, "activities"),
        ({"num_steps": 5}, "num_steps"),
        ({"start_step": 2}, "start_step"),
        ({"output_dir": "/etc"}, "output_dir"),
        ({"output_dir": "../out"}, "output_dir"),
    ],
)
def test_what_a_stack_sampler_cannot_do_is_refused_naming_the_field(
    profiled, fields, named
) -> None:
    request = common_pb2.StartProfileRequest(**fields)
    failure = error(lambda: stub(profiled).StartProfile(request, timeout=TIMEOUT))
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.details().startswith(f"{named}:")
