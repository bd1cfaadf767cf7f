"""``headrace`` with a fault-injection hook that stops the step loop: for gateway tests.

    python -m tests.support.stall_hook serve ARGS...

runs ``headrace serve ARGS`` unchanged, except that SIGUSR1 makes the next
``Engine.step`` block (the step loop stops between two steps, as a wedged engine would)
and SIGUSR2 lets it go on. gRPC, health checks and the KV-event stream keep answering
meanwhile: only the engine is silent, which is what ``engine_silence_ms`` tells a gateway.
The hook lives here, not in the server: production code has no way to stop its engine.
"""

from __future__ import annotations

import signal
import sys
import threading

from compute.engine import Engine

_running = threading.Event()
_running.set()
_step = Engine.step


def _gated_step(self: Engine):
    _running.wait()
    return _step(self)


def main() -> int:
    from services.cli.cli import main as headrace

    Engine.step = _gated_step
    signal.signal(signal.SIGUSR1, lambda *_: _running.clear())
    signal.signal(signal.SIGUSR2, lambda *_: _running.set())
    return headrace(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
