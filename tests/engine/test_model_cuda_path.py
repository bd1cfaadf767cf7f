"""The whole model forward through the CUDA launchers, on the CPU.

compute/models/decoder.py hands kernels/ops.py real step tensors (the fused qkv output
split, RoPE'd, reshaped) that no kernel-level test builds. Here a small model of
SmolLM2's head layout (head dim 64, GQA 3) runs three engine-like steps (a
prefill of several chunks, a mixed step, a decode step) with ops routed to
kernels.cuda instead of the torch reference:

- with a fake CuPy recording compiles and launches (every step, every layer:
  the cache write then the kernels the step needs, compiled once at warm-up,
  argument checks once per step);
- with the host emulation (tests/support/cuda_host) running the real kernel source, whose
  hidden states must match the torch reference path on the same weights.

Both also run a variant with Gemma 2's attention deltas (alternating sliding/full layers,
a window shorter than the contexts, soft-capped scores), which the kernels take as
launch arguments.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from compute.core.config import ModelConfig
from compute.loaders.dummy import dummy_weights
from compute.models.decoder import DecoderModel
from kernels import ops
from kernels.cuda import attention_plan
from kernels.cuda import launch as cuda
from kernels.metadata import AttentionMetadata
from tests.support.cuda_host.emulator import session_emulator
from tests.support.cuda_host.fake_cupy import FakeCupy

CONFIG = ModelConfig(
    name="smollm2-heads", architecture="llama", vocab_size=300, hidden_size=576,
    intermediate_size=256, num_layers=3, num_heads=9, num_kv_heads=3, head_dim=64,
    max_position_embeddings=512,
)  # fmt: skip
BLOCK_SIZE = 16
DTYPE = torch.float16
# Each step: (sequence, tokens this step); a sequence's context grows by its tokens.
STEPS = [
    [(0, 37), (1, 20)],  # two prefills
    [(0, 1), (1, 5), (2, 3)],  # a decode, a prefill chunk, a new prompt
    [(0, 1), (1, 1), (2, 1)],  # pure decode
]


# Gemma 2's attention deltas on the same shapes: sliding and full layers alternating (a
# window shorter than the steps' contexts, and than a block), attention scores soft-capped.
WINDOWED = replace(
    CONFIG, sliding_window=12, layer_types=("sliding", "full", "sliding"), attn_logit_softcap=1.5
)


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(CONFIG, dummy_weights(CONFIG, DTYPE, "cpu", seed=5))


@pytest.fixture(scope="module")
def windowed_model() -> DecoderModel:
    return DecoderModel(WINDOWED, dummy_weights(WINDOWED, DTYPE, "cpu", seed=5))


def new_caches():
    shape = (24, BLOCK_SIZE, CONFIG.num_kv_heads, CONFIG.head_dim)
    return [
        (torch.full(shape, float("nan"), dtype=DTYPE), torch.full(shape, float("nan"), dtype=DTYPE))
        for _ in range(CONFIG.num_layers)
    ]


def run_steps(model: DecoderModel) -> list[torch.Tensor]:
    """The hidden states of every step, on fresh NaN-filled caches with scattered blocks."""
    rng = random.Random(3)
    free = list(range(24))
    rng.shuffle(free)
    tokens = {s: [rng.randrange(CONFIG.vocab_size) for _ in range(60)] for s in range(3)}
    done, tables, caches, hidden = {0: 0, 1: 0, 2: 0}, {0: [], 1: [], 2: []}, new_caches(), []
    for step in STEPS:
        ids, positions, qlens, clens = [], [], [], []
        for seq, count in step:
            start, end = done[seq], done[seq] + count
            while len(tables[seq]) * BLOCK_SIZE < end:
                tables[seq].append(free.pop())
            ids += tokens[seq][start:end]
            positions += range(start, end)
            qlens.append(count)
            clens.append(end)
            done[seq] = end
        meta = AttentionMetadata.build(
            qlens, clens, [tables[s] for s, _ in step], BLOCK_SIZE, device="cpu"
        )
        hidden.append(model.forward(torch.tensor(ids), torch.tensor(positions), caches, meta))
    return hidden


@pytest.fixture
def through_launchers(monkeypatch):
    """Routes ops' CPU calls to kernels.cuda, past its CUDA-device entry check."""
    monkeypatch.setattr(ops, "reference", cuda)
    monkeypatch.setattr(cuda, "_require_gpu", lambda t, name: None)


