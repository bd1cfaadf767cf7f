"""SamplingParams validation: each bad value raises FieldError naming the field."""

from __future__ import annotations

import pytest

from compute.core.errors import FieldError
from compute.core.sampling_params import MAX_STOP_STRINGS, SamplingParams

INVALID = [
    ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": 1.5}),
    ("min_p", {"min_p": -0.1}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("presence_penalty", {"presence_penalty": 3.0}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("max_tokens", {"max_tokens": 0}),
    ("top_logprobs", {"top_logprobs": 21}),
    ("top_logprobs", {"top_logprobs": -1}),
    ("seed", {"seed": -1}),
    ("stop", {"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))}),
    ("stop", {"stop": ("",)}),
    ("stop_token_ids", {"stop_token_ids": (5, -1)}),
    # Valid as Python floats, but 0 or inf in the sampler's float32 tensors.
    ("top_p", {"top_p": 1e-300}),
    ("repetition_penalty", {"repetition_penalty": 1e-300}),
    ("repetition_penalty", {"repetition_penalty": 1e-3}),
    ("temperature", {"temperature": 1e300}),
    ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": float("nan")}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[repr(k) for _, k in INVALID])
def test_invalid_value_raises_naming_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(FieldError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_float32_underflow_is_named_in_the_message() -> None:
    with pytest.raises(FieldError, match=r"1e-300, which is 0.0 in float32"):
        SamplingParams(top_p=1e-300)


def test_echoed_values_are_capped() -> None:
    with pytest.raises(FieldError) as info:
        SamplingParams(stop_token_ids=tuple(range(-1, 10_000)))
    assert len(str(info.value)) < 200


def test_defaults_are_valid_and_random() -> None:
    params = SamplingParams()
    assert not params.greedy and not params.wants_logprobs and params.seed is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": 0, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"top_logprobs": 20, "seed": 2**63 - 1},
        {"top_p": 1e-30, "min_p": 1e-300, "temperature": 1e-300},
        {"repetition_penalty": 0.01},
        {"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))},
    ],
)
def test_boundary_values_are_valid(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)


def test_derived_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(logprobs=True).wants_logprobs
    assert SamplingParams(top_logprobs=3).wants_logprobs
