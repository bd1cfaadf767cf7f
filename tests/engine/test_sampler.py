"""Sampler tests: greedy, distributions, truncation vs HF warpers, penalties, seeds, logprobs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import compute.sampling.sampler as sampler_module
from compute.core.sampling_params import SamplingParams
from compute.core.sequence import Sequence
from compute.sampling.penalties import Penalties
from compute.sampling.sampler import Sampler, truncate
from kernels.cpu.library import available

VOCAB = 64


def make_seq(
    rid: str,
    params: SamplingParams,
    prompt: tuple[int, ...] = (1, 2, 3),
    output: tuple[int, ...] = (),
) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        arrival_time=0.0,
        output_token_ids=list(output),
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * 3


# --- greedy ---------------------------------------------------------------------------

# Greedy rows take torch's argmax, or (native_argmax, the CPU kernels' engines) the kernel's.
ARGMAX = [
    pytest.param(False, id="torch"),
    pytest.param(
        True,
        id="kernel",
        marks=pytest.mark.skipif(not available(), reason="no CPU kernels here"),
    ),
]


@pytest.mark.parametrize("native", ARGMAX)
def test_greedy_is_argmax(native: bool) -> None:
    logits = random_logits(8)
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=0.0)) for i in range(8)]
    tokens, logprobs = Sampler(VOCAB, native_argmax=native).sample(logits, seqs)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 8


@pytest.mark.parametrize("native", ARGMAX)
def test_greedy_ties_break_to_lowest_id(native: bool) -> None:
    logits = torch.zeros((3, VOCAB))
    logits[0, [7, 3, 40]] = 5.0
    logits[1, :] = 1.0
    logits[2, :] = float("-inf")  # every token masked: id 0, as torch answers
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=0.0)) for i in range(3)]
    assert Sampler(VOCAB, native_argmax=native).sample(logits, seqs)[0] == [3, 0, 0]


@pytest.mark.parametrize("native", ARGMAX)
def test_greedy_rows_mixed_with_random_rows(native: bool) -> None:
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    seqs = [make_seq(f"r{i}", p) for i, p in enumerate(params)]
    tokens, _ = Sampler(VOCAB, native_argmax=native).sample(logits, seqs)
    for i in (1, 3, 5):
        assert tokens[i] == int(logits[i].argmax())


def test_top_k_one_is_argmax_at_any_temperature() -> None:
    logits = random_logits(16)
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=2.0, top_k=1)) for i in range(16)]
    assert Sampler(VOCAB).sample(logits, seqs)[0] == logits.argmax(dim=-1).tolist()


def test_min_p_one_keeps_only_the_best_token() -> None:
    logits = random_logits(16)
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=1.5, min_p=1.0)) for i in range(16)]
    assert Sampler(VOCAB).sample(logits, seqs)[0] == logits.argmax(dim=-1).tolist()


def test_greedy_applies_penalties() -> None:
    """Convention (vLLM, HF generate): temperature 0 is argmax of the penalized logits."""
    logits = torch.zeros((1, VOCAB))
    logits[0, 5], logits[0, 9] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler(VOCAB).sample(logits, [make_seq("r", params, prompt=(5,))])[0] == [9]


# --- distributions ----------------------------------------------------------------------


def chi_square(counts: Counter, expected: torch.Tensor, total: int) -> float:
    return sum((counts[i] - total * p) ** 2 / (total * p) for i, p in enumerate(expected.tolist()))


def test_temperature_distribution_matches_softmax() -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    expected = torch.softmax(base / 0.7, dim=0)
    sampler, counts, rows = Sampler(5, seed=123), Counter(), 2000
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=0.7)) for i in range(rows)]
    for _ in range(10):
        counts.update(sampler.sample(base.expand(rows, 5).contiguous(), seqs)[0])
    # df = 4; 30 is p ~ 5e-6 under the null. The seed is fixed, so this never flakes.
    assert chi_square(counts, expected, 10 * rows) < 30


def test_seeded_stream_distribution_matches_softmax() -> None:
    base = torch.tensor([[0.3, 0.0, -0.4, 1.0]])
    expected = torch.softmax(base[0], dim=0)
    sampler, seq, counts = Sampler(4), make_seq("s", SamplingParams(seed=7)), Counter()
    for _ in range(3000):
        counts.update(sampler.sample(base, [seq])[0])
    assert chi_square(counts, expected, 3000) < 28  # df = 3


# --- truncation -------------------------------------------------------------------------


def allowed_tokens(logits: np.ndarray, p: SamplingParams, tol: float = 1e-5) -> set[int]:
    """Independent float64 reference: tokens a correct sampler may return (with slack)."""
    scaled = logits / p.temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones_like(scaled, dtype=bool)
    if p.top_k > 0:
        kth = scaled[order[min(p.top_k, len(scaled)) - 1]]
        keep &= scaled >= kth
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    mass_above = np.array([probs[probs > q].sum() for q in probs])
    keep &= (mass_above < p.top_p + tol) | (p.top_p >= 1.0)
    probs = np.where(keep, probs, 0.0)
    keep &= probs >= p.min_p * probs.max() - tol
    return set(np.flatnonzero(keep).tolist())


truncation_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.integers(min_value=-1, max_value=12),
    top_p=st.floats(min_value=0.05, max_value=1.0),
    min_p=st.floats(min_value=0.0, max_value=1.0),
)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(min_value=-8, max_value=8, width=32), min_size=2, max_size=24),
    params=truncation_params,
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_truncation_only_returns_allowed_tokens(
    logits: list[float], params: SamplingParams, seed: int
) -> None:
    rows, vocab = 32, len(logits)
    row = torch.tensor(logits, dtype=torch.float32)
    seqs = [make_seq(f"r{i}", params) for i in range(rows)]
    tokens, _ = Sampler(vocab, seed=seed).sample(row.expand(rows, vocab).contiguous(), seqs)
    allowed = allowed_tokens(row.double().numpy(), params)
    assert set(tokens) <= allowed


def hf_truncate(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = row.unsqueeze(0)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores[0]


TRUNCATION_CASES = [
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.1),
    SamplingParams(top_k=20, top_p=0.8),
    SamplingParams(top_k=30, top_p=0.9, min_p=0.05),
    SamplingParams(top_k=100),  # wider than the vocabulary
    SamplingParams(),
]


def test_truncation_matches_hf_warpers_per_row() -> None:
    """Each row has its own parameters; each must match HF's warpers on that row alone."""
    logits = random_logits(len(TRUNCATION_CASES), seed=3)
    ours = truncate(logits, TRUNCATION_CASES)
    for i, p in enumerate(TRUNCATION_CASES):
        theirs = hf_truncate(logits[i], p)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(theirs)), p
        kept = torch.isfinite(theirs)
        assert torch.equal(ours[i][kept], theirs[kept])


