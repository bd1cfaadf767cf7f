"""Single-sequence decode speed: headrace Engine vs HF transformers ``generate``, side by side.

Both systems load the embedded SmolLM2-135M GGUF in fp32 with the same thread count, get the
same prompt token ids, decode greedily for exactly ``--new-tokens`` tokens (EOS ignored) and
are timed per token: time to first token (prefill + first sample) is reported apart from
decode tokens/s = (new_tokens - 1) / (last token time - first token time). Repetitions of the
two systems alternate so that a change in machine load hits both alike; medians are reported.
Writes ``bench/results/decode-<stamp>.json`` and a PNG. Run: ``make bench-decode``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from matplotlib.ticker import MaxNLocator

from bench import common

DEFAULT_PROMPT = (
    "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message "
    "in a bottle.<|im_end|>\n<|im_start|>assistant\n"
)

# One timed run: (prompt ids, new tokens) -> (per-token timestamps, generated ids, start time).
Runner = Callable[[list[int], int], tuple[list[float], list[int], float]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens to decode per run")
    p.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help="prompt text, tokenized once by headrace's tokenizer and given as ids to both",
    )
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per system")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per system first")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both systems)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="weights and KV cache dtype (both systems); the CUDA kernels take float16/bfloat16",
    )
    p.add_argument("--systems", default="headrace,hf", help="comma list of systems: headrace, hf")
    p.add_argument("--name", default="decode", help="result file prefix in bench/results/")
    return p.parse_args(argv)


def load_headrace(args: argparse.Namespace) -> tuple[Any, float]:
    from compute.core.config import DeviceConfig, EngineConfig
    from compute.engine import Engine

    config = EngineConfig(
        device=DeviceConfig(device=args.device, dtype=args.dtype, num_threads=args.threads)
    )
    start = time.perf_counter()
    engine = Engine(config)
    return engine, time.perf_counter() - start


def headrace_runner(engine: Any, device: str) -> Runner:
    """Step-wise: one add_request, then step() until done, stamping each token as it arrives."""
    from compute.core.sampling_params import SamplingParams

    counter = iter(range(10**9))

    def run(prompt: list[int], new_tokens: int) -> tuple[list[float], list[int], float]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        stamps: list[float] = []
        ids: list[int] = []
        start = time.perf_counter()
        engine.add_request(f"decode-{next(counter)}", prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                common.sync(device)
                now = time.perf_counter()
                stamps.extend(now for _ in out.new_token_ids)
                ids.extend(out.new_token_ids)
        return stamps, ids, start

    return run


class _Stamps:
    """HF streamer that records when each generated token reaches it (the first put is the
    prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        now = time.perf_counter()
        self.stamps.extend(now for _ in range(value.numel()))

    def end(self) -> None:
        pass


def hf_runner(model: Any, device: str) -> Runner:
    def run(prompt: list[int], new_tokens: int) -> tuple[list[float], list[int], float]:
        ids = torch.tensor([prompt], device=device)
        streamer = _Stamps()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                streamer=streamer,
                **common.hf_generate_kwargs(new_tokens),
            )
        common.sync(device)
        return streamer.stamps, out[0, len(prompt) :].tolist(), start

    return run


def timed_run(runner: Runner, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One run's figures; decode excludes the first token (prefill dominates it)."""
    stamps, ids, start = runner(prompt, new_tokens)
    if len(stamps) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} token timestamps, got {len(stamps)}")
    decode_s = stamps[-1] - stamps[0]
    return {
        "ttft_s": stamps[0] - start,
        "decode_s": decode_s,
        "decode_tok_s": (new_tokens - 1) / decode_s if decode_s > 0 else None,
        "total_s": stamps[-1] - start,
        "token_ids": ids,
    }


