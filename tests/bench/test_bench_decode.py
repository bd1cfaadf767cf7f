"""``python -m bench.decode`` (``make bench-decode``) end to end on tiny settings: both
systems decode the same prompt and the JSON and PNG are written. No timing is asserted."""

from __future__ import annotations

import json

from bench import common, decode


def test_decode_dry_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    decode.main(["--new-tokens", "4", "--reps", "1", "--warmup", "0", "--name", "t"])
    (path,) = tmp_path.glob("t-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    assert set(result["systems"]) == {"headrace", "hf"}
    assert {"headrace_over_hf", "greedy_agreement_tokens", "machine", "commit"} <= set(result)
    assert all(len(s["runs"]) == 1 for s in result["systems"].values())
