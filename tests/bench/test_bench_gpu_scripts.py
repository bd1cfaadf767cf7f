"""The GPU benchmarks of issues 16 and 17 run end to end on the CPU with small numbers:
the plumbing a GPU session relies on (bench/gpu/step_gap.py: launch hooks around every
launch, both output modes; bench/gpu/engine_gpu.py: the same dummy weights in headrace and
HF, the batch-size probe, the JSON's top-level keys; bench/gpu/cuda_graphs.py: both engines,
every case, the JSON's top-level keys)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common
from bench.gpu import cuda_graphs, engine_gpu, step_gap


def test_step_gap_dry_run_on_the_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    argv = ["--device", "cpu", "--shape", "tiny", "--batches", "2,3", "--steps", "4",
            "--warmup", "1", "--name", "gap"]  # fmt: skip
    step_gap.main(argv)
    [path] = tmp_path.glob("gap-cpu-*.json")
    assert list(tmp_path.glob("gap-cpu-*.png"))
    result = json.loads(path.read_text())
    assert result["clocks"] == "host clocks"
    rows = result["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("sync", 2), ("async", 2), ("sync", 3), ("async", 3)
    ]  # fmt: skip
    for row in rows:
        assert row["step_ms_median"] > 0 and row["gap_ms_median"] >= 0
        assert row["decode_tok_s"] > 0
        # Whether graphs were replayed: none on the CPU (no capture there).
        assert row["cuda_graphs"] is False and row["captured_batch_sizes"] == []
        assert row["graph_replays"] == 0


def test_json_only_runs_are_drawn_later_by_replot(tmp_path, monkeypatch) -> None:
    """The device call keeps to 8 files, so its benchmarks write JSON only (--no-png);
    bench.gpu.replot draws the PNG beside each JSON afterwards."""
    from bench.gpu import replot

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    argv = ["--device", "cpu", "--shape", "tiny", "--batches", "2", "--steps", "2",
            "--warmup", "1", "--modes", "async", "--no-png"]  # fmt: skip
    step_gap.main(argv)
    [gap] = tmp_path.glob("step-gap-cpu-*.json")
    assert not list(tmp_path.glob("*.png"))
    kernels = tmp_path / "kernels-nvidia-h200-20261128-120000.json"
    variant = {"us": 10.0, "gb_per_s": 100.0, "percent_of_peak": 2.1, "kernels": ["k"]}
    row = {"shape": "smollm2-135m", "batch": 1, "context": 512, "kernel": variant,
           "variants": {"two-pass": variant, "one-pass": variant}}  # fmt: skip
    record = {"benchmark": "kernels-nvidia-h200", "gpu": {"gpu": "NVIDIA H200"}, "results": [row]}
    kernels.write_text(json.dumps(record))
    assert replot.main([str(gap), str(kernels)]) == 0
    assert gap.with_suffix(".png").is_file() and kernels.with_suffix(".png").is_file()
    assert tmp_path == common.RESULTS_DIR  # put back


def test_timeline_pairs_launches_and_gaps() -> None:
    timeline = step_gap.Timeline(cuda=False)
    timeline.before()  # not recording: ignored
    timeline.after()
    timeline.recording = True
    for _ in range(3):
        timeline.before()
        timeline.after()
    steps, gaps = timeline.steps_and_gaps()
    assert len(steps) == 3 and len(gaps) == 2
    assert all(s >= 0 for s in steps) and all(g >= 0 for g in gaps)


def test_engine_gpu_dry_run_on_the_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    argv = ["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--num-requests", "6",
            "--prompt-len", "8", "--output-len", "4", "--hf-batch-sizes", "2,4,8",
            "--kv-cache-memory-gib", "0.01", "--name", "eng"]  # fmt: skip
    engine_gpu.main(argv)
    [path] = tmp_path.glob("eng-cpu-*.json")
    assert list(tmp_path.glob("eng-cpu-*.png"))
    result = json.loads(path.read_text())
    assert result["gpu"] == "cpu"
    [row] = result["rows"]
    assert result["headrace_tok_s"] == row["headrace"]["output_tok_s"] > 0
    assert result["hf_static_tok_s"] == row["hf_static"]["output_tok_s"] > 0
    assert result["ratio"] == row["ratio"] > 0
    assert set(row["hf_static"]["probes_tok_s"]) == {"2", "4"}  # 8 > 6 requests: not probed
    assert row["hf_static"]["batch_size"] in (2, 4)


def test_engine_gpu_output_lengths_are_spread_as_real_traffic() -> None:
    """Capped exponential of mean --output-len: spread (not all one length), within [1, cap],
    the mean near --output-len, the same for one seed; --output-cap 0: all --output-len."""
    args = engine_gpu.parse_args(["--device", "cpu"])
    lens = engine_gpu.output_lens(args, 4096)
    assert lens == engine_gpu.output_lens(args, 4096)
    assert min(lens) >= 1 and max(lens) == args.output_cap == 512
    assert len(set(lens)) > 100
    assert 0.9 * 128 < sum(lens) / len(lens) < 1.1 * 128  # the cap trims ~2% of the mean
    fixed = engine_gpu.parse_args(["--device", "cpu", "--output-cap", "0"])
    assert engine_gpu.output_lens(fixed, 7) == [128] * 7


def test_hf_baseline_computes_what_headrace_computes() -> None:
    """The HF model built from the dummy tensors is the same function as headrace's: on the
    tiny shape in fp32 their greedy tokens agree."""
    from dataclasses import replace

    import torch

    from compute.core.sampling_params import SamplingParams
    from compute.engine import Engine
    from compute.loaders.dummy import load_dummy

    args = engine_gpu.parse_args(["--device", "cpu", "--dtype", "float32", "--output-len", "6"])
    loaded = load_dummy("tiny", torch.float32, "cpu", seed=3)
    # A rope base other than HF's default, so a base that did not reach HF would show.
    loaded = replace(loaded, config=replace(loaded.config, rope_theta=50000.0))
    model = engine_gpu.hf_model(loaded.config, loaded, args)
    prompt = [5, 17, 99, 3, 250, 7, 41, 8]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            **common.hf_generate_kwargs(6),
        )  # fmt: skip
    engine = Engine(engine_gpu.EngineConfig(model="dummy:tiny"), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [ours] = engine.generate([prompt], params)
    assert out[0, len(prompt) :].tolist() == ours.token_ids


def test_cuda_graphs_dry_run_on_the_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    argv = ["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--batches", "1,3",
            "--contexts", "16,40", "--steps", "3", "--stream-tokens", "6",
            "--kv-cache-memory-gib", "0.02", "--name", "cg"]  # fmt: skip
    cuda_graphs.main(argv)
    [path] = tmp_path.glob("cg-cpu-*.json")
    assert list(tmp_path.glob("cg-cpu-*.png"))
    result = json.loads(path.read_text())
    assert result["gpu"] == "cpu" and result["speedup_batch1"] > 0
    assert set(result["single_stream_tok_s"]) == {"eager", "graphs"}
    cases = [(r["graphs"], r["context"], r["batch"]) for r in result["rows"] if "batch" in r]
    assert sorted(cases) == sorted(
        (g, c, b) for g in (False, True) for c in (16, 40) for b in (1, 3)
    )


class Killed(Exception):
    pass


def test_engine_gpu_writes_its_json_after_every_shape(tmp_path, monkeypatch) -> None:
    """A run killed during the second shape (here: failing in it) leaves the first one's
    JSON and PNG, marked incomplete."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    calls: list[str] = []

    def headrace(args, shape, loaded):
        calls.append(shape)
        if len(calls) == 2:
            raise Killed  # what a kill mid-shape amounts to, for the files
        return {"output_tok_s": 100.0}

    monkeypatch.setattr(engine_gpu, "load_dummy", lambda *a, **k: type("L", (), {"config": 0}))
    monkeypatch.setattr(engine_gpu, "run_headrace", headrace)
    monkeypatch.setattr(engine_gpu, "run_hf_static", lambda *a: {"output_tok_s": 10.0,
                                                                  "batch_size": 4})  # fmt: skip
    with pytest.raises(Killed):
        engine_gpu.main(["--device", "cpu", "--shapes", "tiny,smollm2-135m", "--name", "eng"])
    [path] = tmp_path.glob("eng-cpu-*.json")
    assert list(tmp_path.glob("eng-cpu-*.png"))
    result = json.loads(path.read_text())
    assert result["shapes_done"] == ["tiny"] and result["complete"] is False
    assert result["ratio"] == 10.0 and result["headrace_tok_s"] == 100.0


