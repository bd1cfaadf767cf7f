"""What the benchmark sends: random (seeded, real token ids), fixed, or JSONL workloads.

Random prompts are token ids, not text, so their lengths are exact: the pool of ids comes
from tokenizing a stock paragraph with the served model's Tokenize (real, in-vocabulary
tokens), or, for a model served without a tokenizer, from ``range(vocab_size)`` minus its
EOS ids (GetModelInfo). ``--prefix-len`` puts the same leading ids on every prompt, which
is what prefix caching can reuse.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Tokenized for a pool of realistic token ids; its content does not matter.
POOL_TEXT = (
    "The river turned the mill wheel all through the winter, and the miller kept a ledger "
    "of every sack of grain that came down the valley road. Engineers later measured the "
    "headrace, the channel that feeds the wheel, and found it carried more water than the "
    "wheel could use. Questions about power, weather, prices, recipes, history, music and "
    "mathematics filled the notebooks of the village school for 1,024 years."
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: exactly one of prompt / chat / token_ids is set."""

    max_tokens: int
    prompt: str | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class RandomSpec:
    """Lengths of a random workload: uniform in [len * (1 - ratio), len * (1 + ratio)]."""

    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("--range-ratio must be in [0, 1)")
        if self.prefix_len < 0:
            raise ValueError("--prefix-len must be >= 0")


def token_pool(tokenized: Sequence[int] | None, vocab_size: int, eos: Sequence[int]) -> list[int]:
    """Ids to draw prompts from: the tokenized paragraph, else the vocabulary minus EOS."""
    banned = set(eos)
    if tokenized:
        pool = [t for t in tokenized if t not in banned]
        if pool:
            return pool
    pool = [t for t in range(vocab_size) if t not in banned]
    if not pool:
        raise ValueError("the server reports no usable vocabulary (vocab_size 0)")
    return pool


def _length(rng: random.Random, center: int, ratio: float) -> int:
    low, high = max(1, int(center * (1 - ratio))), max(1, int(center * (1 + ratio)))
    return rng.randint(low, high)


def random_requests(spec: RandomSpec, pool: Sequence[int], n: int, seed: int) -> list[BenchRequest]:
    """``n`` prompts of pool ids, the shared prefix first; the same seed gives the same set."""
    rng = random.Random(seed)
    prefix = tuple(rng.choice(pool) for _ in range(spec.prefix_len))
    out = []
    for _ in range(n):
        tail = tuple(
            rng.choice(pool) for _ in range(_length(rng, spec.input_len, spec.range_ratio))
        )
        out.append(
            BenchRequest(_length(rng, spec.output_len, spec.range_ratio), token_ids=prefix + tail)
        )
    return out


def fixed_requests(prompt: str, output_len: int, n: int) -> list[BenchRequest]:
    """The same text prompt ``n`` times (with --prefix-len 0 the prefix cache still hits)."""
    return [BenchRequest(output_len, prompt=prompt) for _ in range(n)]


def jsonl_requests(path: Path, default_output_len: int, n: int | None) -> list[BenchRequest]:
    """One request per line: {"prompt": str} or {"chat"|"messages": [{"role","content"}]},
    with an optional "output_len" (or "max_tokens"); cycled to ``n`` requests."""
    loaded = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            loaded.append(_parse_line(json.loads(line), default_output_len, f"{path}:{number}"))
    if not loaded:
        raise ValueError(f"{path}: no requests")
    n = len(loaded) if n is None else n
    return [loaded[i % len(loaded)] for i in range(n)]


def _parse_line(obj: dict, default_output_len: int, where: str) -> BenchRequest:
    max_tokens = int(obj.get("output_len", obj.get("max_tokens", default_output_len)))
    if isinstance(obj.get("prompt"), str):
        return BenchRequest(max_tokens, prompt=obj["prompt"])
    messages = obj.get("chat", obj.get("messages"))
    if isinstance(messages, list) and messages:
        chat = tuple((str(m["role"]), str(m["content"])) for m in messages)
        return BenchRequest(max_tokens, chat=chat)
    raise ValueError(f'{where}: needs "prompt" (string) or "chat"/"messages" (list)')
