"""Oversized prompts against ``headrace serve`` (issue 10): rejection latency, the latency
of a normal request sent beside them, and the server's RSS before, at peak and after.

Two concurrent Generate calls with a 15 MiB prompt (``"a " * 7_864_320``), and a normal
greedy request 0.2 s later; the same-run baseline is the normal request alone. Run once
with the default limits (refused by --max-prompt-bytes) and once with the byte limits
raised to 16 MiB (refused by the context bound, before tokenizing).

    python bench/oversized_prompt.py

Writes ``bench/results/oversized-prompt-<stamp>.json``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO_ROOT, timestamp, write_result  # noqa: E402
from bench.serving import _wait_ready  # noqa: E402
from services.gen.headrace.v1 import generation_pb2 as pb  # noqa: E402
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

HUGE = "a " * 7_864_320
SCENARIOS = {
    "default_limits": [],
    "byte_limits_raised": ["--max-prompt-bytes", "16777216", "--max-request-bytes", "16777216"],
}
MAX_MESSAGE = [("grpc.max_send_message_length", 17 << 20)]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@contextlib.contextmanager
def server(extra: list[str]):
    cmd = [sys.executable, "-m", "services.cli.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", "--log-level", "warning", *extra]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            target, _ = _wait_ready(proc, log_path, 600)
            yield proc, target
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def timed(stub, request) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        list(stub.Generate(request, timeout=300))
        outcome = "OK"
    except grpc.RpcError as exc:
        outcome = f"{exc.code().name}: {exc.details()[:120]}"
    return time.perf_counter() - start, outcome


def normal() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="Tell me about the sea.",
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=16, ignore_eos=True),
    )


def scenario(extra: list[str]) -> dict:
    with server(extra) as (proc, target):
        stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(target, MAX_MESSAGE))
        timed(stub, normal())  # warm-up
        alone, _ = timed(stub, normal())
        time.sleep(1.0)
        before = rss_mib(proc.pid)
        peak, stop = [before], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak.append(rss_mib(proc.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        results: dict[str, tuple[float, str]] = {}
        huge = pb.GenerateRequest(prompt=HUGE, stopping=pb.StoppingCriteria(max_tokens=8))
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(f"huge{i}", timed(stub, huge)))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        time.sleep(0.2)
        results["normal"] = timed(stub, normal())
        for t in threads:
            t.join()
        time.sleep(3.0)
        stop.set()
        sampler.join()
        after = rss_mib(proc.pid)
        return {
            "rejection_seconds": [results[f"huge{i}"][0] for i in range(2)],
            "rejection_outcome": results["huge0"][1],
            "normal_alone_seconds": alone,
            "normal_beside_huge_seconds": results["normal"][0],
            "normal_outcome": results["normal"][1],
            "rss_mib_before": before,
            "rss_mib_peak": max(peak),
            "rss_mib_after_3s": after,
            "rss_growth_after_percent": 100 * (after - before) / before,
        }


def main() -> None:
    out = {name: scenario(extra) for name, extra in SCENARIOS.items()}
    for name, result in out.items():
        print(name, result)
    path = write_result(
        "oversized-prompt",
        {"results": out},
        timestamp(),
        settings={"prompt_bytes": len(HUGE), "concurrent_huge": 2, "model": "default"},
    )
    print(path)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
