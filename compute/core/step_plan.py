"""The plan of one scheduler step, built up while ``Scheduler.schedule()`` runs.

It holds the token budget left, the sequences scheduled (and which are decodes),
the preempted request ids, the swap copy lists and the fork copies, and turns them into the
``SchedulerOutput`` handed to the runner. Pure Python, no torch.
"""

from __future__ import annotations

from compute.core.outputs import ScheduledSequence, SchedulerOutput
from compute.core.sequence import Sequence
from compute.core.step_cost import pairs_of


class StepPlan:
    """What the current schedule() call has decided so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.pairs = 0  # query-key pairs of the tokens scheduled (compute/core/step_cost.py)
        self.scheduled: dict[str, ScheduledSequence] = {}
        self.decodes: set[str] = set()
        self.preempted: list[str] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []  # forks' partial prompt blocks

    def add(
        self, seq: Sequence, num_new_tokens: int, is_decode: bool, draft: tuple[int, ...] = ()
    ) -> None:
        self.scheduled[seq.request_id] = ScheduledSequence.of(seq, num_new_tokens, draft)
        if is_decode:
            self.decodes.add(seq.request_id)
        self.budget -= num_new_tokens
        self.pairs += pairs_of(num_new_tokens, seq.num_computed_tokens)

    def drop(self, seq: Sequence) -> None:
        """Un-schedule a sequence preempted after it was scheduled: refund its tokens."""
        item = self.scheduled.pop(seq.request_id, None)
        if item is not None:
            self.decodes.discard(seq.request_id)
            self.budget += item.num_new_tokens
            self.pairs -= pairs_of(item.num_new_tokens, seq.num_computed_tokens)

    @property
    def mixes_prefill_and_decode(self) -> bool:
        return bool(self.decodes) and len(self.decodes) < len(self.scheduled)

    def output(self) -> SchedulerOutput:
        items = list(self.scheduled.values())
        decodes = [s for s in items if s.seq.request_id in self.decodes]
        prefills = [s for s in items if s.seq.request_id not in self.decodes]
        return SchedulerOutput(
            scheduled=decodes + prefills,
            num_batched_tokens=sum(s.num_new_tokens for s in items),
            num_pairs=self.pairs,
            preempted_request_ids=self.preempted,
            blocks_to_swap_out=self.swap_out,
            blocks_to_swap_in=self.swap_in,
            blocks_to_copy=self.copies,
        )
