"""vLLM-protocol messages <-> headrace domain records.

Sampling fields follow the protocol's own semantics: ``optional`` fields are unset
when absent; plain proto3 scalars use 0 for "not set" exactly as vLLM's gRPC server
reads them (top_p 0 -> 1.0, top_k 0 -> all, repetition_penalty 0 -> 1.0, n 0 -> 1).
Anything headrace cannot do is refused with FieldError naming the field
(``sampling_params.prompt_logprobs``), never dropped. ``n`` > 1 is answered in the one
stream, each chunk and GenerateComplete with its sample's ``index`` (one Complete per
sample, as SMG collects them). skip_special_tokens and
spaces_between_special_tokens only shape text, and the gateway detokenizes itself
from the token ids this worker returns, so they do not change what is sent back.
"""

from __future__ import annotations

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from compute.core.errors import FieldError
from compute.core.grammar import Constraint
from compute.core.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, logit_bias_entries
from services.domain import (
    MAX_REQUEST_ID_CHARS,
    Chunk,
    Complete,
    GenerateInput,
    constraint_from,
    prompt_form,
)

SP = "sampling_params"
# Where the pipeline's domain field names live in a vLLM GenerateRequest.
_INPUT_PATHS = {"token_ids": "tokenized.input_ids", "prompt": "text"}
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) | {"logprobs", "n"}
# Fields of GenerateRequest headrace has no engine for: set -> INVALID_ARGUMENT.
_UNSUPPORTED_REQUEST = ("kv_transfer_params", "mm_inputs", "media_refs", "kv_transfer_params_json")


def to_input(request: pb.GenerateRequest) -> GenerateInput:
    """A validated GenerateInput; FieldError names the offending request field."""
    if not request.request_id:
        raise FieldError("request_id", "must not be empty")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise FieldError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
    for name in _UNSUPPORTED_REQUEST:
        if request.HasField(name):
            raise FieldError(name, "not supported by headrace")
    if request.extra_mm_inputs:
        raise FieldError("extra_mm_inputs", "not supported by headrace (text-only model)")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise FieldError("data_parallel_rank", "headrace runs one data-parallel rank (0)")
    return GenerateInput(
        request_id=request.request_id,
        **_prompt(request),
        params=sampling_params(request),
        n=request.sampling_params.n or 1,  # 0 = unset = one sample, as vLLM reads it
        constraint=constraint(request.sampling_params),
    )


def constraint(sp: pb.SamplingParams) -> Constraint | None:
    """``SamplingParams.constraint`` as asked (stage 1 compiles it). headrace runs no
    reasoning parser: a grammar starts at the first generated token whether or not
    ``grammar_from_first_token`` says so (GetServerInfo: constrained_decoding_start)."""
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    return constraint_from(sp, kind, f"{SP}.{kind}")


def _prompt(request: pb.GenerateRequest) -> dict:
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        forms: dict = {"token_ids": tuple(request.tokenized.input_ids)}
    elif kind == "text":
        forms = {"prompt": request.text}
    else:
        raise FieldError("input", "set one of tokenized, text")
    prompt_form(forms, _INPUT_PATHS)
    return forms


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    sp = request.sampling_params
    _refuse_unsupported(sp)
    fields = dict(
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k or -1,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty or 1.0,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        min_tokens=sp.min_tokens,
        logit_bias=logit_bias_entries(sp.logit_bias),
        **_logprobs(sp),
    )
    try:
        return SamplingParams(**fields)
    except FieldError as exc:
        raise exc.at(request_field(exc.field)) from None


def request_field(field: str) -> str:
    """The request path of a domain field name (``top_p`` -> ``sampling_params.top_p``)."""
    head, dot, rest = field.partition(".")
    if head in _INPUT_PATHS:
        return _INPUT_PATHS[head] + dot + rest
    return f"{SP}.{field}" if head in _SAMPLING_FIELDS else field


def _refuse_unsupported(sp: pb.SamplingParams) -> None:
    if sp.HasField("prompt_logprobs"):
        raise FieldError(f"{SP}.prompt_logprobs", "not supported by headrace")
    if sp.HasField("truncate_prompt_tokens"):
        raise FieldError(f"{SP}.truncate_prompt_tokens", "not supported by headrace")


def _logprobs(sp: pb.SamplingParams) -> dict:
    """vLLM's ``logprobs=k``: the sampled token's logprob plus k alternatives."""
    if not sp.HasField("logprobs"):
        return {}
    if not 0 <= sp.logprobs <= MAX_TOP_LOGPROBS:
        raise FieldError(f"{SP}.logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}] (-1 = all is not)")
    return {"logprobs": True, "top_logprobs": sp.logprobs}


def output_logprobs(chunk_or_list) -> pb.OutputLogProbs | None:
    """The protocol's OutputLogProbs of some TokenLogprob entries (None when there are none)."""
    entries = list(chunk_or_list)
    if not entries:
        return None
    return pb.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=[
            pb.TopLogProbs(values=[lp for _, lp in e.top], token_ids=[t for t, _ in e.top])
            for e in entries
        ],
    )


def chunk_to_pb(chunk: Chunk, prompt_tokens: int, completion_tokens: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(
            token_ids=chunk.token_ids,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            output_logprobs=output_logprobs(chunk.logprobs),
            index=chunk.sample_index,
        )
    )


def complete_to_pb(
    complete: Complete, output_ids: list[int], logprobs: list | None = None
) -> pb.GenerateResponse:
    """The final message; ``output_ids`` are the tokens not already sent in chunks."""
    done = pb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=str(complete.finish_reason),  # FinishReason is a StrEnum: "stop"
        prompt_tokens=complete.usage.prompt_tokens,
        completion_tokens=complete.usage.completion_tokens,
        cached_tokens=complete.usage.cached_prompt_tokens,
        output_logprobs=output_logprobs(logprobs or ()),
        index=complete.sample_index,
    )
    if complete.matched_stop:
        done.matched_stop_str = complete.matched_stop
    return pb.GenerateResponse(complete=done)


def aborted_pb(prompt_tokens: int, completion_tokens: int, index: int = 0) -> pb.GenerateResponse:
    """What an Abort RPC ends a sample's stream with (vLLM's finish_reason "abort")."""
    return pb.GenerateResponse(
        complete=pb.GenerateComplete(
            finish_reason="abort",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            index=index,
        )
    )
