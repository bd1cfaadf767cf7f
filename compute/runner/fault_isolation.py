"""Contain a failed step to the request(s) that caused it.

When the forward or the sampler raises, the step is run again in halves (bisection)
until each failing part is a single request: those requests are reported as faulty,
every other request gets the outputs it would have got in the full step. This is sound
because a step's work is per request apart from batching: re-running a subset rewrites
the same K/V values at the same positions (idempotent), schedule() is not called again
(its block allocations stand), and the sampler's generators are rewound to where they
were before the failed attempt, so seeded requests draw the same numbers. Unseeded rows
share one generator, so their draws after a fault may differ from an unfaulted run.

Cost: a fault caused by one request of n costs about 2*log2(n) extra partial steps; a
fault every request hits (out of memory, a broken device) fails them all, after 2n-1.
"""

from __future__ import annotations

from typing import Protocol

from compute.core.outputs import ScheduledSequence
from compute.runner.step_result import StepResult
from kernels.log import get_logger

log = get_logger(__name__)
# What a client sees when its request made the step fail; the traceback goes to the log.
FAULT_MESSAGE = "the engine failed while running this request"


class Launcher(Protocol):
    """What isolation needs of the model runner."""

    @property
    def vocab_size(self) -> int: ...

    def launch(self, scheduled: list[ScheduledSequence]) -> StepResult: ...

    def rewind(self) -> None: ...


def launch_isolating(runner: Launcher, scheduled: list[ScheduledSequence]) -> StepResult:
    """``runner.launch(scheduled)``; on an exception, the requests at fault go to the
    result's ``faulty`` (a launch that fails is retried in parts at once, synchronously)."""
    try:
        return runner.launch(scheduled)
    except Exception:
        runner.rewind()
        log.exception("engine step failed; isolating the request at fault", size=len(scheduled))
    return _bisect(runner, scheduled)


def _bisect(runner: Launcher, scheduled: list[ScheduledSequence]) -> StepResult:
    vocab_size = runner.vocab_size
    if len(scheduled) == 1:
        request_id = scheduled[0].seq.request_id
        log.warning("request failed the engine step on its own", request_id=request_id)
        return StepResult(vocab_size, faulty={request_id: FAULT_MESSAGE})
    middle = len(scheduled) // 2
    result = StepResult(vocab_size)
    for part in (scheduled[:middle], scheduled[middle:]):
        try:
            result.merge(runner.launch(part))
        except Exception:
            runner.rewind()
            result.merge(_bisect(runner, part))
    return result
