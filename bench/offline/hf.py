"""The offline benchmark's baselines: HF transformers ``generate`` with static left-padded
batches (hf-static) and one request at a time (hf-single), on the same model."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from bench import common
from bench.offline.workload import Workload


def left_pad(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every row's last prompt token at the same position for generate."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, device: str) -> None:
    ids, mask = left_pad(prompts, device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **common.hf_generate_kwargs(max_new))
    common.sync(device)
    if out.shape[1] != ids.shape[1] + max_new:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, not {max_new}")


def static_kv_slots(prompts: list[list[int]], lens: list[int]) -> tuple[int, int]:
    """(allocated, used) slot-steps of one static batch, computed from its shapes.

    HF's cache holds batch x (longest prompt + step) slots at every step; a row's slots are
    useful only for its own prompt and the tokens it still needs.
    """
    width, steps = max(len(p) for p in prompts), max(lens)
    allocated = used = 0
    for s in range(1, steps + 1):
        allocated += len(prompts) * (width + s)
        used += sum(len(p) + min(s, n) for p, n in zip(prompts, lens, strict=True) if s <= n)
    return allocated, used


def run_hf_static(model: Any, workload: Workload, batch_size: int, device: str) -> dict:
    load_before = common.load_average()
    start = time.perf_counter()
    generated = allocated = used = 0
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lens = workload.output_lens[first : first + batch_size]
        hf_generate(model, prompts, max(lens), device)
        generated += len(prompts) * max(lens)
        a, u = static_kv_slots(prompts, lens)
        allocated, used = allocated + a, used + u
    elapsed = time.perf_counter() - start
    useful = sum(workload.output_lens)
    return {
        "batch_size": batch_size,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": useful,
        "output_tok_s": round(useful / elapsed, 2),
        "generated_tokens_incl_padding": generated,
        "useful_fraction": round(useful / generated, 4),
        "kv_waste_computed": round((allocated - used) / allocated, 4),
        "load_average": [load_before, common.load_average()],
    }


def run_hf_single(model: Any, workload: Workload, limit: int, device: str) -> dict:
    count = len(workload.prompts) if limit <= 0 else min(limit, len(workload.prompts))
    load_before = common.load_average()
    start = time.perf_counter()
    for prompt, n in zip(workload.prompts[:count], workload.output_lens[:count], strict=True):
        hf_generate(model, [prompt], n, device)
    elapsed = time.perf_counter() - start
    tokens = sum(workload.output_lens[:count])
    return {
        "requests_run": count,
        "extrapolated": count < len(workload.prompts),
        "elapsed_s": round(elapsed, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / elapsed, 2),
        "load_average": [load_before, common.load_average()],
    }


def run_hf(args: argparse.Namespace, workload: Workload, systems: list[str]) -> dict:
    model, load_s = common.load_hf_model(common.default_gguf_path())
    model.to(args.device, getattr(torch, args.dtype))
    hf_generate(model, [[1, 2, 3], [4, 5, 6, 7]], 4, args.device)  # warm-up, untimed
    results: dict[str, Any] = {}
    if "hf-static" in systems:
        print(f"hf-static: batches of {args.static_batch_size} ...", flush=True)
        results["hf-static"] = run_hf_static(model, workload, args.static_batch_size, args.device)
        results["hf-static"]["load_s"] = round(load_s, 2)
    if "hf-single" in systems:
        print("hf-single: one request at a time ...", flush=True)
        results["hf-single"] = run_hf_single(model, workload, args.single_requests, args.device)
        results["hf-single"]["load_s"] = round(load_s, 2)
    del model
    gc.collect()
    return results
