"""Sampler: one step's logits -> next token ids (and logprobs), on the model's device.

The model runner calls ``Sampler.sample_on_device`` once per step with the logits of the
sequences that sample, one row per sequence in schedule order (``sample_drafts`` for a step
that verifies drafts; ``sample`` is the same, read back on the host). Per row: the grammar
mask (compute/sampling/grammar_masks.py, constrained rows only), logit_bias and min_tokens
(compute/sampling/logit_processors.py), penalties, then either greedy argmax (temperature 0)
or temperature -> top-k -> top-p -> min-p -> random draw.
Every stage is batched over the rows with per-row parameter tensors, and a stage that
no row asks for is skipped entirely (no sort without top-k/top-p, no log_softmax
without logprobs, no count tensors without penalties).

Conventions:

- Penalties apply to greedy rows too (as in vLLM and HF ``generate``): temperature 0
  means argmax of the penalized logits, ties broken by the lowest token id.
- Logprobs are vLLM's "raw" logprobs: log_softmax of the model's logits as given,
  before penalties, temperature and truncation, but after a request's grammar mask
  (applied first): a constrained request's logprobs are those of
  the distribution over the tokens its grammar allows, and never list a forbidden token
  (as vLLM, which masks before its sampler).
- Random draws invert the CDF: one uniform ``u`` per row picks the first token whose
  float64 cumulative probability exceeds ``u * total``. A seeded request draws its one
  uniform per token from its own generator, so its draws depend neither on the other
  rows of the batch nor on its row position. (Its logits do too only where the model's
  sums do not depend on the batch: the CPU kernels' quantized matmuls sum in one fixed
  order, but ``--weights dense`` projections go through torch's GEMM, whose sums change
  with the row count (~1e-5 on the embedded model), as GPU GEMMs may: enough to move a
  draw that lands that close to a token's boundary.) Unseeded rows share the sampler's
  generator in one batched draw. (An exponential race, ``argmax(probs / E)``, needs a
  vocabulary's worth of random numbers per token: 3M per step at batch 64, which cost
  more than the model's attention on a CPU.)
- Top-p always keeps each row's best token, whatever ``top_p`` is, so a row can never
  be left with no token to draw (which would pick id == vocab).
- ``rewind`` undoes the last ``sample`` call's draws from the generators, so the engine
  can run a failed step again (without the request at fault) and every seeded request
  still gets the tokens it would have got.
- Speculative decoding (``sample_drafts``): a drafted sequence has one logits row per
  position, its last token's and each draft token's, and every row is sampled as above,
  as if it were the next token. The draft token at a row is accepted when the row's pick
  equals it; the first row whose pick differs gives the corrected token, and a fully
  accepted draft gets the last row's pick as a bonus token. Greedy, that is the longest
  agreeing prefix plus one. Random, it is rejection sampling against the draft's point
  mass: the inverse-CDF pick equals draft token t with probability p(t), and otherwise
  is distributed as p with t removed and renormalised; so the emitted tokens have the
  distribution they have without speculation. A seeded request's generator is left
  having drawn exactly one uniform per emitted token, so its stream is the one it draws
  without speculation (the same tokens, where the logits are the same).
- Call ``forget`` when a request finishes or aborts, not when it is preempted: a
  preempted request resumes its seeded stream where it stopped.
"""

from __future__ import annotations

import torch

from compute.core.messages import TokenLogprob
from compute.core.sampling_params import SamplingParams
from compute.core.sequence import Sequence
from compute.sampling.fault_hook import FaultHook
from compute.sampling.grammar_masks import GrammarMasks
from compute.sampling.logit_processors import process_logits
from compute.sampling.penalties import Penalties
from kernels.cpu.elementwise import argmax_rows
from kernels.transfer import device_tensor

# Below this the division overflows to inf (then NaN in softmax) for large logits;
# at 1e-5 the distribution is already a point mass up to exact ties.
_MIN_TEMPERATURE = 1e-5


