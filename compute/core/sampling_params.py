"""Per-request sampling and stopping parameters, validated once at admission.

Validation raises ``ValueError`` whose message starts with the field name, so
the service can map it to INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_MAX_TOKENS = 256  # new tokens when the request does not say
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = -1  # -1 or 0 = all tokens
    min_p: float = 0.0  # drop tokens whose prob < min_p * max prob, in [0, 1]
    repetition_penalty: float = 1.0  # HF semantics over prompt + output, > 0
    presence_penalty: float = 0.0  # OpenAI semantics over output, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI semantics over output, in [-2, 2]
    seed: int | None = None  # per-request generator: same tokens alone or in any batch
    max_tokens: int | None = None  # new tokens at most; None = up to 256, capped to the context
    stop: tuple[str, ...] = ()  # stop strings (matched by the output stage)
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end generation
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    include_stop_str_in_output: bool = False
    logprobs: bool = False  # return the sampled token's logprob
    top_logprobs: int = 0  # also return this many alternatives (<= 20)

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "must be -1 (disabled) or >= 0", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(
            0 < self.repetition_penalty <= 10,
            "repetition_penalty",
            "must be in (0, 10]",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "must be in [-2, 2]", value)
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            "must be >= 1",
            self.max_tokens,
        )
        _check(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
            self.top_logprobs,
        )
        _check(
            self.seed is None or 0 <= self.seed < 2**63,
            "seed",
            "must be in [0, 2^63)",
            self.seed,
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings",
            len(self.stop),
        )
        for s in self.stop:
            _check(
                0 < len(s) <= MAX_STOP_STRING_CHARS,
                "stop",
                f"each stop string must have 1..{MAX_STOP_STRING_CHARS} characters",
                len(s),
            )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids",
            len(self.stop_token_ids),
        )
        for tid in self.stop_token_ids:
            _check(tid >= 0, "stop_token_ids", "ids must be >= 0", tid)

    def with_max_tokens_for(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Resolve an unset max_tokens: the default, capped to the room the context leaves.

        An explicit max_tokens is kept as given (admission rejects it if it cannot fit).
        """
        if self.max_tokens is not None:
            return self
        room = max(1, max_model_len - num_prompt_tokens)
        return replace(self, max_tokens=min(DEFAULT_MAX_TOKENS, room))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field}: {rule} (got {value!r})")
