"""``python -m bench.speculative`` (``make bench-speculative``) end to end on tiny settings:
every configuration runs every workload on the embedded model, greedy tokens agree with
``none``, and the JSON and PNG are written. No timing is asserted."""

from __future__ import annotations

import json

from bench import common, speculative


def test_speculative_dry_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    speculative.main(
        ["--ks", "2", "--new-tokens", "6", "--concurrent", "2", "--reps", "1", "--threads", "1",
         "--workloads", "copy,mixed48", "--name", "t"]
    )  # fmt: skip
    (path,) = tmp_path.glob("t-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    assert {"machine", "commit", "summary"} <= set(result)
    summary = result["summary"]
    assert {name: set(rows) for name, rows in summary.items()} == {
        "none": {"copy", "mixed48"},
        "ngram-k2": {"copy", "mixed48"},
    }
    assert all(row["identical_greedy_tokens"] for rows in summary.values() for row in rows.values())
    assert summary["ngram-k2"]["copy"]["drafted"] > 0  # the copy prompts do draft
    assert summary["none"]["copy"]["drafted"] == 0
