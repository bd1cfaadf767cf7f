"""Typed hand-offs of one engine step: scheduler -> model runner -> scheduler -> caller.

``Scheduler.schedule() -> SchedulerOutput``; ``ModelRunner.launch(...).resolve() ->
ModelRunnerOutput`` (plain lists, no tensors); ``Scheduler.commit(...)`` then
``Scheduler.resolve(...) -> list[RequestOutput]`` (per-request deltas; that record
crosses to stage 3 as it is, so it lives in compute/core/messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compute.core.messages import TokenLogprob
from compute.core.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    # Tokens computed this step, starting at seq.num_computed_tokens (as scheduled).
    num_new_tokens: int
    # The step samples a token: it computes up to the sequence's last token. Fixed when
    # scheduled; the sequence's counters move on when the step is committed.
    samples: bool
    # Speculative decoding: tokens guessed to follow the sequence's last token, scored in
    # this step after it (they are the last len(draft) of num_new_tokens); the runner
    # samples at each of the 1 + len(draft) positions and keeps the agreeing prefix.
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, seq: Sequence, num_new_tokens: int, draft: tuple[int, ...] = ()
    ) -> ScheduledSequence:
        done = seq.num_computed_tokens + num_new_tokens - len(draft) == seq.num_tokens
        return cls(seq, num_new_tokens, done, draft)

    @property
    def num_own_tokens(self) -> int:
        """Tokens of the sequence itself computed this step (the draft's are not yet)."""
        return self.num_new_tokens - len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # decodes first, then prefill chunks
    num_batched_tokens: int = 0
    num_pairs: int = 0  # query-key pairs attention computes (compute/core/step_cost.py)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Block copies for preemption_mode=swap, as (device_block, host_block) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Device block copies for forked sequences, as (source, destination) pairs: a fork's
    # copy of its parent's partial prompt block. Done after the swaps (a source may have
    # just been swapped in), before the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    # One entry per ScheduledSequence that samples, in schedule order.
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # Requests whose step failed (bad sampled id, or a forward/sampling error the engine
    # traced to them), with the message their client sees; they have no entry above.
    faulty: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: per drafted request, the tokens it emits after its entry above
    # (the accepted draft tokens after the first, then the model's own), with logprobs.
    more_tokens: dict[str, list[tuple[int, TokenLogprob | None]]] = field(default_factory=dict)

    def merge(self, other: ModelRunnerOutput) -> None:
        """Append ``other``'s rows (the engine runs a failed step again in parts)."""
        self.request_ids.extend(other.request_ids)
        self.sampled_token_ids.extend(other.sampled_token_ids)
        self.logprobs.extend(other.logprobs)
        self.faulty.update(other.faulty)
        self.more_tokens.update(other.more_tokens)
