"""bench/cpu_kernels.py runs end to end with small numbers: every part it was asked for,
and the weight pass reads every projection of the embedded model once per mode."""

from __future__ import annotations

import json

import pytest

from bench import common, cpu_kernels
from kernels.cpu.library import available


def test_cpu_kernels_dry_run(tmp_path, monkeypatch) -> None:
    if not available():
        pytest.skip("the CPU kernels cannot be built here")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    cpu_kernels.main(["--reps", "1", "--min-ms", "1", "--rows", "1,16", "--skip", "steps"])
    (path,) = tmp_path.glob("cpu-kernels-*.json")
    result = json.loads(path.read_text())
    assert result["steps"] == []
    assert {(r["matrix"], r["rows"]) for r in result["linear"]} == {
        (m, n) for m in ("qkv", "o", "gate_up", "down", "lm_head") for n in (1, 16)
    }
    passes = {r["weights"]: r for r in result["pass"]}
    assert set(passes) == {"quantized", "quantized-int8"}
    # 30 layers x 4 fused projections + the lm_head, the file's blocks (~97 MB) either way
    # (the int8 layout pads rows to tiles of 16: the default model's rows are multiples).
    for row in passes.values():
        assert row["matrices"] == 121 and 90e6 < row["bytes"] < 100e6 and row["ms"] > 0
    assert passes["quantized"]["bytes"] == passes["quantized-int8"]["bytes"]
    assert len(result["attention"]) == 10 and all(r["kernel_us"] > 0 for r in result["attention"])
