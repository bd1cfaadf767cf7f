"""The GPU benchmarks of issues 16 and 17 run end to end on the CPU with small numbers:
the plumbing a GPU session relies on (bench/gpu/step_gap.py: launch hooks around every
launch, both output modes; bench/gpu/engine_gpu.py: the same dummy weights in headrace and
HF, the batch-size probe, the JSON's top-level keys; bench/gpu/cuda_graphs.py: both engines,
every case, the JSON's top-level keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

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


def test_gpu_check_finds_its_benchmarks_without_a_gpu(tmp_path) -> None:
    """``make gpu-check``'s script from bench/gpu/: its bench step reaches both benchmark
    modules from the repository root (they refuse to run without CUDA, by name)."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
           "GPU_CHECK_BENCH_S": "120", "GPU_CHECK_GAP_S": "120"}  # fmt: skip
    subprocess.run(["bash", str(repo / "bench/gpu/gpu_check.sh"), "bench"], env=env,
                   cwd=tmp_path, capture_output=True, timeout=400)  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text()
    assert "step bench-kernels" in summary and "step bench-step-gap" in summary
    with tarfile.open(tmp_path / "all.tar.gz") as tar:
        log = tar.extractfile("./bench.log").read().decode()
    assert "No module named" not in log
    assert "needs a CUDA GPU" in log or "gpu-kernels" in log
    assert "no CUDA device here" in log or "step-gap-gpu" in log
