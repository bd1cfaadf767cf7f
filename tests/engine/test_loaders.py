"""Model loaders: the embedded GGUF against transformers, tiny GGUF and HF checkpoints written
here, dummy shapes, and the errors every broken source must raise (ModelLoadError naming it)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from compute.core.config import ModelConfig
from compute.loaders import load_model
from compute.loaders.base import LoadedModel, ModelLoadError, expected_shapes
from compute.loaders.default_model import default_model_path
from compute.loaders.dummy import SHAPES, dummy_config, dummy_weights
from compute.tokenizer.gguf_vocab import bytes_to_unicode
from compute.tokenizer.tokenizer import Tokenizer

TINY = SHAPES["tiny"]
TINY_QWEN = ModelConfig(
    name="tiny-qwen", architecture="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
    num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
    tie_word_embeddings=False, qkv_bias=True, eos_token_ids=(2,),
)  # fmt: skip

# Reverse of the GGUF loader's renaming, written out independently of it.
_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_TOP:
        return _GGUF_TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_BLOCK[rest]}"


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's DecoderModel.permute (with n_head already the kv count)."""
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _quantized(array: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    if array.ndim == 1:
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if array.shape[0] > 256:  # the embedding: exercise F16 too
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    qtype = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(array, qtype), qtype


def _write_gguf(
    path: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    arch: str,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    """A GGUF as llama.cpp's converter writes it: Q/K permuted for llama, Q8_0 matrices.
    ``extra`` adds metadata or tensors of its own before the file is written."""
    writer = gguf.GGUFWriter(path, arch)
    if extra is not None:
        extra(writer)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    )
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _permute(array, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _permute(array, config.num_kv_heads)
        data, qtype = _quantized(array)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _round_trip(weight: torch.Tensor) -> torch.Tensor:
    """What the file holds for `weight` after quantization, in HF layout."""
    data, qtype = _quantized(weight.float().numpy())
    restored = gguf.quants.dequantize(data, qtype).reshape(weight.shape)
    return torch.from_numpy(restored.astype(np.float32))


def _write_hf_dir(
    path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tok: Tokenizer
) -> None:
    """config.json + two safetensors shards with an index + tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    raw = {
        "model_type": config.architecture,
        "architectures": ["Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": [0, 2],
    }
    (path / "config.json").write_text(json.dumps(raw))
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in shards.items():
        save_file({n: weights[n].contiguous() for n in shard_names}, str(path / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tok.hf.save(str(path / "tokenizer.json"))
    tok_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|endoftext|>",
        "chat_template": tok.chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    weights = dummy_weights(TINY, torch.float32, "cpu", seed=7)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, TINY, weights, "llama")
    return path, weights


@pytest.fixture(scope="module")
def small_tokenizer(small_gguf: tuple[Path, dict]) -> Tokenizer:
    return Tokenizer.from_gguf(small_gguf[0])


# --- the embedded default model against transformers ---------------------------------------


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model("default", progress=False)


@pytest.fixture(scope="module")
def reference_state() -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


def test_default_model_config(default_model: LoadedModel) -> None:
    config = default_model.config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size) == (49152, 1536)
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert config.rms_norm_eps == 1e-5 and config.tie_word_embeddings and not config.qkv_bias
    assert config.bos_token_id == 1 and 2 in config.eos_token_ids
    assert default_model.source == str(default_model_path())
    assert default_model.tokenizer is not None and default_model.tokenizer.vocab_size == 49152
    assert set(default_model.weights) == set(expected_shapes(config))
    assert "lm_head.weight" not in default_model.weights


@pytest.mark.slow
def test_default_weights_match_transformers(
    default_model: LoadedModel, reference_state: dict[str, torch.Tensor]
) -> None:
    """Exact equality of Q and K is what shows the un-permutation matches transformers'."""
    assert set(reference_state) - set(default_model.weights) == {"lm_head.weight"}
    for name, weight in default_model.weights.items():
        assert weight.dtype == torch.float32
        assert (weight - reference_state[name]).abs().max().item() <= 1e-6, name


# --- GGUF files written here ---------------------------------------------------------------


def test_gguf_unpermutes_q_and_k(small_gguf: tuple[Path, dict]) -> None:
    path, original = small_gguf
    loaded = load_model(str(path), progress=False)
    assert loaded.config == dataclasses.replace(TINY, name="tiny")
    for name, weight in original.items():
        assert torch.equal(loaded.weights[name], _round_trip(weight)), name


def test_gguf_dtype_and_progress(
    small_gguf: tuple[Path, dict], capsys: pytest.CaptureFixture
) -> None:
    loaded = load_model(str(small_gguf[0]), dtype=torch.bfloat16, progress=True)
    assert all(w.dtype == torch.bfloat16 for w in loaded.weights.values())
    assert "tensor" in capsys.readouterr().err


def test_gguf_qwen2_has_bias_and_no_permutation(tmp_path: Path) -> None:
    weights = dummy_weights(TINY_QWEN, torch.float32, "cpu", seed=3)
    path = tmp_path / "qwen.gguf"
    _write_gguf(path, TINY_QWEN, weights, "qwen2")
    loaded = load_model(str(path), progress=False)
    assert loaded.config.qkv_bias and loaded.config.architecture == "qwen2"
    assert not loaded.config.tie_word_embeddings and loaded.config.num_kv_heads == 1
    for name, weight in weights.items():
        assert torch.equal(loaded.weights[name], _round_trip(weight)), name


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    weights = dummy_weights(TINY, torch.float32, "cpu", seed=0)
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = tmp_path / "missing.gguf"
    _write_gguf(path, TINY, weights, "llama")
    with pytest.raises(ModelLoadError, match=r"missing\.gguf.*model\.layers\.1\.mlp\.up_proj"):
        load_model(str(path), progress=False)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, TINY, dummy_weights(TINY, torch.float32, "cpu", seed=0), "gpt2")
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf.*unsupported architecture 'gpt2'"):
        load_model(str(path), progress=False)


@pytest.mark.parametrize("kind", ["truncated", "random", "empty", "header-only"])
def test_corrupt_gguf(kind: str, small_gguf: tuple[Path, dict], tmp_path: Path) -> None:
    data = default_model_path().read_bytes() if kind == "truncated" else small_gguf[0].read_bytes()
    content = {
        "truncated": data[: len(data) // 2],
        "random": np.random.default_rng(0).bytes(4096),
        "empty": b"",
        "header-only": data[:24],
    }[kind]
    path = tmp_path / f"{kind}.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=str(path)):
        load_model(str(path), progress=False)


def test_unknown_source_and_pickle_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "nope.gguf"))
    pickled = tmp_path / "model.pt"
    pickled.write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match="model.pt.*refused"):
        load_model(str(pickled))


