"""Draft verification in the sampler alone: greedy prefix + one, rejection sampling with
the distribution of plain sampling (chi-square), seeded streams as without drafts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from compute.core.sampling_params import SamplingParams
from compute.sampling.sampler import Sampler, truncate
from tests.engine.test_sampler import make_seq

V = 5


def one_hot_logits(tokens: list[int], vocab: int = V) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    for row, token in enumerate(tokens):
        logits[row, token] = 5.0
    return logits


@pytest.mark.parametrize(
    ("draft", "picks", "emitted"),
    [
        ((1, 2, 3), [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted + bonus
        ((1, 2, 3), [1, 0, 3, 4], [1, 0]),  # second rejected, corrected
        ((1, 2, 3), [0, 2, 3, 4], [0]),  # first rejected
        ((), [4], [4]),  # no draft: one token
    ],
)
def test_greedy_keeps_the_agreeing_prefix_plus_one(draft, picks, emitted) -> None:
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1)
    seq = make_seq("g", params)
    other = make_seq("o", SamplingParams(temperature=0.0))
    logits = torch.cat((one_hot_logits(picks), one_hot_logits([3])))
    ids, logprobs = Sampler(V).sample_drafts(logits, [seq, other], [draft, ()])
    assert ids == [emitted, [3]]
    assert [lp.token_id for lp in logprobs[0]] == emitted  # one logprob per emitted token
    assert logprobs[1] == [None]


def test_draft_for_a_penalized_request_is_refused() -> None:
    seq = make_seq("p", SamplingParams(repetition_penalty=1.3))
    with pytest.raises(ValueError, match="penalties"):
        Sampler(V).sample_drafts(torch.zeros(2, V), [seq], [(1,)])


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from for one row."""
    row = truncate((logits / params.temperature).unsqueeze(0), [params])
    return torch.softmax(row, dim=-1)[0]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
)
def test_rejection_sampling_matches_the_distribution_without_drafts(params) -> None:
    # Position 0 predicts the token after the sequence; position i > 0 the token after
    # draft[:i]. Without drafts, the first token ~ p0 and, after d1, the second ~ p1,
    # after d1 d2 the third ~ p2: the emitted tokens must follow exactly that.
    rows = torch.tensor(
        [[1.0, 0.6, 0.2, -0.3, -1.0], [0.0, 0.9, -0.2, 0.4, 0.1], [0.3, -0.5, 0.8, 0.0, 0.2]]
    )
    draft = (1, 3)
    p = [target(rows[i], params) for i in range(3)]
    n = 6000
    seqs = [make_seq(f"r{i}", params) for i in range(n)]
    ids, _ = Sampler(V, seed=11).sample_drafts(rows.repeat(n, 1), seqs, [draft] * n)
    first = Counter(e[0] for e in ids)
    second = Counter(e[1] for e in ids if e[0] == draft[0])
    third = Counter(e[2] for e in ids if e[:2] == list(draft))
    assert all(len(e) == 1 + sum(1 for _ in _accepted(e, draft)) for e in ids)
    # df <= 4; 30 is p ~ 5e-6 under the null, and the seeds are fixed: never flakes.
    assert chi_square(first, p[0], n) < 30
    assert chi_square(second, p[1], sum(second.values())) < 30
    assert chi_square(third, p[2], sum(third.values())) < 30
    assert sum(third.values()) > 300  # enough fully accepted drafts to test the bonus row


def chi_square(counts: Counter, expected: torch.Tensor, total: int) -> float:
    """Pearson's statistic over the tokens with mass; one without mass must never occur."""
    assert all(expected[token] > 0 for token in counts)
    return sum(
        (counts[i] - total * p) ** 2 / (total * p) for i, p in enumerate(expected.tolist()) if p
    )


def _accepted(emitted: list[int], draft: tuple[int, ...]):
    for token, guess in zip(emitted, draft, strict=False):
        if token != guess:
            return
        yield token


def test_seeded_request_draws_the_stream_it_draws_without_drafts() -> None:
    params = SamplingParams(temperature=1.0, seed=99)
    rows = torch.randn((40, V), generator=torch.Generator().manual_seed(1))
    # Without drafts: one row per step (the logits do not depend on the tokens here).
    plain_sampler, seq = Sampler(V), make_seq("s", params)
    plain = [plain_sampler.sample(rows[i : i + 1], [seq])[0][0] for i in range(40)]
    # With drafts of 3 guessed as the plain stream, one wrong token every few steps.
    spec_sampler, spec_seq = Sampler(V), make_seq("s", params)
    got, i, step = [], 0, 0
    while i < 37:
        draft = list(plain[i : i + 3])
        if step % 3 == 1:
            draft[step % 2] = (draft[step % 2] + 1) % V
        ids, _ = spec_sampler.sample_drafts(rows[i : i + 4], [spec_seq], [tuple(draft)])
        got += ids[0]
        i += len(ids[0])
        step += 1
    assert got == plain[: len(got)]
