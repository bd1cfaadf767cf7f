"""The offline benchmark's seeded synthetic workload (prompts, output lengths, arrivals)."""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start, ascending (all 0 = all at once)

    def describe(self) -> dict[str, Any]:
        plens = [len(p) for p in self.prompts]
        return {
            "num_requests": len(self.prompts),
            "prompt_tokens_total": sum(plens),
            "prompt_tokens_mean": round(statistics.mean(plens), 1),
            "output_tokens_total": sum(self.output_lens),
            "output_tokens_mean": round(statistics.mean(self.output_lens), 1),
            "output_tokens_max": max(self.output_lens),
            "last_arrival_s": round(self.arrivals[-1], 2),
        }


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Seeded; the same arguments give the same requests on every machine."""
    rng = random.Random(args.seed)
    prompts, lens = [], []
    for _ in range(args.num_requests):
        n = rng.randint(args.prompt_min, args.prompt_max)
        prompts.append([rng.randrange(vocab_size) for _ in range(n)])
        length = round(rng.expovariate(1.0 / args.output_mean))
        lens.append(max(1, min(args.output_cap, length)))
    # A separate stream, so the same seed gives the same prompts with or without arrivals.
    gaps = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in range(args.num_requests):
        arrivals.append(t)
        if args.arrival_rate > 0:
            t += gaps.expovariate(args.arrival_rate)
    return Workload(prompts, lens, arrivals)


def model_vocab_size(gguf: Path | None = None) -> int:
    """Read from the GGUF's metadata (default: the embedded model's), so the workload exists
    before any system is loaded."""
    from transformers import AutoConfig

    gguf = gguf or common.default_gguf_path()
    return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).vocab_size
