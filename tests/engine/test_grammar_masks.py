"""GrammarMasks on its own (compute/sampling/grammar_masks.py): the host path masks in place exactly
as the device path and llguidance's reference do, touches no unconstrained row, and the
parallel fill writes the same bitmask as the serial one. The engine-level behaviour is in
test_constraints.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from llguidance.numpy import apply_token_bitmask_inplace

from compute.core.grammar import Constraint
from compute.core.sampling_params import SamplingParams
from compute.core.sequence import PLACEHOLDER, Sequence
from compute.sampling.grammar_compiler import GrammarCompiler
from compute.sampling.grammar_masks import GrammarMasks, _runs, mask_in_place
from tests.engine.test_engine import shared_model
from tests.support.schemas import ORDER, PERSON

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    model = shared_model()
    return GrammarCompiler.for_tokenizer(model.tokenizer, model.config.vocab_size)


def seq(request_id: str, params: SamplingParams, output: list[int] | None = None) -> Sequence:
    return Sequence(request_id, [1, 2, 3], params, time.monotonic(), output_token_ids=output or [])


def batch(compiler: GrammarCompiler) -> list[Sequence]:
    """Five rows: constrained at 0, 2 and 3 (a run and a lone row), plain at 1 and 4."""
    person = compiler.compile(Constraint("json_schema", json.dumps(PERSON)))
    order = compiler.compile(Constraint("json_schema", json.dumps(ORDER)))
    digits = compiler.compile(Constraint("regex", "[0-9]{2,4}"))
    tokenizer = shared_model().tokenizer
    plain = SamplingParams(temperature=0.0)
    return [
        seq("a", SamplingParams(grammar=person), tokenizer.encode('{"name": "A')),
        seq("b", plain, [5, 6]),
        seq("c", SamplingParams(grammar=order)),
        seq("d", SamplingParams(grammar=digits), tokenizer.encode("1")),
        seq("e", plain),
    ]


def test_runs_of_adjacent_rows() -> None:
    assert _runs([]) == []
    assert _runs([0, 1, 2, 5]) == [(0, 3), (5, 6)]
    assert _runs([3]) == [(3, 4)]
    assert _runs([1, 3, 4, 6]) == [(1, 2), (3, 5), (6, 7)]


def test_host_mask_in_place_matches_the_device_path_and_the_reference(compiler) -> None:
    seqs = batch(compiler)
    vocab = shared_model().config.vocab_size
    with torch.inference_mode():  # as the model's logits are
        logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    host = GrammarMasks(vocab)
    masked = host.apply(logits, seqs)
    assert masked is logits  # in place on the CPU
    device_path = GrammarMasks(vocab)
    rows = [0, 2, 3]
    bitmask, faults = device_path._fill(seqs, rows, parallel=False)
    assert not faults
    expected = device_path._mask_on_device(before, bitmask, rows)
    assert torch.equal(masked, expected)
    for row in (1, 4):  # untouched, bit for bit
        assert torch.equal(masked[row], before[row])
    reference = before.numpy().copy()[rows]
    apply_token_bitmask_inplace(reference, bitmask[rows].copy())
    assert np.array_equal(masked.numpy()[rows], reference)
    for row in rows:  # each constrained row allows some tokens and bans others
        assert 0 < int(torch.isfinite(masked[row]).sum()) < vocab


def test_every_row_constrained_on_the_device_path(compiler) -> None:
    seqs = [s for s in batch(compiler) if s.sampling_params.grammar is not None]
    vocab = shared_model().config.vocab_size
    logits = torch.randn(len(seqs), vocab)
    masks = GrammarMasks(vocab)
    bitmask, faults = masks._fill(seqs, [0, 1, 2], parallel=False)
    assert not faults
    expected = mask_in_place(logits.clone(), bitmask, [0, 1, 2])
    assert torch.equal(masks._mask_on_device(logits, bitmask, [0, 1, 2]), expected)


def test_parallel_fill_writes_the_serial_bitmask(compiler) -> None:
    seqs = batch(compiler)
    rows = [0, 2, 3]
    serial = GrammarMasks(shared_model().config.vocab_size)._fill(seqs, rows, False)[0][rows]
    parallel = GrammarMasks(shared_model().config.vocab_size)._fill(seqs, rows, True)[0][rows]
    assert np.array_equal(serial, parallel)


def test_matchers_advance_once_per_new_token(compiler) -> None:
    tokenizer = shared_model().tokenizer
    vocab = shared_model().config.vocab_size
    [s] = [seq("a", SamplingParams(grammar=compiler.compile(Constraint("regex", "ab+c"))))]
    masks = GrammarMasks(vocab)
    for text in ("a", "ab", "abb"):
        s.output_token_ids = tokenizer.encode(text)
        masks.apply(torch.zeros(1, vocab), [s])
    assert masks._tracked["a"].consumed == len(s.output_token_ids)
    s.output_token_ids = s.output_token_ids + [PLACEHOLDER]
    # A failing matcher fails its row only: left unmasked, named in `faulty` with why.
    logits = masks.apply(torch.zeros(1, vocab), [s])
    assert set(masks.faulty) == {"a"} and "before its last token is known" in masks.faulty["a"]
    assert bool((logits == 0).all())
    s.output_token_ids = tokenizer.encode("x")  # shorter: a new matcher, which rejects it
    masks.apply(torch.zeros(1, vocab), [s])
    assert masks.faulty["a"].startswith("a: ")
    assert len(masks) == 0