def test_truncation_skipped_when_no_row_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("sorted without top-k/top-p")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    logits = random_logits(3)
    assert truncate(logits, [SamplingParams()] * 3) is logits


# --- penalties --------------------------------------------------------------------------

PENALTY_SEQS = [
    ((1, 2, 3), (4, 4, 5)),
    ((10, 10, 11), ()),
    ((), (60, 1, 60, 60)),
    ((7,), (8,)),
]


def test_repetition_penalty_matches_hf() -> None:
    penalties = [1.3, 0.8, 2.0, 1.0]
    seqs = [
        make_seq(f"r{i}", SamplingParams(repetition_penalty=pen), prompt, output)
        for i, ((prompt, output), pen) in enumerate(zip(PENALTY_SEQS, penalties, strict=True))
    ]
    logits = random_logits(4, seed=5)
    ours = Penalties(VOCAB).apply(logits, seqs)
    for i, seq in enumerate(seqs):
        ids = torch.tensor([seq.all_token_ids], dtype=torch.long)
        theirs = RepetitionPenaltyLogitsProcessor(penalties[i])(ids, logits[i : i + 1].clone())
        assert torch.equal(ours[i], theirs[0])


def test_presence_and_frequency_penalties_exact() -> None:
    presence, frequency = [0.5, -1.0, 2.0, 0.0], [0.25, 1.5, -0.75, 0.0]
    seqs = [
        make_seq(f"r{i}", SamplingParams(presence_penalty=pr, frequency_penalty=fr), prompt, output)
        for i, ((prompt, output), pr, fr) in enumerate(
            zip(PENALTY_SEQS, presence, frequency, strict=True)
        )
    ]
    # Small dyadic values: every expected result is exactly representable.
    logits = torch.arange(4 * VOCAB, dtype=torch.float32).reshape(4, VOCAB) / 4 - 30
    expected = logits.clone()
    for i, seq in enumerate(seqs):
        for token, count in Counter(seq.output_token_ids).items():  # output only, not prompt
            expected[i, token] -= presence[i] + frequency[i] * count
    assert torch.equal(Penalties(VOCAB).apply(logits, seqs), expected)


def test_penalties_only_touch_rows_that_ask() -> None:
    seqs = [
        make_seq("a", SamplingParams(repetition_penalty=1.5), (1, 2), (3,)),
        make_seq("b", SamplingParams(), (1, 2), (3,)),
        make_seq("c", SamplingParams(frequency_penalty=1.0), (1, 2), (3,)),
    ]
    logits = random_logits(3)
    out = Penalties(VOCAB).apply(logits, seqs)
    assert torch.equal(out[1], logits[1])
    assert not torch.equal(out[0], logits[0]) and not torch.equal(out[2], logits[2])


