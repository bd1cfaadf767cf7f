"""Protobuf <-> domain records for the GenerationService (the servicer's two halves).

``to_input`` checks what only the wire shape can tell (a missing input; an empty prompt
or chat, by domain.prompt_form) and builds ``SamplingParams``, whose own rules name a
domain field; ``FieldError`` then names the field by its path in the request. Checks
that need the model (chat roles, prompt length, vocabulary) run in the pipeline; its
field names are mapped to request paths by ``request_field``. Finish reasons become
protobuf here and only here.
"""

from __future__ import annotations

import dataclasses

from compute.core.errors import FieldError
from compute.core.grammar import Constraint
from compute.core.messages import FinishReason, TokenLogprob
from compute.core.sampling_params import SamplingParams, logit_bias_entries
from services.domain import (
    MAX_REQUEST_ID_CHARS,
    ChatMessage,
    Chunk,
    Complete,
    GenerateInput,
    ModelInfo,
    constraint_from,
    prompt_form,
)
from services.gen.headrace.v1 import generation_pb2 as pb

# The optional fields of SamplingParams / StoppingCriteria that map 1:1 onto SamplingParams.
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed",
)  # fmt: skip
_REPEATED_SAMPLING_FIELDS = ("logit_bias",)  # maps, converted by hand below
_STOPPING_FIELDS = (
    "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
    "min_tokens",
)  # fmt: skip
# Where each domain field (SamplingParams, GenerateInput) lives in a GenerateRequest.
_FIELD_PATHS = {
    "token_ids": "token_ids.ids",
    **{name: f"sampling.{name}" for name in _SAMPLING_FIELDS + _REPEATED_SAMPLING_FIELDS},
    **{name: f"stopping.{name}" for name in _STOPPING_FIELDS},
}
# Where each prompt form's content sits in the request (for "must not be empty").
_FORM_PATHS = {"prompt": "prompt", "token_ids": "token_ids.ids", "chat": "chat.messages"}
_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
}


def request_field(field: str) -> str:
    """The request path of a domain field name (``max_tokens`` -> ``stopping.max_tokens``)."""
    head, dot, rest = field.partition(".")
    return _FIELD_PATHS.get(head, head) + dot + rest


def to_input(request: pb.GenerateRequest, request_id: str) -> GenerateInput:
    """A validated GenerateInput; FieldError names the offending request field."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise FieldError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
    return GenerateInput(
        request_id=request_id,
        **_prompt(request),
        params=sampling_params(request),
        priority=request.priority,
        n=request.n or 1,
        constraint=constraint(request),
        cache_salt=request.cache_salt or None,
    )


def constraint(request: pb.GenerateRequest) -> Constraint | None:
    """The request's grammar constraint as asked (compiled, and checked, by stage 1)."""
    if not request.HasField("constraint"):
        return None
    c = request.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise FieldError("constraint", "one of its kinds must be set when it is given")
    return constraint_from(c, kind, f"constraint.{kind}")


def _prompt(request: pb.GenerateRequest | pb.TokenizeRequest) -> dict:
    kind = request.WhichOneof("input")
    if kind is None:
        names = ", ".join(f.name for f in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise FieldError("input", f"one of {names} is required")
    if kind == "prompt":
        forms: dict = {"prompt": request.prompt}
    elif kind == "token_ids":
        forms = {"token_ids": tuple(request.token_ids.ids)}
    else:  # which roles are allowed is the chat template's business (stage 1)
        chat = request.chat
        forms = {"chat": tuple(ChatMessage(role=m.role, content=m.content) for m in chat.messages)}
        if chat.HasField("add_generation_prompt"):
            forms["add_generation_prompt"] = chat.add_generation_prompt
    prompt_form(forms, _FORM_PATHS)
    return forms


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    """SamplingParams from the optional fields (unset ones keep the documented defaults)."""
    sampling, stopping = request.sampling, request.stopping
    values: dict = {
        name: getattr(sampling, name) for name in _SAMPLING_FIELDS if sampling.HasField(name)
    }
    if stopping.HasField("max_tokens"):
        values["max_tokens"] = stopping.max_tokens
    if values.get("top_k") == 0:
        values["top_k"] = -1  # both mean "all tokens"; keep one spelling downstream
    try:
        return SamplingParams(
            **values,
            stop=tuple(stopping.stop),
            stop_token_ids=tuple(stopping.stop_token_ids),
            ignore_eos=stopping.ignore_eos,
            include_stop_str_in_output=stopping.include_stop_str_in_output,
            min_tokens=stopping.min_tokens,
            logit_bias=logit_bias_entries(sampling.logit_bias),
            logprobs=request.logprobs or request.top_logprobs > 0,
            top_logprobs=request.top_logprobs,
        )
    except FieldError as exc:
        raise exc.at(request_field(exc.field)) from None


def chunk_to_pb(chunk: Chunk) -> pb.Chunk:
    tokens, top_tokens = chunk.tokens, chunk.top_tokens
    return pb.Chunk(
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=[
            _logprob_to_pb(
                lp,
                tokens[i] if i < len(tokens) else "",
                top_tokens[i] if i < len(top_tokens) else (),
            )
            for i, lp in enumerate(chunk.logprobs)
        ],
        sample_index=chunk.sample_index,
    )


def _logprob_to_pb(lp: TokenLogprob, token: str, top_tokens: tuple[str, ...]) -> pb.TokenLogprob:
    texts = list(top_tokens) + [""] * (len(lp.top) - len(top_tokens))
    return pb.TokenLogprob(
        token_id=lp.token_id,
        token=token,
        logprob=lp.logprob,
        top_logprobs=[
            pb.TopLogprob(token_id=t, token=text, logprob=v)
            for (t, v), text in zip(lp.top, texts, strict=True)
        ],
    )


def complete_to_pb(complete: Complete) -> pb.Complete:
    usage, timing = complete.usage, complete.timing
    return pb.Complete(
        finish_reason=_FINISH_REASONS.get(complete.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        matched_stop=complete.matched_stop,
        usage=pb.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        ),
        timing=pb.Timing(
            queue_seconds=timing.queue_seconds,
            time_to_first_token_seconds=timing.time_to_first_token_seconds,
            total_seconds=timing.total_seconds,
        ),
        sample_index=complete.sample_index,
    )


def event_fields(event: Chunk | Complete) -> dict:
    """The ``response`` oneof of a Generate/GenerateBatch response for one pipeline event."""
    if isinstance(event, Complete):
        return {"complete": complete_to_pb(event)}
    return {"chunk": chunk_to_pb(event)}


def tokenize_args(request: pb.TokenizeRequest) -> dict:
    """Keyword arguments of Pipeline.tokenize for a TokenizeRequest."""
    return {"prompt": None, "chat": None, **_prompt(request)}


def model_info_to_pb(info: ModelInfo) -> pb.GetModelInfoResponse:
    """Field for field: the record and the message share their names (a test checks)."""
    return pb.GetModelInfoResponse(**dataclasses.asdict(info))
