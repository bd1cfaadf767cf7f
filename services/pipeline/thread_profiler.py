"""On-demand profiles of the serving threads (the worker protocol's StartProfile/StopProfile).

A sampler thread reads every thread's Python stack (``sys._current_frames``) at a fixed
rate while a profile runs, and on stop writes into the ``--profile-dir``:

- ``<name>.folded``: one line per distinct stack, ``thread;outer;...;inner count`` (Brendan
  Gregg's collapsed format: ``flamegraph.pl``, speedscope and inferno read it), with the
  thread names the pipeline gives its stages (``headrace-step-loop``,
  ``headrace-output-N``, ``headrace-tokenize_N``, the server's event loop);
- ``<name>.txt``: per thread, how many samples it was seen in and the functions it spent
  them in (self and total), the top ones first.

Sampling wall-clock stacks rather than tracing calls keeps the cost off the step loop (a
few microseconds per sample on the sampler's own thread, nothing per call) and shows
where the step loop waits as well as where it computes; time inside a C extension
(a torch kernel, the CPU kernels) is charged to the Python line that called it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from kernels.log import get_logger

INTERVAL_S = 0.005  # 200 samples per second
MAX_SECONDS = 600.0  # a profile nobody stops ends by itself
TOP = 25  # functions listed per thread in the summary

log = get_logger(__name__)


@dataclass(frozen=True)
class ProfileFiles:
    folded: Path
    summary: Path
    samples: int  # sampler ticks taken
    seconds: float


class ThreadProfiler:
    """At most one profile at a time, written under ``directory``."""

    def __init__(self, directory: str | Path, interval: float = INTERVAL_S) -> None:
        self.directory = Path(directory)
        self._interval = interval
        self._lock = threading.Lock()
        self._run: _Run | None = None

    @property
    def running(self) -> bool:
        return self._run is not None

    def start(self, subdirectory: str = "") -> Path:
        """Start sampling; the profile will land in ``directory/subdirectory``. ValueError
        when one is running already."""
        out = self.directory / subdirectory
        with self._lock:
            if self._run is not None:
                raise ValueError("a profile is running already; stop it first")
            out.mkdir(parents=True, exist_ok=True)
            self._run = _Run(out, self._interval)
        return out

    def stop(self) -> ProfileFiles:
        """Stop and write the profile; ValueError when none is running."""
        with self._lock:
            run, self._run = self._run, None
        if run is None:
            raise ValueError("no profile is running; start one first")
        return run.finish()


class _Run:
    """One profile: its sampler thread and what it counted."""

    def __init__(self, out: Path, interval: float) -> None:
        self.out = out
        self.interval = interval
        self.stacks: Counter[tuple[str, ...]] = Counter()
        self.ticks = 0
        self.started = time.monotonic()
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="headrace-profiler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            if time.monotonic() - self.started > MAX_SECONDS:
                return
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.stacks[(names.get(ident, f"thread-{ident}"), *_stack(frame))] += 1
            self.ticks += 1

    def finish(self) -> ProfileFiles:
        self._stop.set()
        self._thread.join()
        seconds = time.monotonic() - self.started
        name = f"headrace-profile-{self.stamp}"
        folded, summary = self.out / f"{name}.folded", self.out / f"{name}.txt"
        folded.write_text(
            "".join(f"{';'.join(stack)} {n}\n" for stack, n in sorted(self.stacks.items()))
        )
        summary.write_text(_summary(self.stacks, self.ticks, seconds, self.interval))
        log.info("profile written", folded=str(folded), samples=self.ticks, seconds=seconds)
        return ProfileFiles(folded, summary, self.ticks, seconds)


def _stack(frame: FrameType | None) -> list[str]:
    """Outermost first, each ``function (file:line)``."""
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append(f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})")
        frame = frame.f_back
    return frames[::-1]


def _summary(stacks: Counter, ticks: int, seconds: float, interval: float) -> str:
    lines = [
        f"headrace thread profile: {ticks} samples over {seconds:.1f} s "
        f"(every {interval * 1000:g} ms); per thread, the share of samples whose innermost "
        "frame was each function (self) and that had it anywhere on the stack (total)",
    ]
    by_thread: dict[str, Counter] = {}
    for (thread, *frames), n in stacks.items():
        by_thread.setdefault(thread, Counter())[("", "")] += n
        counts = by_thread[thread]
        if frames:
            counts[("self", _function(frames[-1]))] += n
        for function in {_function(f) for f in frames}:
            counts[("total", function)] += n
    for thread in sorted(by_thread):
        counts = by_thread[thread]
        seen = counts.pop(("", ""))
        lines += ["", f"== {thread}: {seen} samples"]
        for kind in ("self", "total"):
            top = sorted(((n, f) for (k, f), n in counts.items() if k == kind), reverse=True)
            for n, function in top[:TOP]:
                lines.append(f"  {kind:5} {100 * n / seen:5.1f}%  {function}")
    return "\n".join(lines) + "\n"


def _function(frame: str) -> str:
    """``name (file:line)`` -> ``name (file)``: a function, whatever line it was on."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rpartition(':')[0]})"
