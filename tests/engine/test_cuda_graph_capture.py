"""What a failed CUDA-graph capture does (compute/runner/cuda_graphs.py), checked on the CPU, where
every capture fails (torch has no CUDA here): it raises CaptureError, later captures in
the process are refused rather than attempted on whatever state the failure left, graphs
asked for explicitly (tests, benchmarks) fail with it, and by default the engine logs the
reason once, as an error, and runs eagerly. The capture itself is tested on a GPU
(tests/engine/test_engine_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

from compute.runner import cuda_graphs
from compute.runner.cuda_graphs import CaptureError, DecodeGraphs, capture_or_eager


@pytest.fixture(autouse=True)
def _no_failed_capture_yet(monkeypatch) -> None:
    monkeypatch.setattr(cuda_graphs, "_failed_capture", None)


def capture() -> DecodeGraphs:
    """A capture of a stand-in model (the capture fails before a forward on the CPU)."""
    model = SimpleNamespace(device=torch.device("cpu"))
    return DecodeGraphs(model, [], block_size=16, max_num_seqs=4, max_model_len=64)


def test_a_failed_capture_raises_and_refuses_the_next() -> None:
    with pytest.raises(CaptureError, match="cuda graph capture failed") as first:
        capture()
    assert first.value.__cause__ is not None  # the reason, with its traceback
    with pytest.raises(CaptureError, match="an earlier capture in this process failed"):
        capture()


def test_graphs_asked_for_fail_with_the_capture() -> None:
    with pytest.raises(CaptureError):
        capture_or_eager(capture, wanted=True)


def test_by_default_the_engine_runs_eagerly_and_says_why_once() -> None:
    with capture_logs() as logs:
        assert capture_or_eager(capture, wanted=None) is None
        assert capture_or_eager(capture, wanted=None) is None
    assert [entry["log_level"] for entry in logs] == ["error", "warning"]
    error, warning = (entry["reason"] for entry in logs)
    assert error.startswith("cuda graph capture failed: ") and logs[0]["exc_info"] is True
    why = error.removeprefix("cuda graph capture failed: ")
    assert warning == f"an earlier capture in this process failed: {why}"
