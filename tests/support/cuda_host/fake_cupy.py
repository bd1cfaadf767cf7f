"""A stand-in for CuPy that records compiles and launches, for CPU-only tests."""

from __future__ import annotations

import types


class FakeCupy:
    """Records compiles and launches; enough of the cupy API for kernels.cuda."""

    def __init__(self):
        self.compiles: list[tuple[str, tuple[str, ...], int]] = []
        self.calls: list[tuple] = []
        self.device = None
        self.streams: list[tuple[int, int]] = []
        fake = self

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                fake.device = self.index

            def __exit__(self, *exc):
                fake.device = None

        class ExternalStream:
            def __init__(self, ptr, device_id):
                fake.streams.append((ptr, device_id))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

        self.cuda = types.SimpleNamespace(Device=Device, ExternalStream=ExternalStream)

    def RawModule(self, code, options):  # noqa: N802 (cupy's name)
        self.compiles.append((code, options, self.device))
        return types.SimpleNamespace(get_function=self._function)

    def _function(self, name):
        return lambda grid, block, args: self.calls.append((name, grid, block, args, self.device))