def summarize(runs: list[dict[str, Any]], load_s: float) -> dict[str, Any]:
    rates = [r["decode_tok_s"] for r in runs]
    return {
        "load_s": round(load_s, 3),
        "median_decode_tok_s": round(statistics.median(rates), 2),
        "min_decode_tok_s": round(min(rates), 2),
        "max_decode_tok_s": round(max(rates), 2),
        "median_ttft_s": round(statistics.median(r["ttft_s"] for r in runs), 4),
        "runs": [
            {k: round(v, 4) for k, v in r.items() if k != "token_ids" and v is not None}
            for r in runs
        ],
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def load_systems(args: argparse.Namespace, systems: list[str]) -> tuple[dict, dict, Any]:
    """Load every requested system; returns (runners, load seconds, headrace engine)."""
    runners: dict[str, Runner] = {}
    load_s: dict[str, float] = {}
    engine = None
    if "headrace" in systems:
        engine, load_s["headrace"] = load_headrace(args)
        runners["headrace"] = headrace_runner(engine, args.device)
    if "hf" in systems:
        model, load_s["hf"] = common.load_hf_model(common.default_gguf_path())
        runners["hf"] = hf_runner(model.to(args.device, getattr(torch, args.dtype)), args.device)
    return runners, load_s, engine


def prompt_ids(args: argparse.Namespace, engine: Any) -> list[int]:
    """Tokenize with headrace's tokenizer when loaded (else HF's), so both see identical ids."""
    if engine is not None:
        return engine.tokenizer.encode(args.prompt)
    from transformers import AutoTokenizer

    gguf = common.default_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).encode(args.prompt)


def measure(args: argparse.Namespace, runners: dict[str, Runner], prompt: list[int]) -> dict:
    """Warm up, then alternate the systems rep by rep."""
    for runner in runners.values():
        for _ in range(args.warmup):
            runner(prompt, min(8, args.new_tokens))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for rep in range(args.reps):
        for name, runner in runners.items():
            runs[name].append(timed_run(runner, prompt, args.new_tokens))
            print(f"rep {rep + 1}/{args.reps} {name}: {runs[name][-1]['decode_tok_s']:.1f} tok/s")
    return runs


def report(results: dict[str, Any]) -> None:
    header = ("system", "decode tok/s (median)", "min..max", "TTFT s", "load s")
    print("\n{:<10} {:>22} {:>16} {:>8} {:>8}".format(*header))
    for name, r in results["systems"].items():
        spread = f"{r['min_decode_tok_s']:.1f}..{r['max_decode_tok_s']:.1f}"
        print(
            f"{name:<10} {r['median_decode_tok_s']:>22.1f} {spread:>16} "
            f"{r['median_ttft_s']:>8.3f} {r['load_s']:>8.1f}"
        )
    if "headrace_over_hf" in results:
        print(f"headrace / HF decode speed: {results['headrace_over_hf']:.2f}x")
        print(f"greedy tokens identical for the first {results['greedy_agreement_tokens']} tokens")


def plot(results: dict[str, Any], stamp: str, name: str) -> None:
    fig, (ax_bar, ax_runs) = common.new_figure(2)
    systems = results["systems"]
    common.bar_panel(
        ax_bar,
        list(systems),
        [s["median_decode_tok_s"] for s in systems.values()],
        "decode tokens/s (median)",
        f"single-sequence decode, {results['settings']['new_tokens']} tokens",
    )
    for label, s in systems.items():
        rates = [r["decode_tok_s"] for r in s["runs"]]
        ax_runs.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    ax_runs.set_xlabel("repetition")
    ax_runs.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_runs.set_ylabel("decode tokens/s")
    ax_runs.set_title("every repetition (spread = noise)", fontsize=10)
    ax_runs.set_ylim(bottom=0)
    ax_runs.legend()
    title = f"load average (1/5/15 min) at start: {results['load_average_start']}"
    common.save_figure(fig, name, stamp, title=title)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    runners, load_s, engine = load_systems(args, systems)
    prompt = prompt_ids(args, engine)
    load_start = common.load_average()
    runs = measure(args, runners, prompt)
    results: dict[str, Any] = {
        "settings": {**vars(args), "prompt_tokens": len(prompt)},
        "load_average_start": load_start,
        "load_average_end": common.load_average(),
        "systems": {name: summarize(runs[name], load_s[name]) for name in runners},
    }
    if {"headrace", "hf"} <= set(runners):
        hr, hf = results["systems"]["headrace"], results["systems"]["hf"]
        ratio = hr["median_decode_tok_s"] / hf["median_decode_tok_s"]
        results["headrace_over_hf"] = round(ratio, 3)
        results["greedy_agreement_tokens"] = common_prefix(
            runs["headrace"][0]["token_ids"], runs["hf"][0]["token_ids"]
        )
    report(results)
    common.publish(args.name, results, lambda stamp: plot(results, stamp, args.name))


if __name__ == "__main__":
    main()