# --- Hugging Face checkpoint directories ---------------------------------------------------


@pytest.mark.parametrize("config", [TINY, TINY_QWEN], ids=["llama", "qwen2"])
def test_hf_dir_round_trip(config: ModelConfig, small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    weights = dummy_weights(config, torch.float32, "cpu", seed=11)
    if config.tie_word_embeddings:  # a tied checkpoint that still stores the copy
        weights_on_disk = {
            **weights,
            "lm_head.weight": weights["model.embed_tokens.weight"].clone(),
        }
    else:
        weights_on_disk = weights
    _write_hf_dir(tmp_path / "ckpt", config, weights_on_disk, small_tokenizer)
    loaded = load_model(str(tmp_path / "ckpt"), dtype=torch.float16, progress=False)
    assert loaded.config.qkv_bias == config.qkv_bias
    assert loaded.config.num_kv_heads == config.num_kv_heads and loaded.config.head_dim == 16
    assert loaded.config.eos_token_ids[:2] == (0, 2) and loaded.config.bos_token_id == 1
    assert set(loaded.weights) == set(weights)
    for name, weight in weights.items():
        assert torch.equal(loaded.weights[name], weight.half()), name
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("t<|im_end|>") == small_tokenizer.encode("t<|im_end|>")


def _tiny_hf_dir(tmp_path: Path, tok: Tokenizer) -> Path:
    path = tmp_path / "ckpt"
    _write_hf_dir(path, TINY, dummy_weights(TINY, torch.float32, "cpu", seed=0), tok)
    return path


def test_hf_dir_refuses_pickle(tmp_path: Path) -> None:
    path = tmp_path / "pickled"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*refused"):
        load_model(str(path), progress=False)


def test_hf_dir_unsupported_architecture(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = _tiny_hf_dir(tmp_path, small_tokenizer)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"config\.json.*unsupported architecture 'gpt2'"):
        load_model(str(path), progress=False)


def test_hf_dir_missing_and_misshapen_tensor(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    weights = dummy_weights(TINY, torch.float32, "cpu", seed=0)
    broken = {k: v for k, v in weights.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    _write_hf_dir(tmp_path / "a", TINY, broken, small_tokenizer)
    with pytest.raises(ModelLoadError, match=r"a: missing tensor.*layers\.0\.self_attn\.k_proj"):
        load_model(str(tmp_path / "a"), progress=False)
    weights["model.norm.weight"] = torch.ones(TINY.hidden_size + 1)
    _write_hf_dir(tmp_path / "b", TINY, weights, small_tokenizer)
    with pytest.raises(ModelLoadError, match=r"b: tensor model\.norm\.weight has shape"):
        load_model(str(tmp_path / "b"), progress=False)


def test_hf_dir_corrupt_shard(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = _tiny_hf_dir(tmp_path, small_tokenizer)
    shard = path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: os.path.getsize(shard) // 2])
    with pytest.raises(ModelLoadError, match=str(shard)):
        load_model(str(path), progress=False)


# --- dummy weights -------------------------------------------------------------------------


def test_dummy_shapes_dtypes_and_seed() -> None:
    model = load_model("dummy:smollm2-135m", dtype=torch.bfloat16, seed=5)
    assert model.tokenizer is None and model.source == "dummy:smollm2-135m"
    assert model.config.tie_word_embeddings and model.config.vocab_size == 49152
    for name, shape in expected_shapes(model.config).items():
        assert (
            tuple(model.weights[name].shape) == shape
            and model.weights[name].dtype == torch.bfloat16
        )
    assert "lm_head.weight" not in model.weights
    assert torch.all(model.weights["model.norm.weight"] == 1)
    first = load_model("dummy:tiny", seed=5).weights
    again = load_model("dummy:tiny", seed=5).weights
    other = load_model("dummy:tiny", seed=6).weights
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert 0.015 < first["model.embed_tokens.weight"].std().item() < 0.025


def test_dummy_configs_without_allocating() -> None:
    llama1b = dummy_config("llama-3.2-1b")
    assert (llama1b.num_layers, llama1b.hidden_size, llama1b.num_kv_heads) == (16, 2048, 8)
    assert llama1b.tie_word_embeddings and llama1b.rope_theta == 500000.0
    llama8b = dummy_config("llama-3-8b")
    assert (llama8b.head_dim, llama8b.intermediate_size, llama8b.vocab_size) == (128, 14336, 128256)
    assert "lm_head.weight" in expected_shapes(llama8b)
    qwen = dummy_config("qwen2.5-0.5b")
    assert qwen.qkv_bias and (qwen.vocab_size, qwen.num_kv_heads, qwen.rope_theta) == (
        151936,
        2,
        1e6,
    )
    assert expected_shapes(qwen)["model.layers.23.self_attn.k_proj.bias"] == (128,)
    qwen_bias = dummy_weights(
        dataclasses.replace(qwen, num_layers=1, vocab_size=8), torch.float16, "cpu", 0
    )
    assert qwen_bias["model.layers.0.self_attn.q_proj.bias"].shape == (896,)
    with pytest.raises(ModelLoadError, match="unknown dummy shape"):
        load_model("dummy:gpt-5")