def test_no_penalty_work_when_no_row_asks() -> None:
    logits = random_logits(2)
    seqs = [make_seq(f"r{i}", SamplingParams(), (1, 2), (3,)) for i in range(2)]
    assert Penalties(VOCAB).apply(logits, seqs) is logits


def test_prompt_cache_follows_request_and_forget() -> None:
    penalties, logits = Penalties(VOCAB), random_logits(1)
    params = SamplingParams(repetition_penalty=2.0)
    first = penalties.apply(logits, [make_seq("r", params, prompt=(1, 2))])
    penalties.forget("r")
    again = penalties.apply(logits, [make_seq("r", params, prompt=(5, 6))])
    assert not torch.equal(first, again)  # the new prompt was used, not the cached one


# --- seeds --------------------------------------------------------------------------------

SEED_VOCAB = 500
TARGET = SamplingParams(
    temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3, seed=1234
)
FILLERS = [
    SamplingParams(seed=1234),  # same seed, another request: must not disturb the target
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.0),
    SamplingParams(seed=99, min_p=0.1),
    SamplingParams(top_k=3, frequency_penalty=1.0),
    SamplingParams(logprobs=True, top_logprobs=5),
]


def target_logits(step: int) -> torch.Tensor:
    return torch.randn(SEED_VOCAB, generator=torch.Generator().manual_seed(10_000 + step)) * 2


def run_seeded(
    batch_size: int, row: int, sampler_seed: int, steps: int = 12, device: str = "cpu"
) -> list[int]:
    """The target's tokens over ``steps`` steps, at ``row`` of a batch of fillers."""
    sampler = Sampler(SEED_VOCAB, seed=sampler_seed)
    filler_gen = torch.Generator().manual_seed(sampler_seed)
    target = make_seq("target", TARGET, prompt=(4, 8, 15, 16, 23, 42))
    others = [make_seq(f"f{i}", FILLERS[i % len(FILLERS)]) for i in range(batch_size - 1)]
    for _ in range(steps):
        seqs = others[:row] + [target] + others[row:]
        logits = torch.randn((batch_size, SEED_VOCAB), generator=filler_gen) * 2
        logits[row] = target_logits(target.num_output_tokens)
        tokens, _ = sampler.sample(logits.to(device), seqs)
        for seq, token in zip(seqs, tokens, strict=True):
            seq.output_token_ids.append(token)
    return target.output_token_ids


def test_seeded_request_is_batch_invariant() -> None:
    alone = run_seeded(batch_size=1, row=0, sampler_seed=0)
    assert len(set(alone)) > 1  # actually random, not stuck on one token
    for batch_size, row, sampler_seed in [
        (5, 3, 1),
        (5, 0, 2),
        (32, 0, 3),
        (32, 17, 4),
        (32, 31, 5),
    ]:
        assert run_seeded(batch_size, row, sampler_seed) == alone, (batch_size, row)


def test_different_seeds_give_different_streams() -> None:
    logits = target_logits(0).expand(20, SEED_VOCAB).contiguous()
    seqs = [make_seq(f"r{i}", SamplingParams(seed=i)) for i in range(20)]
    assert len(set(Sampler(SEED_VOCAB).sample(logits, seqs)[0])) > 5


def test_forget_restarts_the_seeded_stream() -> None:
    sampler, logits = Sampler(SEED_VOCAB), target_logits(0).unsqueeze(0)
    first = [
        sampler.sample(logits, [make_seq("r", SamplingParams(seed=5))])[0][0] for _ in range(8)
    ]
    sampler.forget("r")
    again = [
        sampler.sample(logits, [make_seq("r", SamplingParams(seed=5))])[0][0] for _ in range(8)
    ]
    assert first == again


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = target_logits(0).expand(16, SEED_VOCAB).contiguous()
    seqs = [make_seq(f"r{i}", SamplingParams()) for i in range(16)]
    a, b = Sampler(SEED_VOCAB, seed=1), Sampler(SEED_VOCAB, seed=1)
    assert a.sample(logits, seqs)[0] == b.sample(logits, seqs)[0]
    assert a.sample(logits, seqs)[0] != Sampler(SEED_VOCAB, seed=2).sample(logits, seqs)[0]


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top() -> None:
    params = [
        SamplingParams(logprobs=True),
        SamplingParams(),
        SamplingParams(top_logprobs=20, temperature=0.0),
        SamplingParams(logprobs=True, top_logprobs=3, repetition_penalty=1.5, temperature=0.5),
    ]
    seqs = [make_seq(f"r{i}", p, prompt=(1, 2), output=(3,)) for i, p in enumerate(params)]
    logits = random_logits(4, seed=9)
    tokens, logprobs = Sampler(VOCAB).sample(logits, seqs)
    reference = torch.log_softmax(logits, dim=-1)  # raw logits: before penalties/temperature
    assert logprobs[1] is None
    for i in (0, 2, 3):
        lp = logprobs[i]
        assert lp is not None and lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(reference[i, tokens[i]].item(), abs=1e-5)
        n = params[i].top_logprobs
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        top_values, top_ids = reference[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert values == pytest.approx(top_values.tolist(), abs=1e-5)
    assert logprobs[2].top[0][0] == tokens[2]  # greedy: the sampled token is the best one


def test_no_logprob_work_when_not_requested(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("log_softmax computed although no row asked")

    monkeypatch.setattr(torch, "log_softmax", forbidden)
    monkeypatch.setattr(torch.nn.functional, "log_softmax", forbidden)
    monkeypatch.setattr(torch.Tensor, "log_softmax", forbidden)
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=0.0 if i else 1.0)) for i in range(4)]
    _, logprobs = Sampler(VOCAB).sample(random_logits(4), seqs)
    assert logprobs == [None] * 4


