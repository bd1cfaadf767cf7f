"""What the soak sends: the request kinds, each with the outcome it must get.

Every request is planned as raw wire bytes plus an ``Expect`` (status codes it may end
with, and how a non-OK message must start), so well-formed and malformed requests travel
the same way and a result is classified by one rule (soak_summary.py). Kinds:

- ``normal``: streamed generations of mixed prompt and output lengths (token ids from
  the served model's own vocabulary; chat text too when the server has a tokenizer),
  greedy or seeded, some stopping at EOS. Must end OK with a ``complete``.
- ``cancel``: long generations the client cancels after 1-4 chunks (CANCELLED; OK if it
  ended first).
- ``deadline``: long generations with a 0.2-1.5 s deadline (DEADLINE_EXCEEDED, or OK).
- ``bad``: INVALID_ARGUMENT cases, cycled: sampling values out of range (some only in
  float32), too many or too long stop strings, out-of-vocabulary ids, no input, a huge
  chat role (must not be echoed), malformed wire bytes (invalid UTF-8 in a string field,
  truncated or corrupt messages) and Tokenize with invalid UTF-8. Two "unknown field"
  cases are the exception: proto3 parsers skip an unknown field number, and a known field
  sent with the wrong wire type is kept as unknown too, so those requests must be served
  (OK).
- ``oversized``: text prompts of several MiB (under the 16 MiB message cap, over the
  prompt/request byte limits): INVALID_ARGUMENT, fast.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.bench.workload import POOL_TEXT
from services.gen.headrace.v1 import generation_pb2 as pb

MALFORMED = ("request:",)  # services/server/status.py MALFORMED_MESSAGE starts so


@dataclass(frozen=True)
class Expect:
    """Status code names a request may end with; a non-OK message must start with one of
    ``prefixes`` (the field it names) when any are given."""

    codes: tuple[str, ...]
    prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Planned:
    """One request to send: ``method`` is "Generate" or "Tokenize"."""

    kind: str
    variant: str
    payload: bytes
    expect: Expect
    method: str = "Generate"
    timeout: float | None = None  # a deadline (the deadline kind)
    cancel_after: int | None = None  # chunks received before the client cancels


@dataclass(frozen=True)
class Shape:
    """Lengths and the served model's facts the plans need."""

    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.9
    vocab_size: int = 0
    pool: tuple[int, ...] = ()  # token ids to draw prompts from
    has_tokenizer: bool = False
    oversized_mib: tuple[float, ...] = (2.0, 6.0, 12.0)


def _length(rng: random.Random, center: int, ratio: float) -> int:
    return rng.randint(max(1, int(center * (1 - ratio))), max(1, int(center * (1 + ratio))))


def _ids(rng: random.Random, shape: Shape) -> list[int]:
    return [rng.choice(shape.pool) for _ in range(_length(rng, shape.input_len, shape.range_ratio))]


def _patched(message, placeholder: bytes, bad: bytes) -> bytes:
    return message.SerializeToString().replace(placeholder, bad, 1)


