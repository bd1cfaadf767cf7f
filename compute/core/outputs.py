"""Typed hand-offs of one engine step: scheduler -> model runner -> scheduler -> caller.

``Scheduler.schedule() -> SchedulerOutput``; ``ModelRunner.execute(...) ->
ModelRunnerOutput`` (plain lists, no tensors);
``Scheduler.update_from_output(...) -> list[RequestOutput]`` (per-request deltas).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compute.core.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    # Tokens computed this step, starting at seq.num_computed_tokens. When
    # num_computed_tokens + num_new_tokens == seq.num_tokens the step samples a token.
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # decodes first, then prefill chunks
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Block copies for preemption_mode=swap, as (device_block, host_block) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass
class ModelRunnerOutput:
    # One entry per ScheduledSequence that samples, in schedule order.
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob | None]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS/stop token that finished it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() of its first step
