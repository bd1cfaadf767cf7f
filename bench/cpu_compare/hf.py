"""HF transformers in the CPU comparison: in this process, fp32, the same GGUF file
(transformers dequantizes it).

One stream is bench/decode.py's streamer-stamped ``generate``; many streams are
bench/offline/hf.py's static batching (left-padded batches in workload order, each running
until its longest request is done, only each request's own tokens counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench import common
from bench.decode import hf_runner
from bench.offline.hf import hf_generate, run_hf_static
from bench.offline.workload import Workload


class HFSystem:
    """The HF model in this process; ``run`` is bench/decode.py's streamer-stamped Runner."""

    name = "hf"

    def __init__(self, threads: int, static_batch_size: int, gguf: Path) -> None:
        self.threads, self.batch_size, self.gguf = threads, static_batch_size, gguf
        self.last_server: dict[str, Any] = {}  # nothing server-side: generate runs in-process
        self._info: dict[str, Any] = {"static_batch_size": static_batch_size}
        self._runner = None
        self._model = None

    def start(self, timeout: float, idle_wait: float) -> None:
        del timeout, idle_wait  # nothing to wait for: loading is synchronous
        torch.set_num_threads(self.threads)
        self._model, load_s = common.load_hf_model(self.gguf)
        hf_generate(self._model, [[1, 2, 3], [4, 5, 6, 7]], 4, "cpu")  # batched path, untimed
        self._runner = hf_runner(self._model, "cpu")
        self._info |= {"start_s": round(load_s, 2), "torch_threads": torch.get_num_threads()}

    def run(self, prompt: list[int], new_tokens: int) -> tuple[list[float], list[int], float]:
        return self._runner(prompt, new_tokens)

    def many(self, workload: Workload) -> dict[str, Any]:
        result = run_hf_static(self._model, workload, self.batch_size, "cpu")
        result.pop("load_average", None)  # the caller records load around every measurement
        return result

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def close(self) -> None:
        self._model = self._runner = None