_GOOD = pb.GenerateRequest(prompt="hello there").SerializeToString()
_CHAT = pb.Chat(messages=[pb.ChatMessage(role="user", content="QQ")])
_HUGE_ROLE = pb.Chat(messages=[pb.ChatMessage(role="r" * 100_000, content="hi")])
# Valid messages with one field wrong, merged into a token-id request: variant -> (patch,
# the field the message must name).
FIELD_CASES: dict[str, tuple[pb.GenerateRequest, str]] = {
    "temperature_negative": (
        pb.GenerateRequest(sampling=pb.SamplingParams(temperature=-1.0)), "sampling.temperature"),
    "top_p_zero_in_float32": (  # 1e-300 is a valid double and 0 in float32 (issue 10)
        pb.GenerateRequest(sampling=pb.SamplingParams(temperature=1.0, top_p=1e-300, seed=1)),
        "sampling.top_p"),
    "repetition_penalty_tiny": (
        pb.GenerateRequest(sampling=pb.SamplingParams(temperature=1.0, repetition_penalty=1e-300)),
        "sampling.repetition_penalty"),
    "top_k_negative": (pb.GenerateRequest(sampling=pb.SamplingParams(top_k=-5)), "sampling.top_k"),
    "too_many_stop_strings": (
        pb.GenerateRequest(stopping=pb.StoppingCriteria(stop=[f"s{i}" for i in range(65)])),
        "stopping.stop"),
    "stop_string_too_long": (
        pb.GenerateRequest(stopping=pb.StoppingCriteria(stop=["x" * 300])), "stopping.stop"),
    "top_logprobs_too_many": (pb.GenerateRequest(top_logprobs=21), "top_logprobs"),
}  # fmt: skip
_MALFORMED = Expect(("INVALID_ARGUMENT",), MALFORMED)
_BAD_UTF8_PROMPT = _patched(pb.GenerateRequest(prompt="hi XX"), b"XX", b"\xff\xfe")
_BAD_UTF8_TOKENIZE = _patched(pb.TokenizeRequest(prompt="hi XX"), b"XX", b"\xff\xfe")
# Whole requests: variant -> (method, bytes, expectation).
WIRE_CASES: dict[str, tuple[str, bytes, Expect]] = {
    "no_input": ("Generate", b"", Expect(("INVALID_ARGUMENT",), ("input",))),
    "huge_chat_role": ("Generate", pb.GenerateRequest(chat=_HUGE_ROLE).SerializeToString(),
                       Expect(("INVALID_ARGUMENT",), ("chat",))),
    "bad_utf8_prompt": ("Generate", _BAD_UTF8_PROMPT, _MALFORMED),
    "bad_utf8_chat": ("Generate", _patched(pb.GenerateRequest(chat=_CHAT), b"QQ", b"\xc3\x28"),
                      _MALFORMED),
    "truncated_message": ("Generate", _GOOD[:-3], _MALFORMED),
    "corrupt_bytes": ("Generate", b"\xff\xff\xff\xff", _MALFORMED),
    "tokenize_bad_utf8": ("Tokenize", _BAD_UTF8_TOKENIZE, _MALFORMED),
}  # fmt: skip
# Appended to a valid request, these must be skipped as unknown fields (proto3), so the
# request is served: field 111 as a varint, and field 5 (sampling, a message) as a varint
# (a known field of the wrong wire type is kept as unknown too).
UNKNOWN_FIELDS = {"unknown_field": b"\xf8\x06\x01", "wrong_wire_type": b"\x28\x01"}


def _base(rng: random.Random, shape: Shape) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=_ids(rng, shape)), stopping=pb.StoppingCriteria(max_tokens=8)
    )


def bad_plans(rng: random.Random, shape: Shape) -> list[Planned]:
    """One plan per bad variant, in a fixed order."""
    plans = []
    for name, (patch, field) in FIELD_CASES.items():
        message = _base(rng, shape)
        message.MergeFrom(patch)
        plans.append(Planned("bad", name, message.SerializeToString(), _invalid(field)))
    oov = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, shape.vocab_size + 7]))
    plans.append(Planned("bad", "token_id_out_of_vocab", oov.SerializeToString(),
                         _invalid("token_ids")))  # fmt: skip
    for name, (method, payload, expect) in WIRE_CASES.items():
        plans.append(Planned("bad", name, payload, expect, method))
    for name, suffix in UNKNOWN_FIELDS.items():
        payload = _base(rng, shape).SerializeToString() + suffix
        plans.append(Planned("bad", name, payload, Expect(("OK",))))
    return plans


def _invalid(prefix: str) -> Expect:
    return Expect(("INVALID_ARGUMENT",), (prefix,))


