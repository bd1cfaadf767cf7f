"""headrace in the CPU comparison: a ``headrace serve`` subprocess per --weights mode,
driven over gRPC with the bundled client (one stream) and ``headrace bench serve``'s
asyncio runner (many streams at once)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from bench import common
from bench.cpu_compare.measure import many_result
from bench.offline.workload import Workload
from bench.procs import ServerProcess
from services.bench import launch
from services.bench.launch import READY
from services.bench.runner import RunSettings, run_workload
from services.bench.workload import BenchRequest
from services.client.client import Client, generate_request

# "--headrace-weights default" starts the server without --weights (its own default), so
# the comparison also runs against a build that has no such flag.
SERVER_DEFAULT = "default"


def serve_command(threads: int, weights: str, extra: list[str]) -> list[str]:
    """``headrace serve`` from the working tree on free loopback ports, one --weights mode."""
    mode = [] if weights == SERVER_DEFAULT else ["--weights", weights]
    return launch.serve_command(["--threads", str(threads), *mode, *extra])


def _ready_target(log: str) -> str | None:
    match = READY.search(log)
    return f"{match['host']}:{match['port']}" if match else None


class HeadraceSystem:
    """One ``headrace serve`` process; ``run`` is a bench/decode.py Runner over gRPC."""

    def __init__(self, weights: str, threads: int, extra: list[str], seed: int) -> None:
        self.name = f"headrace[{weights}]"
        self.weights, self.seed = weights, seed
        self.server = ServerProcess(
            self.name, serve_command(threads, weights, extra), cwd=common.REPO_ROOT
        )
        self.target = ""
        self.client: Client | None = None
        self.last_server: dict[str, Any] = {}
        self._info: dict[str, Any] = {"weights": weights, "command": self.server.cmd}
        self._count = 0

    def start(self, timeout: float, idle_wait: float) -> None:
        self.target = self.server.start(_ready_target, timeout)
        self.client = Client(self.target, timeout=3600)
        time.sleep(idle_wait)  # let start-up work (threads, allocator) settle before reading
        self._info |= {"start_s": self.server.start_s, "idle": self.server.memory()}

    def run(self, prompt: list[int], new_tokens: int) -> tuple[list[float], list[int], float]:
        """One greedy request with EOS ignored; every token stamped when its chunk arrives."""
        self._count += 1
        request = generate_request(
            token_ids=prompt,
            temperature=0.0,
            max_tokens=new_tokens,
            request_id=f"single-{self._count}",
        )
        request.stopping.ignore_eos = True
        stamps: list[float] = []
        ids: list[int] = []
        start = time.perf_counter()
        for response in self.client.generate(request):
            if response.HasField("complete"):
                self.last_server = _server_side(response.complete)
            elif response.chunk.token_ids:
                now = time.perf_counter()
                stamps.extend(now for _ in response.chunk.token_ids)
                ids.extend(response.chunk.token_ids)
        return stamps, ids, start

    def many(self, workload: Workload) -> dict[str, Any]:
        """Every request of the workload at once over one channel; tokens/s over the wall time
        from the first send to the last stream's end."""
        requests = [
            BenchRequest(n, token_ids=tuple(p))
            for p, n in zip(workload.prompts, workload.output_lens, strict=True)
        ]
        settings = RunSettings(math.inf, 1.0, None, True, 0.0, self.seed)
        self._count += 1
        records, duration = asyncio.run(
            run_workload(
                self.target, requests, [0.0] * len(requests), settings, tag=f"many-{self._count}"
            )
        )
        failed = [r.error for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{self.name}: {len(failed)} requests failed: {sorted(set(failed))}")
        return many_result(
            [
                (r.send, r.chunks[0][0] if r.chunks else None, r.end, r.output_tokens)
                for r in records
            ],
            duration,
            sum(workload.output_lens),
        )

    def info(self) -> dict[str, Any]:
        """Start time, idle memory, and memory now (after the runs)."""
        now = self.server.memory() if self.server.proc else {}
        return self._info | {"end": now}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.server.stop()


def _server_side(complete: Any) -> dict[str, Any]:
    return {
        "server_ttft_s": round(complete.timing.time_to_first_token_seconds, 4),
        "server_total_s": round(complete.timing.total_seconds, 4),
        "cached_prompt_tokens": complete.usage.cached_prompt_tokens,
    }
