"""The engine: scheduler + model runner behind a step-wise and an offline API.

One step = schedule -> build the flat batch -> forward -> sample -> update
sequences. Stage 2 (compute/step_loop.py) drives ``add_request``/``step``/
``abort``; ``generate`` is the offline API built on the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from compute.config import EngineConfig
from compute.outputs import RequestOutput, TokenLogprob
from compute.sampling_params import SamplingParams
from compute.sequence import FinishReason


@dataclass
class CompletionOutput:
    """A finished request, as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the engine has no tokenizer (dummy weights)
    finish_reason: FinishReason
    logprobs: list[TokenLogprob | None]
    num_cached_tokens: int


@dataclass
class EngineStats:
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


class Engine:
    """API contract; the implementation lands with the model runner."""

    def __init__(self, config: EngineConfig, loaded=None) -> None:
        raise NotImplementedError

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ValueError naming the field if it can never be served."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its blocks are free when this returns."""
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams],
    ) -> list[CompletionOutput]:
        raise NotImplementedError
