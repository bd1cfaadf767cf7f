"""``python -m bench.constrained`` and ``python -m bench.grammar_libs`` end to end on tiny
settings: every section is measured and the JSON written. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from bench import common, constrained, grammar_libs

pytestmark = pytest.mark.slow


def test_constrained_dry_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    constrained.main(
        ["--streams", "2", "--max-tokens", "6", "--reps", "1", "--ttft-reps", "1",
         "--threads", "1", "--name", "t"]
    )  # fmt: skip
    (path,) = tmp_path.glob("t-*.json")
    result = json.loads(path.read_text())
    assert {"machine", "commit", "compile", "decode", "first_token"} <= set(result)
    assert set(result["decode"]) == {"streams_1", "streams_2"}
    for row in result["decode"].values():  # the same tokens were generated in both modes
        runs = row["runs"]
        assert [r["tokens"] for r in runs["constrained"]] == [
            r["tokens"] for r in runs["unconstrained"]
        ]
    assert set(result["compile"]) == {"person", "order", "weather_tool", "wide40"}
    assert set(result["first_token"]["median_ttft_s"]) == {"unconstrained", "cached_schema"}


def test_grammar_libs_dry_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    grammar_libs.main(["--reps", "1", "--threads", "1"])
    (path,) = tmp_path.glob("grammar-libs-*.json")
    result = json.loads(path.read_text())
    assert set(result["libraries"]) == {"xgrammar", "llguidance"}
    for lib in result["libraries"].values():
        assert set(lib["schemas"]) == {"person", "order", "weather_tool", "wide40"}
