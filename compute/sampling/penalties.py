"""Repetition, presence and frequency penalties, applied to a batch of logits on the device.

The first stage of the sampler (``compute/sampling/sampler.py``): it runs before temperature
and truncation, on the rows whose requests ask for a penalty, and costs nothing when
no row does. Token histories become count tensors with one ``scatter_add`` over padded
id tensors, never a Python loop over the vocabulary.

- repetition_penalty: HF ``RepetitionPenaltyLogitsProcessor`` semantics over prompt +
  output tokens: a seen token's logit is divided by the penalty when positive and
  multiplied by it otherwise.
- presence/frequency penalties: OpenAI semantics over output tokens only:
  ``logit -= presence * (count > 0) + frequency * count``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from compute.core.sequence import Sequence
from kernels.transfer import device_tensor


class Penalties:
    """Applies the penalties of a batch; caches each request's prompt ids on the device."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # The prompt never changes while a request lives, and re-uploading thousands of
        # prompt ids every step would dominate the step on long prompts.
        self._prompt_ids: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        self._prompt_ids.pop(request_id, None)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Penalized logits (a new tensor), or ``logits`` itself when no row is penalized."""
        rep_rows = [i for i, s in enumerate(seqs) if s.sampling_params.repetition_penalty != 1.0]
        freq_rows = [
            i
            for i, s in enumerate(seqs)
            if s.sampling_params.presence_penalty != 0.0
            or s.sampling_params.frequency_penalty != 0.0
        ]
        if rep_rows:
            logits = _on_rows(logits, rep_rows, lambda x: self._repetition(x, seqs, rep_rows))
        if freq_rows:
            logits = _on_rows(logits, freq_rows, lambda x: self._frequency(x, seqs, freq_rows))
        return logits

    def _repetition(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> torch.Tensor:
        device = logits.device
        outputs = _output_id_tensors([seqs[i] for i in rows], device)
        histories = [
            torch.cat((self._prompt_tensor(seqs[i], device), out))
            for i, out in zip(rows, outputs, strict=True)
        ]
        seen = token_counts(histories, self.vocab_size) > 0
        penalty = _row_values(rows, seqs, "repetition_penalty", logits)
        return apply_repetition_penalty(logits, seen, penalty)

    def _frequency(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> torch.Tensor:
        outputs = _output_id_tensors([seqs[i] for i in rows], logits.device)
        counts = token_counts(outputs, self.vocab_size).to(logits.dtype)
        presence = _row_values(rows, seqs, "presence_penalty", logits)
        frequency = _row_values(rows, seqs, "frequency_penalty", logits)
        return apply_presence_frequency(logits, counts, presence, frequency)

    def _prompt_tensor(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        cached = self._prompt_ids.get(seq.request_id)
        # The length/device check guards against a request id reused for a new prompt.
        if cached is None or cached.numel() != seq.num_prompt_tokens or cached.device != device:
            cached = device_tensor(seq.prompt_token_ids, torch.long, device)
            self._prompt_ids[seq.request_id] = cached
        return cached


def token_counts(id_tensors: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """``[len(id_tensors), vocab_size]`` int32 counts of each token id in each row."""
    # Padding with vocab_size lands in a spare column that is dropped afterwards.
    padded = pad_sequence(id_tensors, batch_first=True, padding_value=vocab_size)
    counts = torch.zeros((len(id_tensors), vocab_size + 1), dtype=torch.int32, device=padded.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF semantics: seen tokens' logits divided by ``penalty`` if > 0, else multiplied."""
    penalty = penalty.unsqueeze(1)
    # Same expression as HF so the result is bit-identical, including logit == 0.
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI semantics: ``logit -= presence * (count > 0) + frequency * count``."""
    present = (counts > 0).to(logits.dtype)
    return logits - (presence.unsqueeze(1) * present + frequency.unsqueeze(1) * counts)


def _on_rows(
    logits: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``fn`` applied to the given rows only; the other rows are copied unchanged."""
    if len(rows) == logits.shape[0]:
        return fn(logits)
    index = device_tensor(rows, torch.long, logits.device)
    return logits.index_copy(0, index, fn(logits.index_select(0, index)))


def _output_id_tensors(seqs: list[Sequence], device: torch.device) -> list[torch.Tensor]:
    """Each sequence's output ids as a device tensor, uploaded in one copy."""
    lengths = [s.num_output_tokens for s in seqs]
    flat = [t for s in seqs for t in s.output_token_ids]
    return list(device_tensor(flat, torch.long, device).split(lengths))


def _row_values(
    rows: list[int], seqs: list[Sequence], field: str, like: torch.Tensor
) -> torch.Tensor:
    values = [getattr(seqs[i].sampling_params, field) for i in rows]
    return device_tensor(values, like.dtype, like.device)