def test_cuda_graphs_writes_its_json_after_every_shape(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)

    def run_shape(args, shape):
        if shape != "tiny":
            raise Killed
        rows = []
        for graphs in (False, True):
            rows.append({"shape": shape, "graphs": graphs, "batch": 1, "context": 16,
                         "step_ms": 2.0 if graphs else 6.0, "decode_tok_s": 1.0})  # fmt: skip
            rows.append({"shape": shape, "graphs": graphs, "single_stream_tok_s": 5.0})
        return rows

    monkeypatch.setattr(cuda_graphs, "run_shape", run_shape)
    argv = ["--device", "cpu", "--shapes", "tiny,smollm2-135m", "--batches", "1",
            "--contexts", "16", "--name", "cg"]  # fmt: skip
    with pytest.raises(Killed):
        cuda_graphs.main(argv)
    [path] = tmp_path.glob("cg-cpu-*.json")
    assert list(tmp_path.glob("cg-cpu-*.png"))
    result = json.loads(path.read_text())
    assert result["shapes_done"] == ["tiny"] and result["complete"] is False
    assert result["speedup_batch1"] == 3.0


def test_results_dir_and_commit_from_the_environment(tmp_path) -> None:
    """bench/gpu/gpu_check.sh points the benchmarks at the device call's return folder and
    names the commit where the copy of the tree has no .git."""
    code = ("from bench import common; import json; print(json.dumps([str(common.RESULTS_DIR), "
            "common.git_commit()['sha']]))")  # fmt: skip
    env = {
        "HEADRACE_BENCH_RESULTS": str(tmp_path),
        "HEADRACE_COMMIT": "abc1234",
        "PATH": "/nonexistent",
    }  # fmt: skip  (no git on the PATH: as in a copy without .git)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert json.loads(out.stdout) == [str(tmp_path), "abc1234"]
