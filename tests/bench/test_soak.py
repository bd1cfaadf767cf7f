"""python -m bench.soak for a few seconds against an in-process server over the real engine
(``dummy:tiny``): every request kind ends as it must, and the JSON's summary (expected vs
unexpected counts, latency windows, RSS figures, leaked blocks, goals) is recomputed here
from the records and samples the JSON itself holds. No timing is asserted."""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import structlog

from bench.soak import __main__ as soak
from bench.soak import summary as soak_summary
from bench.soak.client import SoakRecord
from bench.soak.requests import FIELD_CASES, UNKNOWN_FIELDS, WIRE_CASES, Expect
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from compute.device.memory_report import log_memory
from compute.engine import Engine
from services.server.server_config import ServerConfig

MIX = "normal:6,cancel:3,deadline:2,bad:18,oversized:2"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    from tests.conftest import running_server

    engine = Engine(
        EngineConfig(
            model="dummy:tiny",
            cache=CacheConfig(block_size=16, num_blocks=256),
            device=DeviceConfig(device="cpu"),
        )
    )
    out = tmp_path_factory.mktemp("soak")
    log_path = _server_log(engine, out / "server.log")
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0)
    with running_server(engine, config) as server:
        argv = [
            "--server", server.target, "--server-pid", str(os.getpid()),
            "--metrics-url", f"http://127.0.0.1:{server.server.metrics_port}/metrics",
            "--duration", "4", "--warmup", "1", "--request-rate", "25", "--mix", MIX,
            "--input-len", "16", "--output-len", "8", "--oversized-mib", "2",
            "--idle-seconds", "0.5", "--sample-interval", "0.1", "--window", "1",
            "--rss-span", "0.5", "--out-dir", str(out), "--name", "t",
            "--server-log", str(log_path),
        ]  # fmt: skip
        code = soak.main(argv)
        assert engine.stats().kv_usage == 0.0  # the engine itself holds no block afterwards
    (path,) = out.glob("t-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    data = json.loads(path.read_text())
    assert code == (0 if data["summary"]["goals"]["passed"] else 1)
    return data


def _server_log(engine: Engine, path: Path) -> Path:
    """The engine's real ``memory`` line as a JSON server log writes it, and an error line."""
    with path.open("w") as log_file:
        structlog.configure(
            processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
            logger_factory=structlog.PrintLoggerFactory(log_file),
        )
        log_memory(engine.runner.model, engine.runner)
        structlog.get_logger().error("unexpected error", method="/x")
    structlog.reset_defaults()
    return path


def _records(data: dict) -> list[SoakRecord]:
    return [SoakRecord(**r) for r in data["records"]]


def test_every_kind_ends_as_it_must(result: dict) -> None:
    records = _records(result)
    seen = {(r.kind, r.variant) for r in records}
    bad = set(FIELD_CASES) | set(WIRE_CASES) | set(UNKNOWN_FIELDS) | {"token_id_out_of_vocab"}
    assert {v for k, v in seen if k == "bad"} == bad  # 4 s at 25 req/s cycles them all
    assert {k for k, _ in seen} == {"normal", "cancel", "deadline", "bad", "oversized"}
    for r in records:
        if r.kind == "bad":
            want = {"OK"} if r.variant in UNKNOWN_FIELDS else {"INVALID_ARGUMENT"}
        else:
            want = {"normal": {"OK"}, "cancel": {"CANCELLED", "OK"},
                    "deadline": {"DEADLINE_EXCEEDED", "OK"},
                    "oversized": {"INVALID_ARGUMENT"}}[r.kind]  # fmt: skip
        assert r.code in want, (r.kind, r.variant, r.code, r.details)
        assert r.expected, (r.kind, r.variant, r.code, r.details)
    assert result["summary"]["requests"]["unexpected_total"] == 0


def test_counts_are_computed_from_the_records(result: dict) -> None:
    records = _records(result)
    expectations = {k: Expect(tuple(v["codes"]), tuple(v["prefixes"])) for k, v in
                    result["expectations"].items()}  # fmt: skip
    for r in records:
        assert r.expected == soak_summary.classify(r, expectations[f"{r.kind}/{r.variant}"])
    counts = result["summary"]["requests"]
    assert counts["total"] == len(records)
    for kind, by_code in counts["by_kind"].items():
        assert by_code == dict(Counter(r.code for r in records if r.kind == kind))
    assert counts["expected_by_code"] == dict(Counter(r.code for r in records if r.expected))
    assert counts["unexpected_by_code"] == dict(Counter(r.code for r in records if not r.expected))


def test_latency_windows_are_computed_from_the_records(result: dict) -> None:
    records = _records(result)
    windows = result["windows"]
    assert sum(w["requests"] for w in windows) == len(records)  # every end falls in one
    for w in windows:
        inside = [r for r in records if w["t_start"] <= r.end < w["t_end"]]
        ok = [r for r in inside if r.kind == "normal" and r.code == "OK"]
        assert w["completed_normal"] == len(ok)
        ttft = [(r.first_token - r.send) * 1000 for r in ok]
        e2e = [(r.end - r.send) * 1000 for r in ok]
        tpot = [(e - t) / (r.output_tokens - 1) for r, t, e in zip(ok, ttft, e2e, strict=True)
                if r.output_tokens > 1]  # fmt: skip
        for key, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
            for q in (50, 90, 99):
                got = w[key][f"p{q}_ms"]
                if values:
                    assert got == pytest.approx(np.percentile(values, q), rel=1e-9)
                else:
                    assert got is None


def test_rss_leak_check_and_goals_follow_the_samples(result: dict) -> None:
    samples, phases = result["samples"], result["phases"]
    rss = result["summary"]["rss"]
    warm_end = phases["warmup"][1]
    at_warm = [s["rss_mib"] for s in samples if warm_end - 0.5 <= s["t"] <= warm_end]
    assert rss["after_warmup_mib"] == statistics.median(at_warm)
    a, b = phases["idle_start"]
    assert rss["idle_start_mib"] == statistics.median(
        [s["rss_mib"] for s in samples if a <= s["t"] <= b]
    )
    end = max(rss["end_of_load_mib"], rss["idle_end_mib"])
    growth = 100 * (end - rss["after_warmup_mib"]) / rss["after_warmup_mib"]
    assert rss["growth_after_warmup_percent"] == pytest.approx(growth)
    kv, final = result["summary"]["kv_after_load"], result["final_sample"]
    assert kv["num_blocks"] == 256
    assert kv["leaked_blocks"] == round(final["kv_cache_usage"] * 256) == 0
    goals = result["summary"]["goals"]
    assert goals["rss_growth_below_limit"] == (growth < goals["rss_growth_limit_percent"])
    assert goals["zero_leaked_blocks"] and goals["engine_idle_after_load"]
    assert goals["zero_unexpected_errors"]
    assert goals["passed"] == goals["rss_growth_below_limit"]


def test_memory_and_server_log_are_read_back(result: dict) -> None:
    log = result["server_log"]
    assert log["levels"] == {"info": 1, "error": 1}
    assert [e["event"] for e in log["errors"]] == ["unexpected error"]
    line, memory = log["memory"], result["summary"]["memory"]
    # dummy:tiny: 2 layers x (K, V) x 256 blocks x 16 slots x 2 KV heads x 16 dims x 4 bytes.
    kv_mib = 2 * 2 * 256 * 16 * 2 * 16 * 4 / 2**20
    assert memory["kv_cache_cpu_mib"] == line["kv_cache_mib"]["cpu"] == kv_mib
    assert memory["model_cpu_mib"] == line["model_mib"]["cpu"] > 0
    rss = result["summary"]["rss"]["idle_end_mib"]
    assert memory["other_idle_end_mib"] == pytest.approx(
        rss - memory["model_cpu_mib"] - memory["kv_cache_cpu_mib"]
    )


def _record(kind: str, code: str, details: str = "", chars: int | None = None) -> SoakRecord:
    chars = len(details) if chars is None else chars
    return SoakRecord(0, kind, "v", 0.0, 1.0, code=code, details=details, details_chars=chars)


def test_classify_flags_what_must_not_happen() -> None:
    field = Expect(("INVALID_ARGUMENT",), ("sampling.top_p",))
    assert soak_summary.classify(_record("bad", "INVALID_ARGUMENT", "sampling.top_p: no"), field)
    assert not soak_summary.classify(_record("bad", "INVALID_ARGUMENT", "prompt: no"), field)
    assert not soak_summary.classify(_record("bad", "INTERNAL", "sampling.top_p: x"), field)
    leak = "sampling.top_p: IndexError('index out of range in self')"
    assert not soak_summary.classify(_record("bad", "INVALID_ARGUMENT", leak), field)
    echoed = _record("bad", "INVALID_ARGUMENT", "sampling.top_p: x", chars=100_000)
    assert not soak_summary.classify(echoed, field)
    normal = Expect(("OK",))
    assert not soak_summary.classify(_record("normal", "RESOURCE_EXHAUSTED"), normal)
    assert not soak_summary.classify(_record("normal", "NO_COMPLETE"), normal)
    assert soak_summary.classify(_record("cancel", "CANCELLED"), Expect(("CANCELLED", "OK")))


def test_goals_fail_on_a_leak_growth_or_unexpected_error() -> None:
    rss = {"growth_after_warmup_percent": 1.0}
    clean = {"kv_cache_usage": 0.0, "leaked_blocks": 0, "running": 0, "waiting": 0}
    ok = {"unexpected_total": 0}
    assert soak_summary.goals(rss, clean, ok, 5.0)["passed"] is True
    leaked = soak_summary.kv_after_load(
        {"kv_cache_usage": 3 / 256, "running": 0, "waiting": 0}, 256
    )
    assert leaked["leaked_blocks"] == 3
    assert soak_summary.goals(rss, leaked, ok, 5.0)["passed"] is False
    assert (
        soak_summary.goals({"growth_after_warmup_percent": 6.0}, clean, ok, 5.0)["passed"] is False
    )
    assert soak_summary.goals(rss, clean, {"unexpected_total": 1}, 5.0)["passed"] is False
    unmeasured = soak_summary.goals({"growth_after_warmup_percent": None}, clean, ok, 5.0)
    assert unmeasured["passed"] is None
