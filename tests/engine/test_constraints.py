"""Grammar-constrained sampling in the engine, on the embedded model (CPU).

A constrained request's output matches its grammar whole (JSON validated against its
schema with ``jsonschema``, regexes fullmatched) whatever the sampling settings, seeds and
engine paths (chunked prefill, preemption by recompute and swap, prefix caching); its
unconstrained neighbours are token-identical to their solo runs; EOS comes exactly where
the grammar may end; ``max_tokens`` mid-structure ends with ``length``; a failing matcher
fails its request alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jsonschema
import pytest

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.grammar import CompiledGrammar, Constraint
from compute.core.messages import FinishReason
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from compute.sampling.grammar_compiler import GrammarCompiler
from tests.engine.test_engine import prompts, shared_model
from tests.support.schemas import ORDER, PERSON, WEATHER_TOOL

pytestmark = pytest.mark.slow
_compiler: GrammarCompiler | None = None


def compiler() -> GrammarCompiler:
    global _compiler
    if _compiler is None:
        model = shared_model()
        _compiler = GrammarCompiler.for_tokenizer(model.tokenizer, model.config.vocab_size)
    return _compiler


def grammar(kind: str, text: str = "", choices: tuple[str, ...] = ()) -> CompiledGrammar:
    return compiler().compile(Constraint(kind, text, choices))


def make_engine(num_blocks: int = 256, async_output: bool = False, **scheduler) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=num_blocks),
            scheduler=SchedulerConfig(**scheduler),
            device=DeviceConfig(device="cpu", async_output=async_output),
        ),
        loaded=shared_model(),
    )


def chat(text: str) -> list[int]:
    return shared_model().tokenizer.encode_chat([{"role": "user", "content": text}])


PERSON_PROMPT = chat("Give me a JSON record of a person with name, age and role.")
ORDER_PROMPT = chat("Write a JSON order for two keyboards, shipped to Berlin.")


def json_params(schema: dict, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 220 if schema is ORDER else 120)
    return SamplingParams(grammar=grammar("json_schema", json.dumps(schema)), **kw)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


@pytest.mark.parametrize("schema", [PERSON, ORDER, WEATHER_TOOL], ids=["person", "order", "tool"])
def test_json_schema_output_validates_greedy_and_sampled(engine: Engine, schema: dict) -> None:
    prompt = ORDER_PROMPT if schema is ORDER else PERSON_PROMPT
    seeds = (1,) if schema is ORDER else (1, 2, 3)  # ORDER's outputs are long on a CPU
    params = [json_params(schema, temperature=0.0)] + [
        json_params(schema, temperature=0.9, top_p=0.95, seed=s) for s in seeds
    ]
    for out in engine.generate([prompt] * len(params), params):
        assert out.finish_reason is FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_and_regex_and_choice_and_ebnf(engine: Engine) -> None:
    cases = [
        (grammar("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (grammar("regex", r"[A-Z][a-z]{2,8} [0-9]{1,3}"), None),
        (grammar("choice", choices=("yes", "no", "maybe")), lambda t: t in ("yes", "no", "maybe")),
        (grammar("grammar", 'root ::= "(" [a-z]+ ")"'), lambda t: re.fullmatch(r"\([a-z]+\)", t)),
    ]
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    for g, check in cases:
        for seed in (5, 6):
            params = SamplingParams(grammar=g, temperature=0.6, seed=seed, max_tokens=80)
            [out] = engine.generate([PERSON_PROMPT], params)
            assert out.finish_reason is FinishReason.STOP, out.text
            if check is None:
                assert re.fullmatch(regex, out.text), out.text
            else:
                assert check(out.text), out.text


def test_unconstrained_neighbours_are_token_identical_to_their_solo_runs(engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)
    plain = prompts(3)
    solo = [
        engine.generate([p], q)[0].token_ids
        for p, q in zip(plain, [greedy, greedy, seeded], strict=True)
    ]
    mixed = engine.generate(
        [plain[0], PERSON_PROMPT, plain[1], plain[2], ORDER_PROMPT],
        [greedy, json_params(PERSON, temperature=0.7, seed=3), greedy, seeded, json_params(ORDER)],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids, mixed[3].token_ids] == solo
    jsonschema.validate(json.loads(mixed[1].text), PERSON)
    jsonschema.validate(json.loads(mixed[4].text), ORDER)


def test_max_tokens_mid_structure_ends_with_length(engine: Engine) -> None:
    [out] = engine.generate([ORDER_PROMPT], json_params(ORDER, temperature=0.0, max_tokens=8))
    assert out.finish_reason is FinishReason.LENGTH
    assert len(out.token_ids) == 8
    assert out.text.startswith("{")


def test_eos_exactly_where_the_grammar_may_end(engine: Engine) -> None:
    eos = set(engine.model_config.eos_token_ids)
    # The grammar may end after 3 digits and must end after 5: EOS is never earlier.
    g = grammar("regex", "[0-9]{3,5}")
    for seed in range(4):
        [out] = engine.generate(
            [PERSON_PROMPT], SamplingParams(grammar=g, temperature=1.5, seed=seed, max_tokens=20)
        )
        assert out.finish_reason is FinishReason.STOP
        assert re.fullmatch("[0-9]{3,5}", out.text), out.text
        assert out.token_ids[-1] in eos and not eos & set(out.token_ids[:-1])


def test_logprobs_are_after_the_mask(engine: Engine) -> None:
    choices = ("yes", "no")
    params = SamplingParams(
        grammar=grammar("choice", choices=choices), temperature=0.0, top_logprobs=5, max_tokens=5
    )
    [out] = engine.generate([PERSON_PROMPT], params)
    tokenizer = shared_model().tokenizer
    first = out.logprobs[0]
    allowed = [(t, lp) for t, lp in first.top if lp > -math.inf]
    assert allowed and first.logprob > -math.inf
    for token_id, _ in allowed:  # only tokens that start a choice
        assert any(c.startswith(tokenizer.decode([token_id])) for c in choices)
    assert math.isclose(sum(math.exp(lp) for _, lp in allowed), 1.0, rel_tol=1e-4)


def test_seeded_constrained_request_is_reproducible_and_batch_invariant(engine) -> None:
    params = json_params(PERSON, temperature=1.0, seed=42)
    alone = engine.generate([PERSON_PROMPT], params)[0].token_ids
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    batch = engine.generate([*prompts(3), PERSON_PROMPT], [plain] * 3 + [params])
    assert batch[3].token_ids == alone


def test_chunked_prefill_and_prefix_cache_give_the_same_output() -> None:
    params = json_params(ORDER, temperature=0.0)
    long_prompt = chat("Some context first. " * 30 + "Now write a JSON order.")
    whole = make_engine().generate([long_prompt], params)[0]
    chunked = make_engine(max_num_batched_tokens=32)
    first = chunked.generate([long_prompt], params)[0]
    cached = chunked.generate([long_prompt], params)[0]  # from the prefix cache
    assert cached.num_cached_tokens > 0
    assert first.token_ids == whole.token_ids == cached.token_ids
    jsonschema.validate(json.loads(whole.text), ORDER)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_constrained_outputs(mode: str) -> None:
    # Four short JSON answers (up to 6 blocks each, 2 of them shared) in 12: some are preempted.
    params = [json_params(PERSON, temperature=0.0, max_tokens=40)] + [
        json_params(PERSON, temperature=0.8, seed=s, max_tokens=40) for s in range(3)
    ]
    roomy = make_engine().generate([PERSON_PROMPT] * 4, params)
    tight = make_engine(num_blocks=12, preemption_mode=mode, max_num_seqs=4)
    outs = tight.generate([PERSON_PROMPT] * 4, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for out in outs:
        if out.finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(out.text), PERSON)


def test_async_output_gives_the_same_constrained_tokens() -> None:
    params = [json_params(PERSON, temperature=0.0), json_params(PERSON, temperature=0.9, seed=8)]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sync = make_engine().generate([PERSON_PROMPT] * 2 + prompts(1), params + [plain])
    async_ = make_engine(async_output=True).generate(
        [PERSON_PROMPT] * 2 + prompts(1), params + [plain]
    )
    assert [o.token_ids for o in async_] == [o.token_ids for o in sync]


class _BrokenTemplate:
    def deep_copy(self):
        raise RuntimeError("matcher broke")


def test_a_failing_matcher_fails_its_request_only(engine: Engine) -> None:
    broken = CompiledGrammar(Constraint("regex", "x"), _BrokenTemplate())
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    solo = engine.generate(prompts(2), plain)
    broken_params = dataclasses.replace(plain, ignore_eos=False, grammar=broken)
    engine.add_request("bad", PERSON_PROMPT, broken_params)
    engine.add_request("p0", prompts(2)[0], plain)
    engine.add_request("good", PERSON_PROMPT, json_params(PERSON, temperature=0.0))
    engine.add_request("p1", prompts(2)[1], plain)
    tokens: dict[str, list[int]] = {}
    failed, launches, steps = [], [], 0
    engine.runner.launch_hooks = (lambda: launches.append(1), lambda: None)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            failed += engine.take_failed()
            steps += 1
    finally:
        engine.runner.launch_hooks = None
    assert [rid for rid, _ in failed] == ["bad"]
    assert len(launches) == steps  # the failing row was failed alone: nothing ran twice
    assert [tokens["p0"], tokens["p1"]] == [o.token_ids for o in solo]
    text = shared_model().tokenizer.decode(tokens["good"], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), PERSON)
    assert len(engine.runner.sampler.grammars) == 0  # every matcher forgotten


def test_ignore_eos_with_a_grammar_is_refused() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=grammar("json_object"), ignore_eos=True)


WEATHER_TAG = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "end": "</function>",
        }
    ],
    "triggers": ["<function="],
}


def test_structural_tag_lets_text_through_and_holds_the_tagged_part_to_its_schema() -> None:
    g = grammar("structural_tag", json.dumps(WEATHER_TAG))
    encode = shared_model().tokenizer.encode

    def accepted(text: str) -> bool:
        ids = encode(text)
        return g.new_matcher().validate_tokens(ids) == len(ids)

    assert accepted("Let me look that up.")
    assert accepted('Sure. <function=get_weather>{"city": "Paris"}</function> Done.')
    assert not accepted('Sure. <function=get_weather>{"town": "Paris"}</function>')
    assert not accepted('<function=get_weather>{"city": "Paris"} and more')
    assert not accepted('<function=other>{"city": "Paris"}</function>')


def test_structural_tag_output_holds_its_schema_after_the_trigger(engine: Engine) -> None:
    # Free text until the trigger, then the structure: here a city the schema does not allow
    # is what the model writes unconstrained, so the tag's part must differ from that.
    city = {"enum": ["Paris", "Berlin"]}
    only = dict(WEATHER_TAG, structures=[dict(WEATHER_TAG["structures"][0])])
    only["structures"][0]["schema"] = {
        "type": "object",
        "properties": {"city": city},
        "required": ["city"],
        "additionalProperties": False,
    }
    tag = grammar("structural_tag", json.dumps(only))
    prompt = chat(
        "Call the weather tool for Oslo. Use exactly this format: "
        '<function=get_weather>{"city": "Oslo"}</function>'
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    [free] = engine.generate([prompt], greedy)
    [out] = engine.generate([prompt], dataclasses.replace(greedy, grammar=tag))
    begin, end = "<function=get_weather>", "</function>"
    assert '{"city": "Oslo"}' in free.text, free.text  # what the model writes unconstrained
    assert begin in out.text, out.text
    head = out.text.split(begin)[0]
    assert free.text.startswith(head), (free.text, out.text)  # free text as it was
    for part in out.text.split(begin)[1:]:
        body, closed, _ = part.partition(end)
        if closed:
            assert json.loads(body)["city"] in city["enum"], out.text
        else:
            assert out.finish_reason is FinishReason.LENGTH, out.text
