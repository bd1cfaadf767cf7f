"""What a test may hook into a step to make one request's forward or sampling fail.

Production passes no hook (``None``, one ``is None`` test per step); the tests pass
``tests/support/fault_injection.FaultInjector``, so the engine's fault isolation
(compute/runner/fault_isolation.py) is checked on a real model with a real mixed batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from compute.core.sequence import Sequence


class FaultHook(Protocol):
    def check_forward(self, seqs: Seq[Sequence]) -> None:
        """Raise when the forward of ``seqs`` must fail."""

    def check_sampling(self, seqs: Seq[Sequence]) -> None:
        """Raise when sampling for ``seqs`` must fail."""

    def corrupt(self, tokens: torch.Tensor, seqs: Seq[Sequence], vocab_size: int) -> torch.Tensor:
        """``tokens``, or a copy with out-of-range ids in the rows that must get one."""
