"""Oversized prompts against ``headrace serve`` (issue 10): rejection latency, the latency
of a normal request sent beside them, and the server's RSS before, at peak and after.

Two concurrent Generate calls with a 15 MiB prompt (``"a " * 7_864_320``), and a normal
greedy request 0.2 s later; the same-run baseline is the normal request alone. Run once
with the default limits (refused by --max-prompt-bytes) and once with the byte limits
raised to 16 MiB (refused by the context bound, before tokenizing).

    python -m bench.oversized_prompt

Writes ``bench/results/oversized-prompt-<stamp>.json``.
"""

from __future__ import annotations

import os
import threading
import time

import grpc

from bench.common import publish
from bench.procs import kib_to_mib, proc_status
from services.bench.launch import launched_process
from services.gen.headrace.v1 import generation_pb2 as pb
from services.gen.headrace.v1 import generation_pb2_grpc as pb_grpc

HUGE = "a " * 7_864_320
SCENARIOS = {
    "default_limits": [],
    "byte_limits_raised": ["--max-prompt-bytes", "16777216", "--max-request-bytes", "16777216"],
}
MAX_MESSAGE = [("grpc.max_send_message_length", 17 << 20)]


def rss_mib(pid: int) -> float:
    return kib_to_mib(proc_status(pid)["VmRSS"])


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
    with launched_process(extra, 600) as server:
        proc = server.process
        stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(server.target, MAX_MESSAGE))
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
    settings = {"prompt_bytes": len(HUGE), "concurrent_huge": 2, "model": "default"}
    publish("oversized-prompt", {"results": out}, settings=settings)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
