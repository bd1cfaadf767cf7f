"""``python -m bench.offline`` (``make bench``) end to end on tiny settings: every system
runs, and the JSON and PNG are written with the fields the README documents. No timing is
asserted."""

from __future__ import annotations

import json

from bench import common
from bench.offline import __main__ as offline


def test_offline_dry_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    offline.main(["--num-requests", "4", "--prompt-min", "4", "--prompt-max", "8",
                  "--output-mean", "3", "--output-cap", "4", "--static-batch-size", "2",
                  "--single-requests", "2", "--max-num-seqs", "4", "--name", "t"])  # fmt: skip
    (path,) = tmp_path.glob("t-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    assert {"machine", "commit", "settings", "workload", "systems", "ratios"} <= set(result)
    assert set(result["systems"]) == {"headrace", "hf-static", "hf-single"}
    assert result["settings"]["num_requests"] == 4
