"""``headrace bench serve`` against a real in-process server (FakeEngine): the JSON's
metrics are recomputed here, independently, from the per-request client timestamps it
records, and its token counts are checked against what the server reported."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from services.bench import arrivals, stats, workload
from services.cli import cli
from services.server.server_config import ServerConfig
from tests.conftest import RunningServer


@pytest.fixture
def metered(serve) -> RunningServer:
    """A FakeEngine server that also serves /metrics on a free port."""
    return serve(config=ServerConfig(host="127.0.0.1", port=0, metrics_port=0))


def _bench(server: RunningServer, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "result.json"  # strict JSON: no Infinity/NaN
    argv = ["bench", "serve", "--server", server.target, "--result-json", str(out),
            "--metrics-url", f"http://127.0.0.1:{server.server.metrics_port}/metrics",
            "--metrics-interval", "0.05", "--no-progress", *extra]  # fmt: skip
    assert cli.main(argv) == 0
    return json.loads(out.read_text(), parse_constant=_refuse)


def _refuse(name: str) -> None:
    raise AssertionError(f"non-standard JSON constant {name}")


def _independent(requests: list[dict]) -> dict[str, list[float]]:
    """TTFT/TPOT/ITL/e2e (ms) straight from the recorded timestamps, with numpy."""
    ttft, tpot, itl, e2e = [], [], [], []
    for r in requests:
        times = np.array([t for t, _ in r["chunks"]])
        ttft.append((times[0] - r["send"]) * 1000)
        e2e.append((r["end"] - r["send"]) * 1000)
        if r["output_tokens"] > 1:
            tpot.append((e2e[-1] - ttft[-1]) / (r["output_tokens"] - 1))
        itl.extend(np.diff(times) * 1000)
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2e}


def _check_distributions(metrics: dict, requests: list[dict]) -> None:
    for key, values in _independent(requests).items():
        assert values, key
        got = metrics[key]
        assert got["mean_ms"] == pytest.approx(np.mean(values), rel=1e-9)
        assert got["median_ms"] == pytest.approx(np.median(values), rel=1e-9)
        for q in (90, 99):
            assert got[f"p{q}_ms"] == pytest.approx(np.percentile(values, q), rel=1e-9)


def test_metrics_match_the_client_timestamps(metered: RunningServer, tmp_path: Path) -> None:
    result = _bench(
        metered, tmp_path, "--num-requests", "12", "--max-concurrency", "4",
        "--request-rate", "400", "--input-len", "16", "--output-len", "8", "--ignore-eos",
        "--goodput", "ttft:60000,tpot:60000", "--plot", str(tmp_path / "p.png"),
    )  # fmt: skip
    (run,) = result["runs"]
    m, reqs = run["metrics"], run["requests"]
    assert m["completed"] == 12 and m["failed"] == 0 and len(reqs) == 12
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] == 16 for r in reqs)
    assert all(sum(n for _, n in r["chunks"]) == r["output_tokens"] for r in reqs)
    assert m["total_output_tokens"] == 96 and m["total_input_tokens"] == 192
    duration = max(r["end"] for r in reqs) - min(r["send"] for r in reqs)
    assert m["duration_s"] == pytest.approx(duration)
    assert m["request_throughput"] == pytest.approx(12 / duration)
    assert m["output_throughput"] == pytest.approx(96 / duration)
    assert m["total_token_throughput"] == pytest.approx((96 + 192) / duration)
    assert m["request_goodput"] == pytest.approx(12 / duration)  # every SLO generous
    _check_distributions(m, reqs)
    # Sends follow the seeded arrival schedule (never early).
    offsets = arrivals.arrival_offsets(12, 400.0, 1.0, 0)
    assert all(r["send"] >= offsets[r["index"]] - 1e-6 for r in reqs)
    assert result["server_info"]["model_name"] and result["machine"]["cpu_count"]
    samples = run["server_metrics"]["samples"]
    assert samples and "running" in samples[0] and "step_loop_idle_ratio" in samples[0]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_goodput_counts_only_requests_meeting_the_slos(
    metered: RunningServer, tmp_path: Path
) -> None:
    result = _bench(metered, tmp_path, "--num-requests", "6", "--dataset", "fixed",
                    "--output-len", "5", "--goodput", "ttft:0.000001")  # fmt: skip
    m = result["runs"][0]["metrics"]
    assert m["completed"] == 6 and m["request_goodput"] == 0.0


def test_rate_sweep_runs_each_rate_on_the_same_workload(
    metered: RunningServer, tmp_path: Path
) -> None:
    result = _bench(
        metered, tmp_path, "--num-requests", "5", "--sweep-rate", "50,inf", "--warmup", "0",
        "--dataset", "fixed", "--output-len", "4", "--plot", str(tmp_path / "sweep.png"),
    )  # fmt: skip
    assert [r["request_rate"] for r in result["runs"]] == [50.0, "inf"]
    for run in result["runs"]:
        assert run["metrics"]["completed"] == 5
        _check_distributions(run["metrics"], run["requests"])
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_errors_are_counted_by_status_code(metered: RunningServer, tmp_path: Path) -> None:
    lines = tmp_path / "w.jsonl"
    lines.write_text(
        '{"prompt": "hello there", "output_len": 4}\n{"prompt": "x", "output_len": 0}\n'
    )
    result = _bench(metered, tmp_path, "--dataset", "jsonl", "--dataset-path", str(lines),
                    "--num-requests", "4", "--warmup", "0")  # fmt: skip
    m = result["runs"][0]["metrics"]
    assert m["completed"] == 2 and m["errors_by_code"] == {"INVALID_ARGUMENT": 2}


def test_arrivals_are_seeded_with_the_requested_mean_rate() -> None:
    gaps = np.diff(arrivals.arrival_offsets(20_000, 10.0, 1.0, seed=3))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert arrivals.arrival_offsets(5, 10.0, 0.5, 1) == arrivals.arrival_offsets(5, 10.0, 0.5, 1)
    assert arrivals.arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    bursty = np.diff(arrivals.arrival_offsets(20_000, 10.0, 0.25, seed=3))
    assert bursty.std() > 1.5 * gaps.std()  # gamma shape < 1: burstier than Poisson


def test_random_workload_is_seeded_with_exact_lengths_and_a_shared_prefix() -> None:
    spec = workload.RandomSpec(input_len=20, output_len=7, prefix_len=5)
    pool = workload.token_pool(None, vocab_size=50, eos=[0, 2])
    reqs = workload.random_requests(spec, pool, 4, seed=1)
    assert reqs == workload.random_requests(spec, pool, 4, seed=1)
    assert all(len(r.token_ids) == 25 and r.max_tokens == 7 for r in reqs)
    assert len({r.token_ids[:5] for r in reqs}) == 1 and len({r.token_ids for r in reqs}) == 4
    assert not {0, 2} & {t for r in reqs for t in r.token_ids}


def test_bad_flags_are_refused() -> None:
    with pytest.raises(ValueError, match="goodput"):
        stats.parse_slos("latency:5")
    parser = cli.build_parser({})
    args = parser.parse_args(["bench", "serve", "--sweep-rate", "1,0"])
    with pytest.raises(ValueError, match="sweep-rate"):
        from services.bench.flags import check_args

        check_args(args)


def test_random_workload_without_a_tokenizer_draws_from_the_vocabulary(
    serve, tmp_path: Path
) -> None:
    from tests.support.fake_engine import FakeEngine

    server = serve(engine=FakeEngine(None, [5, 6, 7], vocab_size=40, step_delay=0.001))
    result = _bench(server, tmp_path, "--num-requests", "4", "--input-len", "10",
                    "--output-len", "3", "--metrics-url", "none")  # fmt: skip
    run = result["runs"][0]
    assert run["metrics"]["completed"] == 4 and run["metrics"]["total_input_tokens"] == 40
    assert run["server_metrics"]["samples"] == []


def test_serving_wrapper_launches_unless_given_a_server() -> None:
    from bench.serving import bench_argv

    argv = bench_argv(["--num-requests", "3", "--", "--max-num-seqs", "8"], "S")
    assert argv[:3] == ["bench", "serve", "--launch"]
    assert argv[-2:] == ["--", "--max-num-seqs", "8"][-2:] and "--" in argv
    assert any(a.endswith("serving-S.json") for a in argv)
    assert "--launch" not in bench_argv(["--server", "h:1", "--plot", "x.png"], "S")
