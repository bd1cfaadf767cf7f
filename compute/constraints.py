"""Grammar masks in stage 2: each constrained request's matcher, and its logits row masked.

The sampler calls ``GrammarMasks.apply`` first thing in a step, before penalties,
temperature and truncation: the rows of requests with a grammar (``SamplingParams.grammar``)
get -inf at every token the grammar does not allow next; every other row is left as it
was, untouched and unread, so an unconstrained request samples exactly what it would
without a constrained neighbour, and a step with no constrained row costs one scan of
its parameters.

Each request's matcher (a copy of its compiled template) is brought up to date lazily, at
the next mask: it consumes the output tokens it has not seen, so it is "advanced with
every accepted token" wherever the tokens were accepted (the scheduler's resolve, an
accepted draft). The same rule makes it survive preemption (recompute keeps the output
tokens, swap keeps everything) and a step retried by fault isolation (a retry consumes
nothing twice); a sequence whose output got shorter than what its matcher consumed gets a
new matcher replayed from its output. The engine resolves a constrained request's step
before it schedules the next (compute/engine.py), so its output holds no placeholder here.

EOS: the model's EOS ids are llguidance's, so the grammar allows them exactly where it may
end (and only them once it must). A matcher that fails (a token the grammar rejects, a
resource limit, a mask with no token allowed) raises ``GrammarFault``: the step fails,
and fault isolation (compute/fault_isolation.py) fails that request alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from compute.core.sequence import PLACEHOLDER, Sequence
from kernels.transfer import device_tensor


class GrammarFault(RuntimeError):
    """A request's matcher cannot go on (the message names the request)."""


@dataclass
class _Tracked:
    matcher: Any  # llguidance.LLMatcher
    consumed: int  # output tokens it has consumed


class GrammarMasks:
    """Per-request matchers and the bitmask that masks their logits rows."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._tracked: dict[str, _Tracked] = {}
        self._bitmask = torch.empty(0, self._words, dtype=torch.int32)
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._executor: Any = None
        self.mask_seconds = 0.0  # cumulative host time filling masks (metrics)
        self.masked_rows = 0  # cumulative rows masked

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logits`` with the constrained rows masked (the others as they were)."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.grammar is not None]
        if not rows:
            return logits
        start = time.perf_counter()
        matchers = [self._synced(seqs[i]) for i in rows]
        bitmask = self._fill(matchers, seqs, rows)
        self.mask_seconds += time.perf_counter() - start
        self.masked_rows += len(rows)
        index = device_tensor(rows, torch.long, logits.device)
        allowed = self._unpack(bitmask.to(logits.device))
        masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        # Out of place: the model's logits may be an inference-mode tensor.
        return logits.index_copy(0, index, masked)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: its matcher goes."""
        self._tracked.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._tracked)

    def _synced(self, seq: Sequence) -> Any:
        """The request's matcher, having consumed exactly its output tokens."""
        tracked = self._tracked.get(seq.request_id)
        output = seq.output_token_ids
        if tracked is None or tracked.consumed > len(output):
            tracked = _Tracked(seq.sampling_params.grammar.new_matcher(), 0)
            self._tracked[seq.request_id] = tracked
        new = output[tracked.consumed :]
        if PLACEHOLDER in new:
            raise GrammarFault(f"{seq.request_id}: a grammar mask before its last token is known")
        if new:
            if not tracked.matcher.consume_tokens(new):
                self._tracked.pop(seq.request_id, None)
                raise GrammarFault(f"{seq.request_id}: {tracked.matcher.get_error()[:240]}")
            tracked.consumed = len(output)
        return tracked.matcher

    def _fill(self, matchers: list[Any], seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """The next-token bitmask of each matcher, one int32 row per matcher, on the host."""
        import llguidance  # not llguidance.torch: it imports torch.compile's machinery

        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = torch.empty(len(matchers), self._words, dtype=torch.int32)
        bitmask = self._bitmask[: len(matchers)]
        row_bytes = self._words * 4
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), row_bytes, len(matchers)
            )
        for matcher, row in zip(matchers, rows, strict=True):
            if matcher.is_error():
                request_id = seqs[row].request_id
                self._tracked.pop(request_id, None)
                raise GrammarFault(f"{request_id}: {matcher.get_error()[:240]}")
        empty = (~bitmask.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise GrammarFault(f"{seqs[rows[empty[0]]].request_id}: its grammar allows no token")
        return bitmask

    def _unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """int32 words [rows, words] -> bool [rows, vocab] (bit j of word w: token 32w + j)."""
        shifts = self._shifts.get(bitmask.device)
        if shifts is None:
            shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
            self._shifts[bitmask.device] = shifts
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1
        return bits.view(bitmask.shape[0], -1)[:, : self.vocab_size].bool()
