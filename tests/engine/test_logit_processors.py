"""logit_bias and min_tokens in the sampler (compute/sampling/logit_processors.py): only the rows
that ask are touched, a step without them pays nothing, and the engine's real model
obeys them (a -100 bias moves the greedy first token, +100 forces one, min_tokens holds
off EOS)."""

from __future__ import annotations

import pytest
import torch

from compute.core.errors import FieldError
from compute.core.sampling_params import SamplingParams, logit_bias_entries
from compute.core.sequence import Sequence
from compute.sampling.logit_processors import process_logits
from compute.sampling.sampler import Sampler

VOCAB = 64
EOS = (2,)


def make_seq(rid: str, params: SamplingParams, output: tuple[int, ...] = ()) -> Sequence:
    return Sequence(rid, [1, 5, 9], params, 0.0, output_token_ids=list(output))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3


def test_no_row_asking_returns_the_same_tensor() -> None:
    logits = random_logits(4)
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=0.0)) for i in range(4)]
    assert process_logits(logits, seqs, EOS) is logits


def test_bias_touches_its_row_and_tokens_only() -> None:
    logits = random_logits(3)
    biased = SamplingParams(logit_bias=logit_bias_entries({7: 2.5, 11: -100.0}))
    seqs = [make_seq("a", SamplingParams()), make_seq("b", biased), make_seq("c", SamplingParams())]
    out = process_logits(logits, seqs, EOS)
    expected = logits.clone()
    expected[1, 7] += 2.5
    expected[1, 11] -= 100.0
    assert torch.equal(out, expected)
    assert not torch.equal(out, logits)  # the input is left as it was (raw logprobs)


def test_bias_moves_and_forces_the_greedy_token() -> None:
    logits = random_logits(1)
    best = int(logits.argmax())
    banned = SamplingParams(temperature=0.0, logit_bias=((best, -100.0),))
    forced = SamplingParams(temperature=0.0, logit_bias=((5 if best != 5 else 6, 100.0),))
    sampler = Sampler(VOCAB)
    assert sampler.sample(logits, [make_seq("a", banned)])[0] != [best]
    assert sampler.sample(logits, [make_seq("b", forced)])[0] == [5 if best != 5 else 6]


def test_unbiased_rows_are_token_identical_beside_biased_ones() -> None:
    logits = random_logits(6, seed=3)
    plain = [SamplingParams(temperature=0.8, seed=i) for i in range(3)]
    alone = Sampler(VOCAB).sample(logits[:3], [make_seq(f"p{i}", p) for i, p in enumerate(plain)])
    biased = SamplingParams(temperature=0.8, seed=9, logit_bias=((3, 50.0),), min_tokens=4)
    seqs = [make_seq(f"p{i}", p) for i, p in enumerate(plain)] + [
        make_seq(f"b{i}", biased) for i in range(3)
    ]
    mixed = Sampler(VOCAB).sample(logits, seqs)
    assert mixed[0][:3] == alone[0]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros((3, VOCAB))
    logits[:, 2] = 10.0  # EOS is the best token
    logits[:, 40] = 9.0  # then a stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(40,))
    seqs = [
        make_seq("a", params),  # its first token: both masked
        make_seq("b", params, output=(8,)),  # its second: still masked
        make_seq("c", params, output=(8, 8)),  # min_tokens reached: EOS may come
    ]
    tokens, _ = Sampler(VOCAB, eos_token_ids=EOS).sample(logits, seqs)
    assert tokens[0] not in (2, 40) and tokens[1] not in (2, 40)
    assert tokens[2] == 2


def test_min_tokens_leaves_eos_alone_with_ignore_eos() -> None:
    logits = torch.zeros((1, VOCAB))
    logits[0, 2] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler(VOCAB, eos_token_ids=EOS).sample(logits, [make_seq("a", params)])[0] == [2]


