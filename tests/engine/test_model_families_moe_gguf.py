"""The mixture-of-experts families from GGUF: tiny transformers checkpoints converted by
llama.cpp's convert_hf_to_gguf.py (`make llama-cpp-convert`) and quantized by its
llama-quantize (`make llama-quantize`; each skipped without its tool), served by the
Engine; greedy tokens must equal transformers' on the same weights.

- Mixtral converts to architecture `llama` with expert tensors (ffn_gate_inp and the
  stacked ffn_{gate,up,down}_exps, llama.expert_count / expert_used_count); Qwen3-MoE to
  `qwen3moe` (llama.cpp's converter has no dense layers in it: every layer sparse).
- f32 files: the checkpoint's weights bit for bit, so transformers on the original model.
- q8_0, and llama-quantize'd Q4_K_M and Q4_0 files, --weights quantized (the experts in
  their blocks on the CPU kernels, fp32 math): transformers with the file's dequantized
  weights loaded in; the same request alone, batched and chunked gives the same tokens.
- A dense-architecture file carrying expert tensors without the expert metadata is refused.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bench import requantize
from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.engine import Engine
from compute.loaders import ModelLoadError, load_model
from compute.tokenizer.tokenizer import Tokenizer
from tests.engine.test_model_families import GREEDY, PROMPTS, hf_greedy
from tests.engine.test_model_families_gguf import CONVERTER_DIR, convert
from tests.engine.test_model_families_moe import MOE_FAMILIES, build_moe_model

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

# (MOE_FAMILIES entry, config changes): every layer sparse (the converter's qwen3moe has no
# dense layers), renormalised top-k (llama.cpp's qwen3moe always renormalises).
GGUF_FAMILIES = {
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3-moe", {"mlp_only_layers": []}),
}
# Wide enough for K-quant super-blocks (256): llama-quantize keeps the experts in Q4_K /
# Q6_K / Q4_0 blocks rather than falling back to Q5_0 / Q8_0 for narrow rows.
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2}  # fmt: skip


def engine_for(path: Path, weights: str, kernels: str = "native", chunk: int = 1024) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk),
            device=DeviceConfig(device="cpu", cpu_kernels=kernels, weights=weights),
        )
    )


def _build(directory: Path, family: str, **changes):
    base, extra = GGUF_FAMILIES[family]
    saved = MOE_FAMILIES[base]
    MOE_FAMILIES[f"{base}+gguf"] = (saved[0], {**saved[1], **extra, **changes})
    try:
        return build_moe_model(directory, f"{base}+gguf")
    finally:
        del MOE_FAMILIES[f"{base}+gguf"]


def load_file_weights(model, path: Path) -> None:
    """The GGUF file's weights, dequantized by headrace's loader, into the transformers
    model (whose experts are stacked: experts.gate_up_proj [E, 2I, H], down_proj)."""
    weights = load_model(str(path), progress=False).weights
    state = {}
    for key, value in model.state_dict().items():
        prefix = key.rpartition("experts.")[0] + "experts."
        if key.endswith("experts.gate_up_proj"):
            value = torch.stack(
                [
                    torch.cat([weights[f"{prefix}{e}.gate_proj.weight"],
                               weights[f"{prefix}{e}.up_proj.weight"]])
                    for e in range(value.shape[0])
                ]
            )  # fmt: skip
        elif key.endswith("experts.down_proj"):
            value = torch.stack(
                [weights[f"{prefix}{e}.down_proj.weight"] for e in range(value.shape[0])]
            )
        elif key in weights:
            value = weights[key]
        elif key == "lm_head.weight":
            value = weights.get(key, weights["model.embed_tokens.weight"])
        state[key] = value
    model.load_state_dict(state)


def llama_quantize(source: Path, out: Path, kind: str) -> Path:
    tool = requantize.quantize_tool()
    if tool is None:
        pytest.skip("llama-quantize is not built: run `make llama-quantize`")
    done = subprocess.run(
        [str(tool), str(source), str(out), kind], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=list(GGUF_FAMILIES))
def converted(request, tmp_path_factory: pytest.TempPathFactory):
    """(family, hf model, f32 GGUF, q8_0 GGUF, prompt ids)."""
    if not (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER_DIR}: run make llama-cpp-convert")
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model = _build(root / "hf", request.param)
    f32 = convert(root / "hf", root / "model-f32.gguf", "f32")
    q8 = convert(root / "hf", root / "model-q8_0.gguf", "q8_0")
    tok = Tokenizer.from_hf_dir(root / "hf")
    return request.param, model, f32, q8, [tok.encode(p) for p in PROMPTS]


def test_f32_moe_gguf_greedy_equals_transformers(converted) -> None:
    name, model, f32, _, prompts = converted
    loaded = load_model(str(f32), progress=False)
    cfg = loaded.config
    assert cfg.architecture == ("llama" if name == "mixtral" else "qwen3moe")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.dense_layers) == (8, 2, ())
    assert cfg.norm_topk_prob
    expected = hf_greedy(model, prompts)
    for kernels in ("torch", "native"):
        engine = engine_for(f32, "dense", kernels)
        assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected, kernels


def _quantized_parity(model, path: Path, prompts: list[list[int]]) -> Engine:
    load_file_weights(model, path)
    expected = hf_greedy(model, prompts)
    engine = engine_for(path, "quantized")
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected
    alone = [engine.generate([ids], GREEDY)[0].token_ids for ids in prompts]
    assert alone == expected
    chunked = engine_for(path, "quantized", chunk=16)
    assert [out.token_ids for out in chunked.generate(prompts, GREEDY)] == expected
    return engine


def test_q8_0_moe_gguf_quantized_greedy_equals_transformers(converted) -> None:
    _, model, _, q8, prompts = converted
    engine = _quantized_parity(model, q8, prompts)
    moe = engine.runner.model.layers[0].moe
    assert moe is not None and moe.experts[0].gate_up.quantized.format.name == "q8_0"
    assert moe.table is not None  # every expert of a step in one kernel call
    # int8 activations (approximate, so not compared with transformers): still the same
    # tokens alone as batched.
    int8 = engine_for(q8, "quantized-int8")
    batched = [out.token_ids for out in int8.generate(prompts, GREEDY)]
    assert [int8.generate([ids], GREEDY)[0].token_ids for ids in prompts] == batched


@pytest.fixture(scope="module", params=list(GGUF_FAMILIES))
def wide_f32(request, tmp_path_factory: pytest.TempPathFactory):
    """(hf model, f32 GGUF of a model wide enough for K-quants, prompt ids)."""
    if not (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER_DIR}: run make llama-cpp-convert")
    root = tmp_path_factory.mktemp(f"wide-{request.param}")
    changes = dict(WIDE)
    if request.param == "mixtral":
        changes["intermediate_size"] = changes.pop("moe_intermediate_size")
    model = _build(root / "hf", request.param, **changes)
    f32 = convert(root / "hf", root / "model-f32.gguf", "f32")
    tok = Tokenizer.from_hf_dir(root / "hf")
    return model, f32, [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q4_0"])
def test_llama_quantized_moe_greedy_equals_transformers(wide_f32, tmp_path, kind) -> None:
    model, f32, prompts = wide_f32
    path = llama_quantize(f32, tmp_path / f"model-{kind}.gguf", kind)
    engine = _quantized_parity(model, path, prompts)
    formats = {
        p.quantized.format.name
        for layer in engine.runner.model.layers
        for expert in layer.moe.experts
        for p in (expert.gate_up, expert.down)
        if p.quantized is not None
    }
    every = all(
        p.quantized is not None
        for layer in engine.runner.model.layers
        for expert in layer.moe.experts
        for p in (expert.gate_up, expert.down)
    )
    assert every, "every expert computed from its blocks"
    assert formats & ({"q4_k", "q6_k"} if kind == "Q4_K_M" else {"q4_0"}), formats


def _copy_gguf(src: Path, dst: Path, drop: tuple[str, ...], add: dict | None = None) -> Path:
    """`src` rewritten without the metadata keys `drop` (with the uint32 keys `add`)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in (add or {}).items():
        writer.add_uint32(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_dense_architecture_with_expert_tensors_is_refused(converted, tmp_path: Path) -> None:
    name, _, f32, _, _ = converted
    if name != "mixtral":
        pytest.skip("once, on the llama-architecture file")
    bare = _copy_gguf(f32, tmp_path / "no-experts.gguf", ("llama.expert_count",))
    with pytest.raises(ModelLoadError, match=r"expert tensors .*without llama\.expert_count"):
        load_model(str(bare), progress=False)
    # The copy itself is faithful: with the metadata it loads and serves as MoE.
    same = _copy_gguf(f32, tmp_path / "copy.gguf", ())
    assert load_model(str(same), progress=False).config.num_experts == 8
