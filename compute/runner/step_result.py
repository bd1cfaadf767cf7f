"""A launched step's sampled ids and logprobs on their way to the host, with its timing.

The runner returns one per launch (compute/runner/model_runner.py); fault isolation merges
the results of a step run in parts (compute/runner/fault_isolation.py); the engine resolves
it when it needs the ids (at once, or one step later with asynchronous output).
"""

from __future__ import annotations

import time

import torch

from compute.core.outputs import ModelRunnerOutput
from compute.core.sequence import Sequence
from compute.sampling.sampler import LogprobRows

# What a client sees when its sampled id was out of range (the details go to the log).
BAD_TOKEN_MESSAGE = "the sampler produced an invalid token id for this request"


class StepResult:
    """A launched step's sampled ids and logprobs, on their way to the host.

    ``faulty``: requests the launch itself failed on (fault isolation); ``resolve`` adds
    those whose sampled id was out of range. Runs of parts of one step merge into one.
    ``forward_end``: ``perf_counter()`` when the (last) forward ended, for ``StepTiming``;
    ``mask_seconds``: host time spent filling grammar masks while sampling.
    """

    def __init__(self, vocab_size: int, faulty: dict[str, str] | None = None) -> None:
        self.vocab_size = vocab_size
        self.faulty: dict[str, str] = faulty or {}
        self.forward_end = time.perf_counter()
        self.mask_seconds = 0.0
        self._parts: list[tuple[list[Sequence], torch.Tensor, LogprobRows, object]] = []
        # Verified drafts (speculative decoding), already on the host: per sequence, the
        # ids it emits and their logprobs.
        self._host_parts: list[tuple[list[Sequence], list[list[int]], list[list]]] = []

    def add(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: LogprobRows) -> None:
        """One run's rows; device tensors are copied behind the work that makes them."""
        event = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            tokens = host.copy_(tokens, non_blocking=True)
            logprobs = logprobs.to_host(non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._parts.append((seqs, tokens, logprobs, event))

    def add_emitted(
        self, seqs: list[Sequence], token_ids: list[list[int]], logprobs: list[list]
    ) -> None:
        """One run's verified drafts: one or more emitted ids per sequence, on the host."""
        self._host_parts.append((seqs, token_ids, logprobs))

    def merge(self, other: StepResult) -> None:
        self._parts.extend(other._parts)
        self._host_parts.extend(other._host_parts)
        self.faulty.update(other.faulty)
        self.forward_end = max(self.forward_end, other.forward_end)
        self.mask_seconds += other.mask_seconds

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the ids (this step's copies only, not later steps) and check them."""
        out = ModelRunnerOutput([], [], [])
        for seqs, tokens, logprobs, event in self._parts:
            if event is not None:
                event.synchronize()
            ids, records = tokens.tolist(), logprobs.records()
            out.merge(_checked(seqs, ids, records, self.vocab_size))
        for seqs, emitted, emitted_logprobs in self._host_parts:
            for seq, ids, records in zip(seqs, emitted, emitted_logprobs, strict=True):
                part = _checked([seq] * len(ids), ids, records, self.vocab_size)
                if part.faulty:
                    out.faulty.update(part.faulty)
                    continue
                out.request_ids.append(seq.request_id)
                out.sampled_token_ids.append(ids[0])
                out.logprobs.append(records[0])
                out.more_tokens[seq.request_id] = list(zip(ids[1:], records[1:], strict=True))
        return out


def _checked(
    seqs: list[Sequence], token_ids: list[int], logprobs, vocab_size: int
) -> ModelRunnerOutput:
    """The output, with rows whose id is outside [0, vocab) moved to ``faulty``: such an
    id must never reach the embedding lookup (it would fail the whole next step)."""
    out = ModelRunnerOutput([], [], [])
    for seq, token, logprob in zip(seqs, token_ids, logprobs, strict=True):
        if 0 <= token < vocab_size:
            out.request_ids.append(seq.request_id)
            out.sampled_token_ids.append(token)
            out.logprobs.append(logprob)
        else:
            out.faulty[seq.request_id] = BAD_TOKEN_MESSAGE
    return out
