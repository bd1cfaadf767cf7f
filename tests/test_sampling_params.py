"""SamplingParams validation: each bad value raises ValueError naming the field first."""

from __future__ import annotations

import pytest

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
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[repr(k) for _, k in INVALID])
def test_invalid_value_raises_naming_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field)


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
        {"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))},
    ],
)
def test_boundary_values_are_valid(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)


def test_derived_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(logprobs=True).wants_logprobs
    assert SamplingParams(top_logprobs=3).wants_logprobs
