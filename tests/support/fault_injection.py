"""Fault injection into one request's forward pass or sampling: a FaultHook for tests.

Off by default: the model runner and the sampler hold ``faults = None`` and check it
with one ``is None`` test per step. Tests set ``engine.runner.faults`` (which the
runner hands to its sampler) to a ``FaultInjector`` naming the requests to hurt, so the
engine's fault isolation can be checked on a real model with a real mixed batch. It
satisfies ``compute.sampling.fault_hook.FaultHook``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault; the engine must contain it."""


@dataclass
class FaultInjector:
    """Which requests fail, and how. Request ids, not rows: rows move between steps."""

    raise_in_forward: set[str] = field(default_factory=set)  # the forward raises
    raise_in_sampling: set[str] = field(default_factory=set)  # the sampler raises
    bad_token_id: set[str] = field(default_factory=set)  # the sampler returns id == vocab
    after_tokens: int = 0  # only once the request has this many output tokens

    def check_forward(self, seqs: list) -> None:
        """Raise when a targeted request is in the forward batch."""
        hit = [s.request_id for s in seqs if self._armed(s, self.raise_in_forward)]
        if hit:
            raise InjectedFault(f"injected forward fault for {hit}")

    def check_sampling(self, seqs: list) -> None:
        hit = [s.request_id for s in seqs if self._armed(s, self.raise_in_sampling)]
        if hit:
            raise InjectedFault(f"injected sampling fault for {hit}")

    def corrupt(self, tokens: torch.Tensor, seqs: list, vocab_size: int) -> torch.Tensor:
        """``tokens`` with an out-of-range id in each targeted row."""
        rows = [i for i, s in enumerate(seqs) if self._armed(s, self.bad_token_id)]
        if not rows:
            return tokens
        tokens = tokens.clone()
        tokens[rows] = vocab_size
        return tokens

    def _armed(self, seq, targets: set[str]) -> bool:
        # The pipeline makes engine ids "<client request id>#<n>"; either form matches.
        client_id = seq.request_id.rpartition("#")[0] or seq.request_id
        hit = seq.request_id in targets or client_id in targets
        return hit and seq.num_output_tokens >= self.after_tokens
