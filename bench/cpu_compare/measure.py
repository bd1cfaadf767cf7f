"""What the CPU comparison sends and how it times it: the seeded prompts and workload, the
repetition loop that alternates the systems, and the figures of one measurement.

A system is any object with ``name``, ``run(prompt, new_tokens) -> (token stamps, ids,
start)`` (bench/decode.py's Runner), ``last_server`` (what the server reported about the
last ``run``), ``many(workload) -> dict`` and ``info() -> dict``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import common
from bench.decode import timed_run
from bench.offline.workload import Workload, make_workload

PARTS = ("decode", "ttft", "many")


@dataclass(frozen=True)
class Plan:
    """Everything every system is given, identical across systems."""

    decode_prompts: list[list[int]]  # one per repetition: prompts differ so no cache can help
    ttft_prompts: list[list[int]]  # one per repetition
    new_tokens: int  # decoded per single-stream run
    workload: Workload  # the many-stream run
    warmup_prompts: tuple[list[int], list[int]]  # (decode, ttft) for the untimed warm-up
    # untimed, after the measurement: every system's greedy tokens, compared with llama.cpp's
    agree_prompts: list[list[int]] = field(default_factory=list)

    def slot_context(self, multiple: int = 256) -> int:
        """Tokens one llama-server slot must hold for the longest request of the plan."""
        longest = max(
            max(len(p) for p in self.decode_prompts) + self.new_tokens,
            max(len(p) for p in self.ttft_prompts) + 1,
            max(
                len(p) + n
                for p, n in zip(self.workload.prompts, self.workload.output_lens, strict=True)
            ),
        )
        return -(-longest // multiple) * multiple


def random_prompt(vocab_size: int, length: int, seed: int, salt: str) -> list[int]:
    """Seeded random token ids (content does not change the cost; lengths are exact)."""
    rng = random.Random(f"{seed}-{salt}")
    return [rng.randrange(vocab_size) for _ in range(length)]


def many_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """The issue's workload by default: 48 requests at once, prompts uniform in 10..60,
    outputs exponential with mean 48 capped at 160 (bench/offline/workload.py's generator)."""
    spec = argparse.Namespace(
        num_requests=args.num_requests,
        prompt_min=args.prompt_min,
        prompt_max=args.prompt_max,
        output_mean=args.output_mean,
        output_cap=args.output_cap,
        seed=args.seed,
        arrival_rate=0.0,
    )
    return make_workload(spec, vocab_size)


def make_plan(args: argparse.Namespace, vocab_size: int) -> Plan:
    def prompts(length: int, part: str) -> list[list[int]]:
        return [
            random_prompt(vocab_size, length, args.seed, f"{part}-{rep}")
            for rep in range(args.reps)
        ]

    return Plan(
        decode_prompts=prompts(args.decode_prompt_len, "decode"),
        ttft_prompts=prompts(args.ttft_prompt_len, "ttft"),
        new_tokens=args.new_tokens,
        workload=many_workload(args, vocab_size),
        warmup_prompts=(
            random_prompt(vocab_size, args.decode_prompt_len, args.seed, "warmup-decode"),
            random_prompt(vocab_size, args.ttft_prompt_len, args.seed, "warmup-ttft"),
        ),
        agree_prompts=[
            random_prompt(vocab_size, args.decode_prompt_len, args.seed, f"agree-{i}")
            for i in range(getattr(args, "agree_prompts", 0))
        ],
    )


def rotated(items: Sequence[Any], rep: int) -> list[Any]:
    """Repetition r starts with item r (mod n): no system always runs first or last."""
    if not items:
        return []
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def single(system: Any, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One stream: TTFT, decode tokens/s over the tokens after the first, and what the server
    says; raises unless exactly ``new_tokens`` tokens came back."""
    system.last_server = {}
    result = timed_run(system.run, prompt, new_tokens)
    ids = result.pop("token_ids")
    out = {k: round(v, 4) for k, v in result.items() if v is not None}
    return out | dict(system.last_server) | {"prompt_tokens": len(prompt), "token_ids": ids}


def run_part(system: Any, part: str, plan: Plan, rep: int) -> dict[str, Any]:
    if part == "decode":
        return single(system, plan.decode_prompts[rep], plan.new_tokens)
    if part == "ttft":
        result = single(system, plan.ttft_prompts[rep], 1)
        result.pop("token_ids")
        return result
    return system.many(plan.workload)


def warm_up(system: Any, plan: Plan) -> None:
    """Untimed: a short decode and one long prefill, so first-call costs stay out."""
    decode, ttft = plan.warmup_prompts
    single(system, decode, min(8, plan.new_tokens))
    single(system, ttft, 1)


def measure(
    systems: Sequence[Any],
    plan: Plan,
    reps: int,
    parts: Sequence[str] = PARTS,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every repetition runs each part on every system before the next part, in an order
    rotated per repetition, so a change in machine load hits all systems alike."""
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        s.name: {p: [] for p in parts} for s in systems
    }
    for rep in range(reps):
        for part in parts:
            for system in rotated(systems, rep):
                before, t0 = common.load_average(), time.perf_counter()
                result = run_part(system, part, plan, rep)
                result |= {
                    "rep": rep,
                    "wall_s": round(time.perf_counter() - t0, 3),
                    "load_before": before,
                    "load_after": common.load_average(),
                }
                raw[system.name][part].append(result)
                log(f"rep {rep + 1}/{reps} {part:<6} {system.name:<26} {_headline(part, result)}")
    return raw


def agreement_runs(systems: Sequence[Any], plan: Plan) -> dict[str, list[dict[str, Any]]]:
    """Untimed: each system's greedy tokens (``plan.new_tokens``, EOS ignored) for every
    agreement prompt, a check that the systems run the same model with close numerics; from
    a system's ``greedy(prompt, n)`` where it has one (llama.cpp: its streamed ``run`` may
    not see every id), else from ``run``."""

    def ids(system: Any, prompt: list[int]) -> list[int]:
        greedy = getattr(system, "greedy", None)
        return greedy(prompt, plan.new_tokens) if greedy else system.run(prompt, plan.new_tokens)[1]

    return {
        system.name: [
            {"prompt": i, "token_ids": ids(system, prompt)}
            for i, prompt in enumerate(plan.agree_prompts)
        ]
        for system in systems
    }


def _headline(part: str, result: dict[str, Any]) -> str:
    if part == "decode":
        return f"{result.get('decode_tok_s', 0):7.1f} tok/s decode"
    if part == "ttft":
        return f"{result['ttft_s'] * 1000:7.0f} ms TTFT"
    return f"{result['output_tok_s']:7.1f} output tok/s ({result['elapsed_s']:.1f} s)"


def many_result(
    requests: list[tuple[float, float | None, float, int]], duration: float, expected: int
) -> dict[str, Any]:
    """Output tokens/s of a many-stream run from per-request (send, first token or None, end,
    tokens) client times; the token count must be the workload's (EOS ignored)."""
    tokens = sum(r[3] for r in requests)
    if tokens != expected:
        raise RuntimeError(f"received {tokens} output tokens, the workload asks for {expected}")
    t0 = min(r[0] for r in requests)
    ttfts = [first - send for send, first, _, _ in requests if first is not None]

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 4)

    return {
        "elapsed_s": round(duration, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / duration, 2) if duration > 0 else None,
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 3) if ttfts else None,
        "ttft_max_s": round(max(ttfts), 3) if ttfts else None,
        # per request: [send, first token, end] seconds after the first send, output tokens
        "requests": [[rel(s), rel(f), rel(e), n] for s, f, e, n in requests],
    }