# --- API edges ----------------------------------------------------------------------------


def test_empty_batch() -> None:
    assert Sampler(VOCAB).sample(torch.empty((0, VOCAB)), []) == ([], [])


def test_wrong_logits_shape_raises() -> None:
    seqs = [make_seq("r", SamplingParams())]
    with pytest.raises(ValueError, match="^logits"):
        Sampler(VOCAB).sample(torch.zeros((1, VOCAB + 1)), seqs)
    with pytest.raises(ValueError, match="^logits"):
        Sampler(VOCAB).sample(torch.zeros((2, VOCAB)), seqs)


def test_tiny_temperature_stays_finite() -> None:
    logits = random_logits(4) * 1e4
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=1e-30)) for i in range(4)]
    assert Sampler(VOCAB).sample(logits, seqs)[0] == logits.argmax(dim=-1).tolist()


def test_sampled_tokens_never_masked_out() -> None:
    """A -inf logit (e.g. a banned token) is never drawn, whatever the noise."""
    logits = torch.full((256, 8), float("-inf"))
    logits[:, 2] = 0.0
    logits[:, 5] = 0.0
    seqs = [make_seq(f"r{i}", SamplingParams(seed=i if i % 2 else None)) for i in range(256)]
    assert set(Sampler(8).sample(logits, seqs)[0]) <= {2, 5}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_invariance_and_logprobs() -> None:
    alone = run_seeded(batch_size=1, row=0, sampler_seed=0, device="cuda")
    assert len(set(alone)) > 1
    for batch_size, row in [(5, 3), (32, 17)]:
        assert run_seeded(batch_size, row, sampler_seed=row, device="cuda") == alone
    seqs = [make_seq(f"r{i}", p) for i, p in enumerate(FILLERS)]
    logits = random_logits(len(FILLERS), SEED_VOCAB).cuda()
    tokens, logprobs = Sampler(SEED_VOCAB).sample(logits, seqs)
    assert tokens[2] == int(logits[2].argmax())
    assert logprobs[-1] is not None and len(logprobs[-1].top) == 5


@pytest.mark.parametrize("seed", range(6))
def test_candidate_cut_keeps_what_the_full_sort_keeps(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """The CPU cut among each row's best candidates (two tiers, then the full sort) keeps
    exactly the tokens (and logits) of the full stable sort, with ties (rounded logits),
    -inf tokens, every mix of top-k/top-p/off rows, and nuclei wider than the candidates
    (those rows fall back)."""
    monkeypatch.setattr(sampler_module, "_CANDIDATES", (8, 16))
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 64, 100
    logits = torch.randn(rows, vocab, generator=gen) * (1 + 3 * torch.rand(rows, 1, generator=gen))
    logits[: rows // 2] = logits[: rows // 2].round()  # ties, also at the candidates' edge
    logits[::5, ::3] = float("-inf")
    logits[7, 1:] = float("-inf")  # a single allowed token
    top_k = torch.tensor([(1, 3, 8, 9, 50, vocab)[i % 6] for i in range(rows)])
    top_p = torch.tensor([(0.0, 0.3, 0.6, 0.9, 0.999, 1.0)[(i // 6) % 6] for i in range(rows)])
    exact = [0, 0]  # rows cut exactly among 8 candidates, among 16
    for k, p in ((top_k, top_p), (None, top_p), (top_k, None)):
        ours = sampler_module.apply_top_k_top_p(logits, k, p)
        reference = sampler_module._top_k_top_p_sorted(logits, k, p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(reference))
        assert torch.equal(ours[torch.isfinite(ours)], reference[torch.isfinite(reference)])
        for tier, c in enumerate((8, 16)):
            exact[tier] += int(sampler_module._cut_among_candidates(logits, k, p, c)[1].sum())
    assert 0 < exact[0] < exact[1] < 3 * rows  # both tiers and the full sort ran
