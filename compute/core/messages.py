"""Every record that crosses a stage boundary of the serving pipeline, in one place.

Stage 1 (tokenize) -> stage 2 (step loop): ``AddRequest``; the facade and stage 3 ->
stage 2: ``Abort``; stage 2 -> stage 3: ``StepOutputs`` (one per engine step) and
``RequestFailed``; ``Shutdown`` ends a stage's loop. Records hold ints, strs, floats and
tuples of them (plus the frozen ``SamplingParams`` and ``EngineStats`` records): never
tensors, never asyncio objects, so a stage could move to another process unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from compute.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine module pulls in torch; records only need the name
    from compute.engine import EngineStats

# (token_id, logprob, ((alt_id, alt_logprob), ...)) for one sampled token.
LogprobEntry = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A validated, tokenized request, ready for ``Engine.add_request``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    arrival_time: float  # time.monotonic() when the pipeline admitted it


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop a request in the engine; its KV blocks are freed at the next step."""

    request_id: str
    reason: str  # "cancelled", "stop_string", ... (for logs only)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Sentinel: the receiving stage drains what it must and exits its loop."""


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry | None, ...]  # parallel to new_token_ids
    finished: bool
    finish_reason: str | None  # FinishReason value: "stop", "length", "abort"
    stop_token_id: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    first_scheduled_time: float | None  # time.monotonic(); None when unknown


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One engine step's deltas plus the engine's stats right after it."""

    deltas: tuple[TokenDelta, ...]
    step_start: float  # time.monotonic()
    step_end: float
    stats: EngineStats | None


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
    field: str | None = None
