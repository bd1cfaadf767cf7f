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

Per step and constrained row the cost is one matcher call to consume the new token and
one to write the row's next-token bitmask (llguidance, one bit per token) into a
preallocated int32 array whose row is the logits row. On the CPU the mask is then applied
in place with NumPy (one bit unpack and one masked write per run of adjacent constrained
rows: single-threaded, so no OpenMP fork-join per step, which on a busy machine cost far
more than the work), and the masks are filled on the calling thread: llguidance's
parallel executor adds a thread pool that competes with the model's own threads for the
same cores. On a GPU the executor fills the rows in parallel (the CPU is otherwise idle)
and the mask is unpacked and applied on the device, out of place. Measured in
docs/performance.md (the constrained section).

EOS: the model's EOS ids are llguidance's, so the grammar allows them exactly where it may
end (and only them once it must). A matcher that fails (a token the grammar rejects, a
resource limit, a mask with no token allowed, a matcher that cannot be made) fails its own
row only: the row is left unmasked, ``faulty`` names the request and why, and the runner
fails that request alone (compute/runner/model_runner.py). The step, its forward and its
other rows go on as if it were not there; nothing is run again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
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
        # Host bitmask, row i for logits row i (rows of unconstrained sequences unused);
        # grown to the largest batch seen, never shrunk.
        self._bitmask = np.zeros((0, self._words), dtype=np.int32)
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._executor: Any = None
        self.mask_seconds = 0.0  # cumulative host time filling masks (metrics)
        self.masked_rows = 0  # cumulative rows masked
        self.faulty: dict[str, str] = {}  # of the latest apply: request id -> why its row failed

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logits`` with the constrained rows masked (the others as they were). On the
        CPU the rows are masked in place and ``logits`` itself is returned."""
        self.faulty = {}
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.grammar is not None]
        if not rows:
            return logits
        start = time.perf_counter()
        on_host = logits.device.type == "cpu"
        bitmask, faults = self._fill(seqs, rows, parallel=not on_host)
        self.mask_seconds += time.perf_counter() - start
        for row, reason in faults.items():
            self.faulty[seqs[row].request_id] = reason
            self._tracked.pop(seqs[row].request_id, None)
        rows = [row for row in rows if row not in faults]
        self.masked_rows += len(rows)
        if not rows:
            return logits
        if on_host:
            return mask_in_place(logits, bitmask, rows)
        return self._mask_on_device(logits, bitmask, rows)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: its matcher goes."""
        self._tracked.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._tracked)

    def _synced(self, seq: Sequence) -> Any:
        """The request's matcher, having consumed exactly its output tokens (one call)."""
        tracked = self._tracked.get(seq.request_id)
        output = seq.output_token_ids
        if tracked is None or tracked.consumed > len(output):
            tracked = _Tracked(seq.sampling_params.grammar.new_matcher(), 0)
            self._tracked[seq.request_id] = tracked
        if tracked.consumed == len(output):
            return tracked.matcher
        new = output[tracked.consumed :]
        if PLACEHOLDER in new:
            raise GrammarFault(f"{seq.request_id}: a grammar mask before its last token is known")
        if not tracked.matcher.consume_tokens(new):
            self._tracked.pop(seq.request_id, None)
            raise GrammarFault(f"{seq.request_id}: {tracked.matcher.get_error()[:240]}")
        tracked.consumed = len(output)
        return tracked.matcher

    def _fill(
        self, seqs: list[Sequence], rows: list[int], parallel: bool
    ) -> tuple[np.ndarray, dict[int, str]]:
        """Row ``i`` of the bitmask is the next-token bitmask of ``seqs[i]`` for each ``i``
        in ``rows`` (int32 words, on the host; the other rows hold anything), and the rows
        whose matcher failed, with why."""
        if self._bitmask.shape[0] < len(seqs):
            self._bitmask = np.zeros((len(seqs), self._words), dtype=np.int32)
        bitmask = self._bitmask
        faults: dict[int, str] = {}
        matchers = []
        for row in rows:
            try:
                matchers.append(self._synced(seqs[row]))
            except Exception as exc:  # GrammarFault, or a matcher that could not be made
                why = str(exc) if isinstance(exc, GrammarFault) else repr(exc)[:240]
                faults[row] = (
                    why if isinstance(exc, GrammarFault) else f"{seqs[row].request_id}: {why}"
                )
        rows = [row for row in rows if row not in faults]
        self._compute(matchers, rows, bitmask, parallel)
        for matcher, row in zip(matchers, rows, strict=True):
            if matcher.is_error():
                faults[row] = f"{seqs[row].request_id}: {matcher.get_error()[:240]}"
            elif not bitmask[row].any():
                faults[row] = f"{seqs[row].request_id}: its grammar allows no token"
        return bitmask, faults

    def _compute(
        self, matchers: list[Any], rows: list[int], bitmask: np.ndarray, parallel: bool
    ) -> None:
        base, row_bytes = bitmask.ctypes.data, bitmask.strides[0]
        if parallel and len(rows) > 1:
            if self._executor is None:
                import llguidance  # not llguidance.torch: it imports torch.compile's machinery

                self._executor = llguidance.LLExecutor()
            pairs = list(zip(matchers, rows, strict=True))
            self._executor.unsafe_compute_mask_ptr(pairs, base, row_bytes, bitmask.shape[0])
        else:
            for matcher, row in zip(matchers, rows, strict=True):
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)

    def _mask_on_device(
        self, logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]
    ) -> torch.Tensor:
        """Out of place on ``logits``' device: the model's logits may be an
        inference-mode tensor, which only NumPy may write outside inference mode."""
        every_row = len(rows) == logits.shape[0]
        words = bitmask[: len(rows)] if every_row else bitmask[rows]
        allowed = self._unpack(torch.from_numpy(words).to(logits.device))
        if every_row:
            return logits.masked_fill(~allowed, float("-inf"))
        index = device_tensor(rows, torch.long, logits.device)
        masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        return logits.index_copy(0, index, masked)

    def _unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """int32 words [rows, words] -> bool [rows, vocab] (bit j of word w: token 32w + j)."""
        shifts = self._shifts.get(bitmask.device)
        if shifts is None:
            shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
            self._shifts[bitmask.device] = shifts
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1
        return bits.view(bitmask.shape[0], -1)[:, : self.vocab_size].bool()


def mask_in_place(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """-inf in the host tensor ``logits`` at every token whose bit is 0 in ``bitmask``'s
    row of the same index, for the rows in ``rows`` (sorted); other rows are not touched.
    Returns ``logits`` (a contiguous copy first if it was not contiguous)."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    values = logits.numpy()  # shares memory; also writes an inference-mode tensor
    vocab_size = values.shape[1]
    little = bitmask.astype("<i4", copy=False)  # bit j of word w is token 32w + j
    for lo, hi in _runs(rows):
        banned = np.unpackbits(
            np.invert(little[lo:hi]).view(np.uint8), axis=1, count=vocab_size, bitorder="little"
        ).view(np.bool_)
        np.copyto(values[lo:hi], -np.inf, where=banned)
    return logits


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices as [lo, hi) runs of adjacent rows: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