class Sampler:
    """Batched, device-side sampling with per-request generators for seeded requests."""

    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        native_argmax: bool = False,
    ) -> None:
        """``native_argmax``: greedy rows of CPU float32 logits take their argmax from the CPU
        kernels (the same ids as torch's, rows on every thread; the model runs on them)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1 (got {vocab_size!r})")
        self.vocab_size = vocab_size
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)  # banned before a request's min_tokens
        self._penalties = Penalties(vocab_size)
        self.grammars = GrammarMasks(vocab_size)
        self._global_generators: dict[torch.device, torch.Generator] = {}
        self._request_generators: dict[str, torch.Generator] = {}
        # Generator states before the last sample call's draws (see ``rewind``).
        self._states_before: list[tuple[torch.Generator, torch.Tensor]] = []
        self.faults: FaultHook | None = None  # tests only (compute/sampling/fault_hook.py)
        self.native_argmax = native_argmax

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Token ids and logprobs (None where not asked), one per row of ``logits``."""
        tokens, logprobs = self.sample_on_device(logits, seqs)
        return tokens.tolist(), logprobs.to_host().records()

    def sample_on_device(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[torch.Tensor, LogprobRows]:
        """``sample`` without waiting for the device: int64 token ids [rows] and the
        logprobs, both still on ``logits``' device (the caller copies them when it will).
        On the CPU the grammar masks constrained rows of float32 ``logits`` in place."""
        self._check_logits(logits, seqs)
        params = [s.sampling_params for s in seqs]
        if not seqs:
            return torch.empty(0, dtype=torch.long, device=logits.device), LogprobRows(params)
        logits = logits.float()  # no copy when already float32
        logits = self.grammars.apply(logits, seqs)  # constrained rows only, before the rest
        processed = process_logits(logits, seqs, self.eos_token_ids)  # logit_bias, min_tokens
        penalized = self._penalties.apply(processed, seqs)
        tokens = self._choose(penalized, seqs)
        if self.faults is not None:
            self.faults.check_sampling(seqs)
            tokens = self.faults.corrupt(tokens, seqs, self.vocab_size)
        return tokens, logprob_rows(logits, tokens, params)

    def sample_drafts(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[tuple[int, ...]]
    ) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
        """Verify drafts: per sequence, the tokens it emits (1 + accepted) and their
        logprobs, on the host. ``logits`` has 1 + len(drafts[i]) consecutive rows for
        sequence i: after its last token, then after each draft token. Requests with
        penalties must come without a draft (their history would need the draft)."""
        rows = [seq for seq, draft in zip(seqs, drafts, strict=True) for _ in range(1 + len(draft))]
        saved = {}  # seeded drafted requests: their generator before this step's draws
        for seq, draft in zip(seqs, drafts, strict=True):
            if draft and seq.sampling_params.penalized:
                raise ValueError(f"{seq.request_id}: a draft for a request with penalties")
            if draft and not seq.sampling_params.greedy and seq.sampling_params.seed is not None:
                generator = self._request_generator(seq, logits.device)
                saved[seq.request_id] = (generator, generator.get_state())
        tokens, logprobs = self.sample_on_device(logits, rows)
        ids, records = tokens.tolist(), logprobs.to_host().records()
        emitted_ids: list[list[int]] = []
        emitted_logprobs: list[list[TokenLogprob | None]] = []
        row = 0
        for seq, draft in zip(seqs, drafts, strict=True):
            n = 1
            while n <= len(draft) and ids[row + n - 1] == draft[n - 1]:
                n += 1
            emitted_ids.append(ids[row : row + n])
            emitted_logprobs.append(records[row : row + n])
            row += 1 + len(draft)
            if seq.request_id in saved and n < 1 + len(draft):
                # One uniform per emitted token, as without speculation.
                generator, state = saved[seq.request_id]
                generator.set_state(state)
                for _ in range(n):
                    torch.rand(1, dtype=torch.float64, device=logits.device, generator=generator)
        return emitted_ids, emitted_logprobs

    def commit(self) -> None:
        """Keep the draws made so far: a later ``rewind`` goes back no further."""
        self._states_before = []

    def rewind(self) -> None:
        """Put every generator drawn from since ``commit`` back where it was."""
        for generator, state in reversed(self._states_before):
            generator.set_state(state)
        self._states_before = []

    def forget(self, request_id: str) -> None:
        """Drop the request's generator and cached prompt (finished or aborted)."""
        self._request_generators.pop(request_id, None)
        self._penalties.forget(request_id)
        self.grammars.forget(request_id)

    def take_faulty(self) -> dict[str, str]:
        """The requests whose grammar failed in the latest sample call (request id -> why),
        once: their rows were sampled unmasked and must not be used."""
        faulty, self.grammars.faulty = self.grammars.faulty, {}
        return faulty

    def _check_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        expected = (len(seqs), self.vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected:
            raise ValueError(f"logits: expected shape {expected}, got {tuple(logits.shape)}")

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        greedy = [i for i, s in enumerate(seqs) if s.sampling_params.greedy]
        if len(greedy) == len(seqs):
            return self._argmax(logits)
        if not greedy:
            return self._draw(logits, seqs)
        randomized = [i for i, s in enumerate(seqs) if not s.sampling_params.greedy]
        greedy_index = _index(greedy, logits.device)
        random_index = _index(randomized, logits.device)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        tokens[greedy_index] = self._argmax(logits[greedy_index])
        tokens[random_index] = self._draw(logits[random_index], [seqs[i] for i in randomized])
        return tokens

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, the lowest of equal ids. torch's CPU argmax reduces a row on
        one thread (1.9 ms for 48 rows of 49,152 logits); the kernel takes ~0.3 ms."""
        if (
            self.native_argmax
            and logits.device.type == "cpu"
            and logits.dtype == torch.float32
            and logits.is_contiguous()
        ):
            return argmax_rows(logits)
        return logits.argmax(dim=-1)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One random token per row: temperature, truncation, then an inverse-CDF draw."""
        params = [s.sampling_params for s in seqs]
        temperature = _column(params, "temperature", logits).clamp_min(_MIN_TEMPERATURE)
        logits = truncate(logits / temperature.unsqueeze(1), params)
        cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1, dtype=torch.float64)
        # Strictly below the total, so the pick is at most the last token with mass; a
        # masked (zero-probability) token never gets a cdf step, so it is never picked.
        target = self._uniforms(seqs, logits.device) * cdf[:, -1] * (1.0 - 1e-12)
        return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)

    def _uniforms(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """One float64 U[0, 1) per row; seeded rows from their own generators."""
        u = torch.empty(len(seqs), dtype=torch.float64, device=device)
        seeded = [i for i, s in enumerate(seqs) if s.sampling_params.seed is not None]
        unseeded = [i for i, s in enumerate(seqs) if s.sampling_params.seed is None]
        if unseeded:
            generator = self._global_generator(device)
            self._states_before.append((generator, generator.get_state()))
            draws = torch.rand(
                len(unseeded), dtype=torch.float64, device=device, generator=generator
            )
            u[_index(unseeded, device)] = draws
        for i in seeded:
            # Exactly one draw per token keeps the stream independent of the batch.
            generator = self._request_generator(seqs[i], device)
            self._states_before.append((generator, generator.get_state()))
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)[0]
        return u

    def _global_generator(self, device: torch.device) -> torch.Generator:
        generator = self._global_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._global_generators[device] = generator
        return generator

    def _request_generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        generator = self._request_generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(seq.sampling_params.seed)
            self._request_generators[seq.request_id] = generator
        return generator


def truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k -> top-p -> min-p with per-row parameters; dropped tokens get -inf."""
    vocab_size = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    uses_top_k = any(k < vocab_size for k in top_k)
    uses_top_p = any(p < 1.0 for p in top_p)
    if uses_top_k or uses_top_p:
        k = device_tensor(top_k, torch.long, logits.device) if uses_top_k else None
        p = _column(params, "top_p", logits) if uses_top_p else None
        logits = apply_top_k_top_p(logits, k, p)
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, _column(params, "min_p", logits))
    return logits


# Candidates a row's top-k/top-p cut is looked for among (CPU), fewest first: a full sort
# of a 49k vocabulary costs ~5 ms a row on a CPU core (75 ms for a batch of 32 on 2
# cores, more than the model's step); torch.topk of a few hundred is one pass over the
# row. Rows whose cut is not among the last tier's candidates take the full sort.
_CANDIDATES = (256, 4096)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top-k tokens (ties at the k-th kept, as HF), then its top-p nucleus.

    ``top_k`` holds values in [1, vocab] (vocab = off); ``top_p`` values in (0, 1] (1 = off).

    On the CPU a row is cut among its ``_CANDIDATES`` best tokens when the cut provably
    lies there (see _cut_among_candidates); the other rows (a nucleus wider than that, a
    tie at the edge of the candidates) take the full sort. Both keep the same tokens.
    """
    if logits.device.type != "cpu":
        return _top_k_top_p_sorted(logits, top_k, top_p)
    out = torch.empty_like(logits)
    rest = torch.arange(logits.shape[0])  # rows not cut yet
    for c in _CANDIDATES:
        if not rest.numel() or logits.shape[1] <= 2 * c:
            break
        cut, exact = _cut_among_candidates(
            logits[rest], _rows(top_k, rest), _rows(top_p, rest), c
        )  # fmt: skip
        out[rest[exact]] = cut[exact]
        rest = rest[~exact]
    if rest.numel():
        out[rest] = _top_k_top_p_sorted(logits[rest], _rows(top_k, rest), _rows(top_p, rest))
    return out


