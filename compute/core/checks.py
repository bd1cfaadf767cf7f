"""Request rules that need the model or the cache, each checked here and only here.

``check_request`` runs twice on purpose, with the same code:
in stage 1 (so a bad request fails before it reaches the engine) and at the engine's
admission (which must never trust its caller). Sampling-value ranges are
``SamplingParams``' own rules (compute/core/sampling_params.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compute.core.errors import FieldError
from compute.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context and the whole KV cache."""

    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int | None = None  # None: ids are not checked (the scheduler's fakes)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def check_request(
    prompt_ids: Sequence[int], params: SamplingParams, limits: RequestLimits, field: str = "prompt"
) -> SamplingParams:
    """``params`` with max_tokens resolved; FieldError if the request can never be served.

    ``field`` names where the prompt came from (``prompt``, ``token_ids``, ``chat``).
    """
    n = len(prompt_ids)
    if n == 0:
        raise FieldError(field, "must contain at least one token")
    _check_vocabulary(prompt_ids, params, limits, field)
    room = min(limits.max_model_len, limits.kv_capacity_tokens)
    params = params.with_max_tokens_for(n, room)
    m, limit = params.max_tokens, limits.max_model_len
    if n >= limit:
        raise FieldError(
            field, f"prompt of {n} tokens leaves no room for output within max_model_len {limit}"
        )
    if n + m > limit:
        raise FieldError(
            "max_tokens", f"prompt of {n} tokens + max_tokens {m} exceeds max_model_len {limit}"
        )
    cache = f"({limits.num_blocks} blocks of {limits.block_size} tokens)"
    if n + 1 > limits.kv_capacity_tokens:
        raise FieldError(field, f"prompt of {n} tokens can never fit the KV cache {cache}")
    if n + m > limits.kv_capacity_tokens:
        raise FieldError(
            "max_tokens",
            f"prompt of {n} tokens + max_tokens {m} can never fit the KV cache {cache}",
        )
    return params


def _check_vocabulary(
    prompt_ids: Sequence[int], params: SamplingParams, limits: RequestLimits, field: str
) -> None:
    vocab = limits.vocab_size
    if vocab is None:
        return
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise FieldError(field, f"token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise FieldError("stop_token_ids", f"{bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
    if bad is not None:
        raise FieldError("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab})")
