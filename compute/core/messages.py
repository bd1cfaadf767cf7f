"""Every record that crosses a stage boundary of the serving pipeline, in one place.

Stage 1 (tokenize) -> stage 2 (step loop): ``AddRequest``; the facade and stage 3 ->
stage 2: ``Abort``; stage 2 -> stage 3: ``StepOutputs`` (one per engine step, carrying the
scheduler's ``RequestOutput`` records as they were made, and an ``EngineStats`` snapshot)
and ``RequestFailed``; ``Shutdown`` ends a stage's loop. Operations: the facade -> stage 2
``FlushPrefixCache``; stage 2 -> the KV-event hub (services/pipeline/kv_event_hub.py)
``CacheUpdate`` (each step's prefix-cache events and stats) and ``CacheFlushed``.
Records are frozen and hold ints, strs, floats, enums and tuples of them (plus the
frozen ``SamplingParams``): never tensors, never asyncio objects, so a stage could move to
another process unchanged. One exception:
a constrained request's ``SamplingParams.grammar`` holds llguidance's compiled matcher (a
native object, shared read-only by the requests of the same text), which a move to another
process would have to send as its grammar text and compile again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from compute.core.kv_events import KvEvent
from compute.core.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # client cancel, deadline, disconnect, engine fault


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one sampled token, and the best alternatives when asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, not the whole text)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob | None, ...]  # parallel to new_token_ids
    finished: bool
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS/stop token that finished it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_output_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() of its first step


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state right after a step (gauges) and its cumulative counts."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_free_blocks: int  # free + cached-but-unreferenced (evictable)
    block_size: int
    kv_usage: float  # fraction of blocks owned by live sequences
    kv_slots_allocated: int  # block_size * blocks owned by live sequences
    kv_slots_used: int  # tokens those sequences actually hold
    num_preemptions: int  # cumulative
    prefix_cache_hit_tokens: int  # cumulative
    prompt_tokens: int  # cumulative prompt tokens computed
    generation_tokens: int  # cumulative tokens sampled
    # Speculative decoding, cumulative: draft tokens scored, draft tokens accepted, tokens
    # emitted by the steps that verified a draft (accepted + one per verification).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    # n > 1, cumulative: samples admitted by forking their first sample's prompt blocks,
    # and those admitted as any other request (it was gone or not running by then).
    samples_forked: int = 0
    samples_not_forked: int = 0
    # Prompt tokens of the live requests that have produced no output token yet: the
    # prefill work in hand (a gateway allows for it before calling the engine silent).
    prefill_pending_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A validated, tokenized request, ready for ``Engine.add_request``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    arrival_time: float  # time.monotonic() when the pipeline admitted it
    # n > 1 (services/pipeline/samples.py): the request of the same prompt whose prompt KV
    # blocks this one shares if that one is still running then (compute/core/scheduler.py).
    fork_of: str | None = None
    # The request's prefix-cache namespace (a tenant's): it shares KV blocks only with
    # requests of the same salt (compute/core/prefix_cache.py). None: the shared cache.
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop a request in the engine; its KV blocks are freed at the next step."""

    request_id: str
    reason: str  # "cancelled", "stop_string", ... (for logs only)


@dataclass(frozen=True, slots=True)
class FlushPrefixCache:
    """Drop the prefix cache (an operator's FlushCache); answered by ``CacheFlushed``."""

    flush_id: int


@dataclass(frozen=True, slots=True)
class CacheFlushed:
    """The answer to ``FlushPrefixCache``: blocks freed, and blocks that running requests
    hold, unpublished now and freed when they end."""

    flush_id: int
    num_freed: int
    num_unpublished: int
    error: str = ""  # the flush failed (an engine bug): why; nothing was dropped then


@dataclass(frozen=True, slots=True)
class CacheUpdate:
    """Stage 2 -> the KV-event hub, once per step-loop turn: the prefix-cache events of the
    turn (stored and removed blocks, in order) and the engine's stats right after it."""

    events: tuple[KvEvent, ...]
    stats: EngineStats
    time: float  # time.monotonic() when the turn ended
    busy: bool  # requests were in the engine after the turn (the engine steps for them)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Sentinel: the receiving stage drains what it must and exits its loop."""


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Where one step's time went, in seconds, and how big it was; plain numbers the step
    loop records so that stage 3 (not the step loop) updates the metrics.

    On CUDA, kernels run asynchronously: forward_s is then mostly launch time and the wait
    for the GPU lands in sample_s, where the sampled ids are copied to the host."""

    schedule_s: float  # scheduler.schedule()
    forward_s: float  # building the batch and the model's forward
    sample_s: float  # logits, sampling, and the scheduler's update
    idle_s: float  # the step loop waited for input before this step, with requests live
    num_seqs: int  # sequences in the batch
    num_tokens: int  # tokens computed (prefill chunks + one per decoding sequence)
    mask_s: float = 0.0  # grammar masks of the constrained rows (part of forward/sample)


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One engine step's outputs plus the engine's stats right after it."""

    outputs: tuple[RequestOutput, ...]
    step_start: float  # time.monotonic()
    step_end: float
    stats: EngineStats | None
    timing: StepTiming | None = None  # None for an empty step or an engine that keeps none


class FailureKind(enum.StrEnum):
    INVALID_ARGUMENT = "invalid_argument"  # the engine refused the request at admission
    ENGINE_FAULT = "engine_fault"  # the engine raised while this request was in it
    UNAVAILABLE = "unavailable"  # the pipeline stopped with the request still in flight


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """A request ended without a normal finish; stage 3 raises it in the request's stream."""

    request_id: str
    kind: FailureKind
    message: str
    field: str | None = None  # the request field at fault (INVALID_ARGUMENT)