def _rows(column: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if column is None else column[rows]


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """apply_top_k_top_p by a full sort of every row."""
    # A stable sort makes the nucleus cut among tied logits independent of the batch.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        drop = _outside_nucleus(sorted_logits.softmax(dim=-1), top_p)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _outside_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of descending ``probs``, the tokens top-p drops: those whose mass before
    them reaches top_p, never the best one (even for a top_p that is 0.0)."""
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 are excluded outright: rounding can push the mass to 1.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    return drop


def _cut_among_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, c: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the truncated logits, per row whether they are exact) from each row's best ``c``
    tokens, put in the full sort's order (value descending, ties by id).

    A row is exact when its last kept token is strictly above the smallest candidate: then
    every token of the vocabulary at or above it is a candidate, in the same order as in
    the full sort, with the same probability mass before it (the probabilities are the
    softmax of the whole top-k-masked row), and every later token is dropped by both.
    """
    neg_inf = float("-inf")
    values, ids = _candidates(logits, c)
    masked = logits
    kept = torch.ones_like(values, dtype=torch.bool)
    if top_k is not None:
        # Ties at the k-th are kept; a k-th value equal to the smallest candidate may have
        # ties outside the candidates: such rows fail the exactness test below. A k past
        # the candidates (rows not exact either) masks nothing here.
        kth = values.gather(1, (top_k.clamp(max=c) - 1).unsqueeze(1))
        kth = torch.where((top_k > c).unsqueeze(1), neg_inf, kth)
        kept = values >= kth
        masked = logits.masked_fill(logits < kth, neg_inf)
    if top_p is not None:
        probs = masked.softmax(dim=-1).gather(1, ids).masked_fill(~kept, 0.0)
        kept &= ~_outside_nucleus(probs, top_p)
    last = kept.sum(dim=-1, keepdim=True) - 1  # kept is a prefix of the candidates
    exact = (values.gather(1, last) > values[:, -1:]).squeeze(1)
    if top_k is not None:  # a k beyond the candidates masks tokens outside them
        exact &= (top_k <= c) | (top_k >= logits.shape[1])
    out = torch.full_like(logits, neg_inf)
    out.scatter_(1, ids, values.masked_fill(~kept, neg_inf))
    # Rows that truncate nothing (both off, beside rows that truncate) stay as they are.
    off = _truncating_nothing(logits.shape[1], top_k, top_p, like=exact)
    if bool(off.any()):
        out[off] = logits[off]
        exact |= off
    return out, exact


def _candidates(logits: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best ``c`` (values, ids) in the full sort's order: value descending, ties
    by id (topk leaves tied values in no set order)."""
    values, ids = logits.topk(c, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


def _truncating_nothing(
    vocab: int, top_k: torch.Tensor | None, top_p: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor:
    off = torch.ones_like(like)
    if top_k is not None:
        off &= top_k >= vocab
    if top_p is not None:
        off &= top_p >= 1.0
    return off


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's best probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


class LogprobRows:
    """The logprobs of one step's sampled rows: tensors on the device until ``to_host``.

    ``values``/``ids`` [rows asking, 1 + N]: column 0 is the sampled token, then the top N.
    """

    def __init__(
        self,
        params: list[SamplingParams],
        rows: list[int] | None = None,
        values: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> None:
        self.params, self.rows = params, rows or []
        self.values, self.ids = values, ids

    def to_host(self, non_blocking: bool = False) -> LogprobRows:
        """Copies on the host (into pinned memory when ``non_blocking``: valid once the
        stream reaches them, see ModelRunner)."""
        if self.values is None or self.values.device.type == "cpu":
            return self
        values, ids = (_host_copy(t, non_blocking) for t in (self.values, self.ids))
        return LogprobRows(self.params, self.rows, values, ids)

    def records(self) -> list[TokenLogprob | None]:
        """One TokenLogprob per row that asked (None for the others); host tensors only."""
        result: list[TokenLogprob | None] = [None] * len(self.params)
        if self.values is None or self.ids is None:
            return result
        for row_values, row_ids, i in zip(
            self.values.tolist(), self.ids.tolist(), self.rows, strict=True
        ):
            n = self.params[i].top_logprobs
            top = tuple(zip(row_ids[1 : n + 1], row_values[1 : n + 1], strict=True))
            result[i] = TokenLogprob(token_id=row_ids[0], logprob=row_values[0], top=top)
        return result


def logprob_rows(
    raw_logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> LogprobRows:
    """Raw-logit logprobs of the sampled tokens (+ top-N), only for rows that ask."""
    rows = [i for i, p in enumerate(params) if p.wants_logprobs]
    if not rows:
        return LogprobRows(params)
    index = _index(rows, raw_logits.device)
    logprobs = torch.log_softmax(raw_logits.index_select(0, index), dim=-1)
    chosen_ids = tokens.index_select(0, index).unsqueeze(1)
    num_top = min(max(params[i].top_logprobs for i in rows), raw_logits.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # sorted, best first
    values = torch.cat((logprobs.gather(1, chosen_ids), top_values), dim=1)
    ids = torch.cat((chosen_ids, top_ids), dim=1)
    return LogprobRows(params, rows, values, ids)


def _host_copy(tensor: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    """``tensor`` on the host; with ``non_blocking``, an asynchronous copy into pinned
    memory that holds the values once the device's stream has done it."""
    if not non_blocking:
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return device_tensor(rows, torch.long, device)


def _column(params: list[SamplingParams], field: str, like: torch.Tensor) -> torch.Tensor:
    """One per-row parameter as a tensor of ``like``'s dtype and device."""
    return device_tensor([getattr(p, field) for p in params], like.dtype, like.device)