def test_logprobs_stay_raw_under_a_bias() -> None:
    logits = random_logits(1)
    params = SamplingParams(temperature=0.0, logprobs=True, logit_bias=((4, 100.0),))
    tokens, logprobs = Sampler(VOCAB).sample(logits, [make_seq("a", params)])
    assert tokens == [4]
    raw = torch.log_softmax(logits[0], dim=-1)[4].item()
    assert logprobs[0].logprob == pytest.approx(raw, abs=1e-5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": ((1, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((1, float("nan")),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(FieldError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_an_unset_max_tokens_grows_to_min_tokens() -> None:
    params = SamplingParams(min_tokens=300).with_max_tokens_for(10, 8192)
    assert params.max_tokens == 300
    with pytest.raises(FieldError, match="min_tokens"):
        SamplingParams(min_tokens=300).with_max_tokens_for(10, 200)


# --- the real model ---------------------------------------------------------------------

ANSWERED = (
    "<|im_start|>user\nWhat is 2+2? Answer with one digit.<|im_end|>\n<|im_start|>assistant\n4"
)
QUESTION = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine():
    from tests.engine.test_engine import make_engine

    return make_engine()


@pytest.mark.slow
def test_a_ban_on_the_greedy_first_token_gives_another(engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = engine.generate([QUESTION], greedy)[0].token_ids[0]
    banned = SamplingParams(temperature=0.0, max_tokens=4, logit_bias=((first, -100.0),))
    assert engine.generate([QUESTION], banned)[0].token_ids[0] != first


@pytest.mark.slow
def test_a_plus_100_bias_forces_its_token_beside_plain_requests(engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = engine.generate([QUESTION, ANSWERED], greedy)
    forced_id = engine.tokenizer.encode(" zebra")[0]
    forced = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=((forced_id, 100.0),)
    )
    mixed = engine.generate([QUESTION, QUESTION, ANSWERED], [greedy, forced, greedy])
    assert mixed[1].token_ids == [forced_id] * 6
    assert [mixed[0].token_ids, mixed[2].token_ids] == [o.token_ids for o in alone]


@pytest.mark.slow
def test_min_tokens_outlasts_an_answer_that_ends_at_once(engine) -> None:
    plain = engine.generate([ANSWERED], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert plain.token_ids == list(engine.model_config.eos_token_ids[:1])  # EOS at once
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=5)
    out = engine.generate([ANSWERED], params)[0]
    assert len(out.token_ids) >= 5
    assert not set(out.token_ids[:5]) & set(engine.model_config.eos_token_ids)


@pytest.mark.slow
def test_a_bias_outside_the_vocabulary_names_the_id(engine) -> None:
    vocab = engine.model_config.vocab_size
    with pytest.raises(FieldError, match=f"logit_bias: token id {vocab} is outside"):
        engine.add_request("x", [1, 2, 3], SamplingParams(logit_bias=((vocab, 1.0),)))


def _engine(**device_or_spec):
    from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SpeculativeConfig
    from compute.engine import Engine
    from tests.engine.test_engine import shared_model

    spec = device_or_spec.pop("speculative", SpeculativeConfig())
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=256),
            device=DeviceConfig(device="cpu", num_threads=1, **device_or_spec),
            speculative=spec,
        ),
        loaded=shared_model(),
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["async_output", "speculative"])
def test_same_tokens_with_async_output_and_speculation(engine, variant: str) -> None:
    """min_tokens counts the token being sampled, whether the step before is still in
    flight (a placeholder) or drafts are verified: outputs equal the plain engine's."""
    from compute.core.config import SpeculativeConfig
    from tests.engine.test_speculative_engine import copy_prompts

    if variant == "async_output":
        other = _engine(async_output=True)
    else:
        other = _engine(async_output=False, speculative=SpeculativeConfig(method="ngram"))
    eos = engine.model_config.eos_token_ids[0]
    prompts = [engine.tokenizer.encode(ANSWERED), copy_prompts()[0], QUESTION]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10, logit_bias=((eos, 100.0),)),
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias=((eos, -100.0),)),
    ]
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    assert [o.token_ids for o in other.generate(prompts, params)] == expected
    assert len(expected[0]) >= 5 and eos not in expected[0][:5]
    assert len(expected[1]) == 11 and expected[1][-1] == eos  # EOS as soon as it may come