def _normal(rng: random.Random, shape: Shape, max_tokens: int, variant: str) -> bytes:
    greedy = rng.random() < 0.5
    sampling = pb.SamplingParams(temperature=0.0 if greedy else 0.8)
    if not greedy:
        sampling.seed = rng.randrange(2**31)
    stopping = pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
    message = pb.GenerateRequest(sampling=sampling, stopping=stopping)
    if variant == "chat":
        start = rng.randrange(len(POOL_TEXT) // 2)
        text = POOL_TEXT[start : start + rng.randrange(20, len(POOL_TEXT) // 2)]
        message.chat.messages.add(role="user", content=f"Summarize: {text}")
    else:
        message.token_ids.ids.extend(_ids(rng, shape))
    return message.SerializeToString()


class Planner:
    """Request ``i``'s plan: kinds by smooth weighted round-robin over ``mix`` (every kind
    early and evenly spread, whatever the run's length), variants cycled, lengths seeded."""

    def __init__(self, mix: dict[str, int], shape: Shape, seed: int) -> None:
        unknown = set(mix) - set(KINDS)
        if unknown or not any(w > 0 for w in mix.values()) or min(mix.values()) < 0:
            raise ValueError(f"--mix: weights >= 0 over {', '.join(KINDS)}, not all 0")
        self.mix, self.shape = {k: w for k, w in mix.items() if w > 0}, shape
        self.rng = random.Random(seed)
        self._current = dict.fromkeys(self.mix, 0)
        self._bad = bad_plans(self.rng, shape)
        self._counts = dict.fromkeys(KINDS, 0)

    def next_kind(self) -> str:
        total = sum(self.mix.values())
        for kind, weight in self.mix.items():
            self._current[kind] += weight
        kind = max(self._current, key=self._current.get)
        self._current[kind] -= total
        return kind

    def next(self) -> Planned:
        kind = self.next_kind()
        n, self._counts[kind] = self._counts[kind], self._counts[kind] + 1
        return KINDS[kind](self, n)

    def _long(self) -> int:
        return 4 * self.shape.output_len

    def normal(self, n: int) -> Planned:
        variant = "chat" if self.shape.has_tokenizer and n % 4 == 3 else "ids"
        out = _length(self.rng, self.shape.output_len, self.shape.range_ratio)
        return Planned(
            "normal", variant, _normal(self.rng, self.shape, out, variant), Expect(("OK",))
        )

    def cancel(self, n: int) -> Planned:
        payload = _normal(self.rng, self.shape, self._long(), "ids")
        after = self.rng.randint(1, 4)
        return Planned("cancel", f"after_{after}_chunks", payload,
                       Expect(("CANCELLED", "OK")), cancel_after=after)  # fmt: skip

    def deadline(self, n: int) -> Planned:
        payload = _normal(self.rng, self.shape, self._long(), "ids")
        expect = Expect(("DEADLINE_EXCEEDED", "OK"))
        timeout = self.rng.uniform(0.2, 1.5)
        return Planned("deadline", "short_deadline", payload, expect, timeout=timeout)

    def bad(self, n: int) -> Planned:
        return self._bad[n % len(self._bad)]

    def oversized(self, n: int) -> Planned:
        mib = self.shape.oversized_mib[n % len(self.shape.oversized_mib)]
        prompt = "a " * int(mib * 1024 * 1024 / 2)
        payload = pb.GenerateRequest(prompt=prompt).SerializeToString()
        expect = Expect(("INVALID_ARGUMENT",), ("prompt", "request"))
        return Planned("oversized", f"{mib:g}_mib", payload, expect)


KINDS: dict[str, Callable[[Planner, int], Planned]] = {
    "normal": Planner.normal,
    "cancel": Planner.cancel,
    "deadline": Planner.deadline,
    "bad": Planner.bad,
    "oversized": Planner.oversized,
}
GENERATING = ("normal", "cancel", "deadline")  # kinds that cost the engine work


def parse_mix(text: str) -> dict[str, int]:
    """``"normal:70,cancel:8"`` -> {"normal": 70, "cancel": 8} (kinds left out get 0)."""
    mix = dict.fromkeys(KINDS, 0)
    for item in text.split(","):
        name, _, weight = item.partition(":")
        if name.strip() not in KINDS or not weight.strip().isdigit():
            raise ValueError(f"--mix: {item!r} is not KIND:WEIGHT with KIND in {', '.join(KINDS)}")
        mix[name.strip()] = int(weight)
    if not any(mix.values()):
        raise ValueError("--mix: at least one weight must be > 0")
    return mix


def shares(mix: dict[str, int], kinds: Sequence[str]) -> float:
    """The fraction of requests that are of ``kinds``."""
    return sum(mix.get(k, 0) for k in kinds) / sum(mix.values())
