"""Grammar constraints through both services (headrace.v1 and the vLLM worker protocol),
over the fake engine with the real tokenizer: what reaches the engine, what is refused
(INVALID_ARGUMENT naming the field, with the library's reason), what the servers report;
and the compile stage's cache and time limit. Outputs that match their grammar are the
engine's tests (tests/engine/test_constraints.py) and the gateway's (test_gateway.py).
"""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from compute.core.errors import FieldError
from compute.core.grammar import CompiledGrammar, Constraint
from services.gen.headrace.v1 import generation_pb2 as pb
from services.pipeline.grammar_compile import GrammarConfig, GrammarStage
from tests.conftest import RunningServer
from tests.support.schemas import PERSON

TIMEOUT = 30
STRUCTURAL_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f=w>", "schema": PERSON, "end": "</f>"}],
    "triggers": ["<f="],
}


def _generate(running: RunningServer, **constraint) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        prompt="Hello", stopping=pb.StoppingCriteria(max_tokens=3), **constraint
    )
    return list(running.stub().Generate(request, timeout=TIMEOUT))


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_v1_structural_tag_reaches_the_engine_compiled(served: RunningServer) -> None:
    constraint = pb.Constraint(structural_tag=json.dumps(STRUCTURAL_TAG))
    assert _generate(served, constraint=constraint)[-1].HasField("complete")
    [params] = served.engine.params.values()
    assert params.grammar.constraint.kind == "structural_tag"


def test_v1_constraint_reaches_the_engine_compiled(served: RunningServer) -> None:
    constraint = pb.Constraint(json_schema=json.dumps(PERSON))
    responses = _generate(served, constraint=constraint)
    assert responses[-1].HasField("complete")
    [params] = served.engine.params.values()
    assert params.grammar is not None
    assert params.grammar.constraint == Constraint(
        "json_schema", json.dumps(PERSON), field="constraint.json_schema"
    )


@pytest.mark.parametrize(
    ("constraint", "field", "reason"),
    [
        (pb.Constraint(json_schema="{nope"), "constraint.json_schema", "not valid JSON"),
        (
            pb.Constraint(json_schema='{"type": "array", "uniqueItems": true}'),
            "constraint.json_schema",
            'Unimplemented keys: ["uniqueItems"]',
        ),
        (pb.Constraint(json_schema='{"type": "objectx"}'), "constraint.json_schema", "objectx"),
        (pb.Constraint(regex="a(b"), "constraint.regex", "unclosed group"),
        (pb.Constraint(grammar="start: foo"), "constraint.grammar", "unknown name"),
        (pb.Constraint(choice=pb.Choice()), "constraint.choice.choices", "at least one"),
        (pb.Constraint(json_object=False), "constraint.json_object", "must be true"),
        (pb.Constraint(structural_tag="{}"), "constraint.structural_tag", "'structures'"),
        (
            pb.Constraint(structural_tag='{"structures": [{"begin": "<f>"}], "triggers": ["<g"]}'),
            "constraint.structural_tag",
            "starts with no trigger",
        ),
        (pb.Constraint(), "constraint", "one of its kinds"),
    ],
)
def test_v1_bad_constraints_are_invalid_argument_naming_the_field(
    served: RunningServer, constraint: pb.Constraint, field: str, reason: str
) -> None:
    error = _error(lambda: _generate(served, constraint=constraint))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(field + ":"), error.details()
    assert reason in error.details()
    assert len(error.details()) < 400  # the library's reason is capped
    assert served.pipeline.num_pending == 0
    _generate(served)  # the next request is served


@pytest.mark.parametrize(
    ("stopping", "field"),
    [({"ignore_eos": True}, "stopping.ignore_eos"), ({"min_tokens": 3}, "stopping.min_tokens")],
)
def test_v1_constraint_with_ignore_eos_or_min_tokens_is_refused(
    served: RunningServer, stopping: dict, field: str
) -> None:
    """A grammar that has ended allows only EOS: neither may forbid it."""
    request = pb.GenerateRequest(
        prompt="Hi",
        stopping=pb.StoppingCriteria(**stopping),
        constraint=pb.Constraint(regex="a+"),
    )
    error = _error(lambda: list(served.stub().Generate(request, timeout=TIMEOUT)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details()
    _generate(served)  # the next request is served


def test_v1_model_info_reports_the_constraints(served: RunningServer) -> None:
    info = served.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert set(info.constraint_kinds) == {
        "json_schema",
        "json_object",
        "regex",
        "grammar",
        "choice",
        "structural_tag",
    }
    assert info.grammar_library.startswith("llguidance ")
    assert info.grammar_compile_timeout_seconds > 0 and info.grammar_cache_size > 0
    assert info.max_constraint_chars == 64 * 1024


def _worker_request(**sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="w1",
        tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vpb.SamplingParams(max_tokens=3, **sampling),
    )


@pytest.mark.parametrize(
    ("sampling", "kind"),
    [
        ({"json_schema": json.dumps(PERSON), "grammar_from_first_token": True}, "json_schema"),
        ({"json_object": True}, "json_object"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"grammar": 'root ::= "yes" | "no"'}, "grammar"),
        ({"choice": vpb.ChoiceConstraint(choices=["a", "b"])}, "choice"),
        ({"structural_tag": json.dumps(STRUCTURAL_TAG)}, "structural_tag"),
    ],
)
def test_worker_maps_every_constraint(served: RunningServer, sampling: dict, kind: str) -> None:
    stub = vpb_grpc.VllmEngineStub(served.channel())
    responses = list(stub.Generate(_worker_request(**sampling), timeout=TIMEOUT))
    assert responses[-1].HasField("complete")
    [params] = served.engine.params.values()
    assert params.grammar.constraint.kind == kind


def test_worker_server_info_says_grammars_start_at_the_first_token(served) -> None:
    stub = vpb_grpc.VllmEngineStub(served.channel())
    info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert info.constrained_decoding_start == "first_token"


class _SlowCompiler:
    """Counts compiles; each waits for ``release`` (or fails when ``bad``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def warm_up(self) -> None:
        pass

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        self.calls += 1
        if constraint.text == "bad":
            raise FieldError(constraint.field, "the library's reason")
        self.release.wait(10)
        return CompiledGrammar(constraint, object())


def test_compile_stage_times_out_caches_by_text_and_bounds_the_cache() -> None:
    compiler = _SlowCompiler()
    stage = GrammarStage(compiler, GrammarConfig(workers=1, timeout_s=0.2, cache_size=2))

    async def scenario() -> None:
        slow = Constraint("regex", "a+", field="constraint.regex")
        with pytest.raises(FieldError, match="did not compile within 0.2 s") as info:
            await stage.compile(slow)
        assert info.value.field == "constraint.regex"
        compiler.release.set()  # the compile ends in the background; its result is cached
        compiled = await stage.compile(slow)
        assert (await stage.compile(slow)) is compiled and compiler.calls == 1
        bad = Constraint("regex", "bad", field="sampling_params.regex")
        for _ in range(2):  # a bad text's failure is cached too, under the asker's field
            with pytest.raises(FieldError, match="the library's reason") as info:
                await stage.compile(bad)
            assert info.value.field == "sampling_params.regex"
        assert compiler.calls == 2
        await stage.compile(Constraint("regex", "c"))  # evicts the least recently used
        assert stage.cache_len() == 2
        await stage.compile(slow)
        assert compiler.calls == 4

    try:
        asyncio.run(scenario())
    finally:
        stage.shutdown()
