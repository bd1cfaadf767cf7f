"""One request's state inside the engine: tokens, progress, KV blocks, status.

A sequence is "num_computed_tokens catching up to num_tokens": prefill,
chunked prefill and decode are the same thing. Owned by stage 2 only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from compute.core.messages import FinishReason
from compute.core.ngram import NgramIndex
from compute.core.sampling_params import SamplingParams

# An output token sampled by a step still in flight (asynchronous output, compute/engine.py):
# it holds the token's place in ``output_token_ids`` until the step's ids reach the host.
# The model runner feeds the step's sampled id from the device in its place.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its blocks on the host (preemption_mode=swap)
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower runs first under the "priority" policy
    fork_of: str | None = None  # n > 1: the sequence of the same prompt it may fork from
    # A tenant's prefix-cache namespace, folded into its first block's key: prompts of
    # different salts never share KV blocks (compute/core/prefix_cache.py).
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Prompt tokens it did not compute at its first admission: prefix-cache hits, or all
    # but the last prompt token when it forked from another sequence's prompt.
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # the block table
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Trailing entries of output_token_ids that are PLACEHOLDERs: 0 with synchronous output,
    # at most 1 between steps with asynchronous output (the step in flight).
    num_pending: int = 0
    # Speculative decoding's back-off (compute/core/drafts.py): decode steps left without
    # a draft, and the length of the last such pause (doubled by each wholly rejected draft).
    draft_skip: int = 0
    draft_backoff: int = 0
    ngrams: NgramIndex | None = None  # its n-gram index, built at its first draft

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known (all of them but the pending placeholders)."""
        return self.num_tokens - self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) without building the concatenated list."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
