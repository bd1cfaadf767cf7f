"""The headrace.v1 contract: committed generated code is current, buf lint passes, and
every message, field, enum value and RPC carries a comment (the proto is the user's
reference)."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from services import codegen
from services.gen.headrace.v1 import generation_pb2 as pb

BUF = Path(codegen.ROOT / ".venv" / "bin" / "buf")


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_generated_code_is_current(tmp_path: Path) -> None:
    codegen.generate(tmp_path / "gen")
    fresh, committed = _files(tmp_path / "gen"), _files(codegen.GEN_ROOT)
    assert sorted(fresh) == sorted(committed), "run `make proto` (file set differs)"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    # The output embeds the grpcio-tools/protobuf versions, so pin grpcio-tools.
    versions = f"(grpcio-tools {importlib.metadata.version('grpcio-tools')} installed)"
    assert not stale, f"services/gen is stale, run `make proto` {versions}: {stale}"


def test_generated_code_imports_as_a_package() -> None:
    from services.gen.headrace.v1 import generation_pb2_grpc

    assert generation_pb2_grpc.GenerationServiceStub
    assert pb.DESCRIPTOR.package == "headrace.v1"


def test_buf_lint_passes() -> None:
    buf = shutil.which("buf") if not BUF.exists() else str(BUF)
    if buf is None:
        pytest.skip("buf is not installed (pip install buf-bin)")
    result = subprocess.run(
        [buf, "lint"], cwd=codegen.PROTO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _source_info(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "api.pb"
    args = [
        "protoc",
        f"-I{codegen.PROTO_ROOT}",
        f"--descriptor_set_out={out}",
        "--include_source_info",
        *(str(p) for p in codegen.proto_files()),
    ]
    assert protoc.main(args) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _undocumented(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    commented = {
        tuple(loc.path)
        for loc in file.source_code_info.location
        if loc.leading_comments.strip() or loc.trailing_comments.strip()
    }
    missing = []
    # Descriptor paths: 4 = message_type, 5 = enum_type, 6 = service; then 2 = their
    # field / value / method.
    for i, message in enumerate(file.message_type):
        missing += [message.name] if (4, i) not in commented else []
        missing += [
            f"{message.name}.{field.name}"
            for j, field in enumerate(message.field)
            if (4, i, 2, j) not in commented
        ]
    for i, enum in enumerate(file.enum_type):
        missing += [enum.name] if (5, i) not in commented else []
        missing += [v.name for j, v in enumerate(enum.value) if (5, i, 2, j) not in commented]
    for i, service in enumerate(file.service):
        missing += [service.name] if (6, i) not in commented else []
        missing += [m.name for j, m in enumerate(service.method) if (6, i, 2, j) not in commented]
    return missing


def test_every_element_is_documented(tmp_path: Path) -> None:
    for file in _source_info(tmp_path).file:
        assert _undocumented(file) == [], f"{file.name}: add comments"


def test_api_names_are_the_agreed_ones() -> None:
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    methods = {m.name: (m.input_type.name, m.output_type.name) for m in service.methods}
    assert methods == {
        "Generate": ("GenerateRequest", "GenerateResponse"),
        "GenerateBatch": ("GenerateBatchRequest", "GenerateBatchResponse"),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse"),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse"),
    }
    assert service.methods_by_name["Generate"].server_streaming
    assert service.methods_by_name["GenerateBatch"].server_streaming
    request = pb.GenerateRequest.DESCRIPTOR
    assert [f.name for f in request.oneofs_by_name["input"].fields] == [
        "prompt",
        "token_ids",
        "chat",
    ]
    assert pb.FinishReason.Name(1) == "FINISH_REASON_STOP"
    assert pb.FinishReason.Name(2) == "FINISH_REASON_LENGTH"


def test_model_info_record_and_message_share_their_fields() -> None:
    # services/api/convert.py maps the record onto the message by name (asdict): a field
    # added to one and not the other must fail here, not at the first GetModelInfo.
    import dataclasses

    from services.domain import ModelInfo

    record = {f.name for f in dataclasses.fields(ModelInfo)}
    message = set(pb.GetModelInfoResponse.DESCRIPTOR.fields_by_name)
    assert record == message