def test_forward_through_the_fake_cupy(model, through_launchers, monkeypatch):
    fake = FakeCupy()
    monkeypatch.setattr(cuda, "_kernels", {})
    monkeypatch.setattr(cuda, "_import_cupy", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda index: type("S", (), {"cuda_stream": 5})()
    )
    checks = []
    real_check = attention_plan.check_metadata
    monkeypatch.setattr(
        attention_plan, "check_metadata", lambda *a: checks.append(1) or real_check(*a)
    )
    assert cuda.warm_up(torch.device("cuda", 0), DTYPE, 64, BLOCK_SIZE) == 6
    assert len(fake.compiles) == 3  # one module per .cu
    run_steps(model)
    assert len(fake.compiles) == 3, "nothing compiled after warm-up"
    names = [call[0] for call in fake.calls]
    write = "reshape_and_cache_w16"
    decode, prefill = "paged_attention_decode_f16_d64_b16", "paged_attention_prefill_f16_d64"
    per_step = [[write, prefill], [write, decode, prefill], [write, decode]]
    expected = [name for step in per_step for _ in range(CONFIG.num_layers) for name in step]
    assert names == expected
    assert len(checks) == len(STEPS), "metadata checked once per step, not per layer"


def test_windows_and_softcap_reach_the_kernels(windowed_model, through_launchers, monkeypatch):
    """Each layer's window (none on the full layers) and the soft-cap, as launch arguments."""
    launches = []
    monkeypatch.setattr(cuda, "_launch", lambda *a: launches.append(a))
    run_steps(windowed_model)
    attention = [a for a in launches if a[1] != "reshape_and_cache.cu" and "reduce" not in a[2]]
    windows = []
    for _, _, name, _, _, args in attention:
        first = 10 if "decode" in name else 7  # the scores' arguments follow the pointers
        assert args[first + 1] == pytest.approx(1.5 * math.log2(math.e))
        windows.append(int(args[first + 2]))
    # Layer by layer (sliding, full, sliding), each layer's kernels: the prefill; the decode
    # then the prefill; the decode.
    per_step = [[12, 0, 12], [12, 12, 0, 0, 12, 12], [12, 0, 12]]
    assert windows == [w for step in per_step for w in step]


@pytest.mark.parametrize("variant", cuda.DECODE_VARIANTS)
@pytest.mark.parametrize("windowed", [False, True], ids=["plain", "gemma2-attention"])
def test_forward_through_the_emulated_kernels(
    model, windowed_model, monkeypatch, tmp_path_factory, windowed, variant
):
    emulator = session_emulator(tmp_path_factory)
    if emulator is None:
        pytest.skip("the CPU emulation needs g++ and the CUDA headers (cuda_fp16.h)")
    if windowed:
        plain, model = run_steps(model), windowed_model
    expected = run_steps(model)  # the torch reference path
    if windowed:  # the window and the cap change the answer: the comparison is not vacuous
        changes = [
            (p.float() - e.float()).abs().max().item() for p, e in zip(plain, expected, strict=True)
        ]
        assert max(changes) > 0.1
    launched = []
    monkeypatch.setattr(cuda, "_launch", lambda *a: launched.append(a[2]) or emulator.launch(*a))
    monkeypatch.setattr(cuda, "_require_gpu", lambda t, name: None)
    monkeypatch.setattr(ops, "reference", cuda)  # CPU tensors now go to the launchers
    monkeypatch.setattr(cuda, "decode_variant", variant)
    got = run_steps(model)
    assert set(launched) == {
        "reshape_and_cache_w16",
        cuda.decode_kernel_name("f16", 64, 16, 3),
        "paged_attention_prefill_f16_d64",
    }
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert not g.isnan().any(), f"step {step}: NaN"
        rel = ((g.float() - e.float()).norm() / e.float().norm()).item()
        assert rel < 5e-3, f"step {step}: relative error {rel:.2e} against the torch path"
