"""Per-request sampling and stopping parameters, validated once at admission.

Validation raises ``FieldError`` naming the field, so the service can map it to
INVALID_ARGUMENT naming the request field. Float ranges are checked on the float32
values the sampler computes with.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

from compute.core.errors import FieldError, capped
from compute.core.grammar import CompiledGrammar

DEFAULT_MAX_TOKENS = 256  # new tokens when the request does not say
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# A penalty below this divides a logit past float32's range (inf, then NaN in softmax).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS_ENTRIES = 300  # token ids one request may bias (OpenAI allows 300)
MAX_LOGIT_BIAS = 100.0  # |bias| at most (OpenAI's range)
_UNSHOWN = object()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = -1  # -1 or 0 = all tokens
    min_p: float = 0.0  # drop tokens whose prob < min_p * max prob, in [0, 1]
    repetition_penalty: float = 1.0  # HF semantics over prompt + output, in [0.01, 10]
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
    # (token id, bias) pairs, ids ascending: added to the logits
    # (compute/sampling/logit_processors.py)
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS, stop tokens and stop strings do not end it before this many
    # A compiled grammar constraint (compute/sampling/grammar_masks.py): compiled by stage 1, whose
    # output must match it; None = unconstrained.
    grammar: CompiledGrammar | None = None

    def __post_init__(self) -> None:
        self._check_distribution()
        self._check_lengths()
        self._check_stops()
        _check_logit_bias(self.logit_bias)
        if self.grammar is not None:
            # Past EOS a grammar that has ended allows nothing more.
            _check("ignore_eos", not self.ignore_eos, "cannot be combined with a constraint")
            # A grammar that has ended allows only EOS, which min_tokens would ban.
            _check("min_tokens", self.min_tokens == 0, "cannot be combined with a constraint")

    def _check_distribution(self) -> None:
        # The sampler computes in float32: a value valid as a Python float can be 0 or inf
        # there (top_p=1e-300 is 0.0 and would drop every token), so ranges are checked
        # on the float32 value.
        _check_f32("temperature", self.temperature, 0.0, None, "must be >= 0 and finite")
        _check_f32("top_p", self.top_p, 0.0, 1.0, "must be in (0, 1]", low_open=True)
        _check("top_k", self.top_k >= -1, "must be -1 (disabled) or >= 0", self.top_k)
        _check_f32("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        low, high = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        rule = f"must be in [{low}, {high}]"
        _check_f32("repetition_penalty", self.repetition_penalty, low, high, rule)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_f32(name, getattr(self, name), -2.0, 2.0, "must be in [-2, 2]")
        ok = self.seed is None or 0 <= self.seed < 2**63
        _check("seed", ok, "must be in [0, 2^63)", self.seed)

    def _check_lengths(self) -> None:
        ok = self.max_tokens is None or self.max_tokens >= 1
        _check("max_tokens", ok, "must be >= 1", self.max_tokens)
        rule = f"must be in [0, {MAX_TOP_LOGPROBS}]"
        _check("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, rule, self.top_logprobs)
        _check("min_tokens", self.min_tokens >= 0, "must be >= 0", self.min_tokens)
        ok = self.max_tokens is None or self.min_tokens <= self.max_tokens
        _check("min_tokens", ok, f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)

    def _check_stops(self) -> None:
        _check("stop", len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} strings")
        _check(
            "stop",
            all(0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            f"each stop string must have 1..{MAX_STOP_STRING_CHARS} characters",
        )
        n = len(self.stop_token_ids)
        _check("stop_token_ids", n <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} ids")
        _check("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "ids must be >= 0")

    def with_max_tokens_for(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Resolve an unset max_tokens: the default, capped to the room the context leaves.

        An explicit max_tokens is kept as given (admission rejects it if it cannot fit).
        The default grows to min_tokens; a min_tokens beyond the room is a FieldError.
        """
        if self.max_tokens is not None:
            return self
        room = max(1, max_model_len - num_prompt_tokens)
        return replace(self, max_tokens=min(max(DEFAULT_MAX_TOKENS, self.min_tokens), room))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def constrained(self) -> bool:
        """Sampling masks the logits by a grammar, advanced with every output token."""
        return self.grammar is not None

    @property
    def reads_history(self) -> bool:
        """Sampling reads the tokens generated so far (penalties count them, a grammar's
        matcher advances with them): the next token cannot be sampled before this one is
        known on the host (asynchronous output), nor after an unverified draft."""
        return self.penalized or self.constrained

    @property
    def penalized(self) -> bool:
        """Sampling reads the tokens generated so far (compute/sampling/penalties.py)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check(field: str, ok: bool, rule: str, value: object = _UNSHOWN) -> None:
    if not ok:
        shown = "" if value is _UNSHOWN else f" (got {capped(value)})"
        raise FieldError(field, rule + shown)


def _check_logit_bias(entries: tuple[tuple[int, float], ...]) -> None:
    field = "logit_bias"
    n = len(entries)
    _check(field, n <= MAX_LOGIT_BIAS_ENTRIES, f"at most {MAX_LOGIT_BIAS_ENTRIES} entries", n)
    seen: set[int] = set()
    for token_id, bias in entries:
        _check(field, token_id >= 0, "token ids must be >= 0", token_id)
        _check(field, token_id not in seen, "a token id is given twice", token_id)
        seen.add(token_id)
        rule = f"the bias of token {token_id} must be in [-100, 100]"
        _check_f32(field, bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, rule)


def logit_bias_entries(mapping: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """A ``{token id: bias}`` map as SamplingParams.logit_bias (ids ascending)."""
    return tuple(sorted((int(k), float(v)) for k, v in mapping.items()))


def _check_f32(
    field: str,
    value: float,
    low: float,
    high: float | None,
    rule: str,
    low_open: bool = False,
) -> None:
    """``rule`` must hold for ``value`` as the float32 the sampler will compute with."""
    f32, low = as_float32(value), as_float32(low)  # bounds compared as float32 too
    ok = math.isfinite(f32) and (f32 > low if low_open else f32 >= low)
    ok = ok and (high is None or f32 <= as_float32(high))
    if not ok:
        note = "" if f32 == value or math.isnan(value) else f", which is {f32!r} in float32"
        raise FieldError(field, f"{rule} (got {capped(value)}{note})")


def as_float32(value: float) -> float:
    """``value`` rounded to float32 (inf beyond its range), without numpy or torch."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
