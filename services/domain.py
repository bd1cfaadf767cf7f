"""Domain records between the gRPC servicers and the pipeline (no protobuf here): the
ground floor of services/, which every role folder may read.

Each servicer converts protobuf -> these records, calls the pipeline, and
converts the events it yields back to protobuf. Errors travel as
``RequestError`` subclasses (a bad field: compute.core.errors.FieldError), mapped to
status codes in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from compute.core.errors import FieldError, RequestError
from compute.core.grammar import Constraint
from compute.core.messages import FinishReason, TokenLogprob
from compute.core.sampling_params import SamplingParams

MAX_REQUEST_ID_CHARS = 128  # a client's request id, on either protocol


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user", "assistant", "tool" (checked against the template's roles)
    content: str


@dataclass(frozen=True)
class GenerateInput:
    """Exactly one of prompt, token_ids, chat is set."""

    request_id: str
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    n: int = 1  # samples of the prompt (services/pipeline/samples.py); 1..PipelineConfig.max_n
    constraint: Constraint | None = None  # compiled by stage 1 into params.grammar
    # Prefix-cache namespace: KV blocks are shared only between requests of the same salt
    # and tenant (compute/core/prefix_cache.py cache_namespace); the tenant comes from the
    # caller's credentials under --cache-isolation token
    # (services/security/cache_isolation.py). None, None: the shared cache.
    cache_salt: str | None = None
    tenant: str | None = None


PROMPT_FORMS = ("prompt", "token_ids", "chat")


def prompt_form(forms: Mapping[str, object], paths: Mapping[str, str] | None = None) -> str:
    """Which of prompt, token_ids and chat carries the prompt in ``forms`` (GenerateInput's
    fields): the one rule every adapter and stage applies. FieldError unless exactly one is
    set and it is not empty, the field named by ``paths`` (the caller's request) if given."""
    given = [f for f in PROMPT_FORMS if forms.get(f) is not None]
    if len(given) != 1:
        raise FieldError("prompt", "exactly one of prompt, token_ids and chat must be set")
    if not forms[given[0]]:
        raise FieldError((paths or {}).get(given[0], given[0]), "must not be empty")
    return given[0]


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the last chunk: whole UTF-8, never part of a stop string
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    tokens: tuple[str, ...] = ()  # text of each logprobs entry's token (same order)
    top_tokens: tuple[tuple[str, ...], ...] = ()  # text of each entry's alternatives
    sample_index: int = 0  # which of the request's n samples (0 when n == 1)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Timing:
    queue_seconds: float  # arrival -> first scheduled
    time_to_first_token_seconds: float
    total_seconds: float
    tokenize_seconds: float = 0.0  # arrival -> tokenized (stage 1 done, handed to stage 2)
    arrival: float = 0.0  # time.monotonic() at admission, where the durations start


@dataclass(frozen=True)
class Complete:
    finish_reason: FinishReason  # STOP or LENGTH (aborts never reach a client)
    matched_stop: str  # the stop string or "" (stop token ids are reported as "")
    usage: Usage
    timing: Timing
    sample_index: int = 0  # which of the request's n samples ended (0 when n == 1)


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    block_size: int
    kv_cache_capacity_tokens: int
    kv_cache_dtype: str  # --kv-cache-dtype as it took effect: float32, float16, bfloat16, int8
    weights: str = "dense"  # --weights as it took effect: dense, quantized, quantized-int8
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # captured decode graphs (--cuda-graphs)
    async_output: bool = False  # --async-output as it took effect
    # Grammar constraints (services/pipeline/grammar_compile.py); none without a tokenizer.
    constraint_kinds: tuple[str, ...] = ()
    grammar_library: str = ""
    grammar_compile_timeout_seconds: float = 0.0
    grammar_cache_size: int = 0
    max_constraint_chars: int = 0
    # The architecture deltas in use (compute.core.config.ModelConfig.features).
    rope_type: str = "default"
    sliding_window: int = 0  # 0 = no sliding layer
    sliding_window_layers: int = 0
    num_layers: int = 0
    attn_logit_softcapping: float = 0.0  # 0 = none
    final_logit_softcapping: float = 0.0
    features: tuple[str, ...] = ()


class ResourceExhausted(RequestError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(RequestError):
    code = "UNAVAILABLE"


class EngineFault(RequestError):
    code = "INTERNAL"


def constraint_from(message: Any, kind: str, field: str) -> Constraint:
    """The grammar constraint a protobuf message carries in its oneof, whose set member is
    ``kind`` and is reported as ``field`` (the rule both protocols share: json_object must
    be true, choice lists its strings, every other kind carries its text)."""
    if kind == "json_object":
        if not message.json_object:
            raise FieldError(field, "must be true when set")
        return Constraint(kind, field=field)
    if kind == "choice":
        return Constraint(kind, choices=tuple(message.choice.choices), field=f"{field}.choices")
    return Constraint(kind, getattr(message, kind), field=field)
