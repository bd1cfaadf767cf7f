"""Mixture-of-experts families (Qwen3-MoE, Mixtral): tiny random-weight models built by
transformers from a config (8 experts, top-2, several layers, weights initialised large
so logits are peaked), saved as safetensors with the SmolLM2 tokenizer, served by the
Engine on the torch path and the CPU kernels, batched, chunked and once over gRPC;
greedy tokens must equal transformers' on the same weights. Settings headrace does not
honour (shared experts, other routers) are refused at load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compute.loaders import ModelLoadError, load_model
from compute.tokenizer.tokenizer import Tokenizer
from tests.engine.test_model_families import (
    GREEDY,
    KERNELS,
    NEW_TOKENS,
    PROMPTS,
    SMALL,
    _smollm2_tokenizer,
    _with_config,
    engine_for,
    hf_greedy,
)

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

MOE_FAMILIES = {
    # Layer 1 keeps a dense MLP (mlp_only_layers); renormalised top-2 of 8.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    # Qwen3-MoE's default: top-k probabilities as they are, not renormalised.
    "qwen3-moe-unnormalised": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_hidden_layers": 2,
            "num_experts": 10,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
        },
    ),
    # Mixtral: always renormalises its top-2; every layer sparse.
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                  "num_hidden_layers": 3}),
}  # fmt: skip


def build_moe_model(directory: Path, family: str, seed: int = 27):
    """A tiny random-weight MoE `family` model saved to `directory` (safetensors +
    tokenizer); returns the transformers model (fp32, eval)."""
    config_class, extra = MOE_FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    _smollm2_tokenizer(directory)
    return model


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe_family(request, tmp_path_factory: pytest.TempPathFactory):
    """(family, checkpoint directory, prompt ids, transformers' greedy tokens)."""
    path = tmp_path_factory.mktemp(request.param)
    model = build_moe_model(path, request.param)
    tok = Tokenizer.from_hf_dir(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    return request.param, path, prompts, hf_greedy(model, prompts)


@pytest.mark.parametrize("kernels", KERNELS)
def test_moe_greedy_equals_transformers(moe_family, kernels: str) -> None:
    _, path, prompts, expected = moe_family
    engine = engine_for(path, kernels)
    one_at_a_time = [engine.generate([ids], GREEDY)[0].token_ids for ids in prompts]
    assert one_at_a_time == expected
    batched = [out.token_ids for out in engine.generate(prompts, GREEDY)]
    assert batched == expected


def test_moe_chunked_prefill_equals_transformers(moe_family) -> None:
    _, path, prompts, expected = moe_family
    engine = engine_for(path, "native", chunk=16)
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected


def test_moe_loaded_config(moe_family) -> None:
    name, path, _, _ = moe_family
    cfg = load_model(str(path), progress=False).config
    if name == "qwen3-moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 64)
        assert cfg.norm_topk_prob and cfg.qk_norm and cfg.dense_layers == (1,)
    if name == "qwen3-moe-unnormalised":
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (10, 3)
        assert not cfg.norm_topk_prob and cfg.dense_layers == ()
    if name == "mixtral":
        assert cfg.architecture == "mixtral" and cfg.norm_topk_prob
        assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.dense_layers) == (8, 128, ())


def test_qwen3_moe_through_the_grpc_server_equals_transformers(moe_family) -> None:
    name, path, prompts, expected = moe_family
    if name != "qwen3-moe":
        pytest.skip("once, on the Qwen3-MoE model")
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
    with running_server(engine_for(path, "native")) as running:
        batch = pb.GenerateBatchRequest(requests=requests)
        for response in running.stub().GenerateBatch(batch, timeout=120):
            if response.HasField("chunk"):
                got[response.index].extend(response.chunk.token_ids)
    assert [got[i] for i in range(len(requests))] == expected


def test_decoder_sparse_step_makes_dense_layers(tmp_path: Path) -> None:
    config = transformers.Qwen3MoeConfig(
        **{**SMALL, **MOE_FAMILIES["qwen3-moe"][1], "num_hidden_layers": 4,
           "decoder_sparse_step": 2, "mlp_only_layers": []}
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    _smollm2_tokenizer(tmp_path)
    # transformers: layers 1 and 3 ((i + 1) % 2 == 0) sparse, 0 and 2 dense.
    assert load_model(str(tmp_path), progress=False).config.dense_layers == (0, 2)
    prompts = [Tokenizer.from_hf_dir(tmp_path).encode(PROMPTS[0])]
    expected = hf_greedy(model, prompts)
    assert [o.token_ids for o in engine_for(tmp_path, "native").generate(prompts, GREEDY)] == (
        expected
    )


def test_stacked_expert_tensors_load_as_per_expert(moe_family, tmp_path: Path) -> None:
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) in a checkpoint loads as the same per-expert weights."""
    name, path, _, _ = moe_family
    if name != "qwen3-moe":
        pytest.skip("once")
    tensors = load_file(str(path / "model.safetensors"))
    config = load_model(str(path), progress=False).config
    stacked = {}
    for key, value in tensors.items():
        if ".mlp.experts." not in key:
            stacked[key] = value
    for i in range(config.num_layers):
        if not config.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        e = range(config.num_experts)
        stacked[p + "gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}{j}.gate_proj.weight"], tensors[f"{p}{j}.up_proj.weight"]])
             for j in e]
        )  # fmt: skip
        stacked[p + "down_proj"] = torch.stack([tensors[f"{p}{j}.down_proj.weight"] for j in e])
    out = tmp_path / "stacked"
    out.mkdir()
    for file in path.iterdir():
        if file.suffix != ".safetensors":
            (out / file.name).symlink_to(file)
    save_file(stacked, str(out / "model.safetensors"))
    a = load_model(str(path), progress=False).weights
    b = load_model(str(out), progress=False).weights
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- what headrace does not honour is refused, never served wrong ------------------------


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plain-qwen3-moe")
    build_moe_model(path, "qwen3-moe")
    return path


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size: 64"),
        ({"scoring_func": "sigmoid"}, r"scoring_func: 'sigmoid'"),
        ({"n_group": 4}, r"n_group: 4"),
        ({"model_type": "qwen2_moe", "architectures": None},
         r"unsupported architecture 'qwen2_moe'"),
    ],
)  # fmt: skip
def test_unhonoured_moe_settings_are_refused(moe_dir: Path, tmp_path: Path, changes, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(_with_config(moe_dir, tmp_path / "changed", **changes)), progress=False)
