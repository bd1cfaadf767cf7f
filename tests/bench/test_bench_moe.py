"""``python -m bench.moe`` end to end on one layer: the MoE and dense models decode, the
bytes a step reads are counted, and the JSON and PNG are written. No timing is asserted."""

from __future__ import annotations

import json

from bench import common, moe


def test_moe_bench_dry_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    moe.main(["--layers", "1", "--steps", "2", "--rounds", "1", "--threads", "1"])
    (path,) = tmp_path.glob("moe-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    assert {"machine", "commit", "settings", "tok_s"} <= set(result)
    b = result["bytes_per_decode_step"]
    # One stream reads exactly its top-8 experts per layer; 8 streams read each chosen
    # expert once, so no more than all of them and no more than 8 x top-8 reads would.
    assert b["moe_single_stream_read"] == b["moe_active_weights"] < b["moe_all_weights"]
    assert b["moe_active_weights"] < b["moe_8_streams_read"] <= b["moe_all_weights"]
    assert result["experts_run_per_step"]["single_stream"] == 8
