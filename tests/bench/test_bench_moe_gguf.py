"""``python -m bench.moe_gguf`` end to end on a tiny model of the same family: a
transformers Qwen3-MoE checkpoint converted and quantized to Q4_K_M by llama.cpp's tools
(skipped without them), served by headrace in both block modes and, when one is built, by
llama-server; every part, the greedy agreement, the JSON and PNG. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from bench import common, moe_gguf
from bench.cpu_compare.llama import find_llama_server
from compute.loaders import load_model


def test_shape_key_names_every_setting() -> None:
    key = moe_gguf.BENCH.key()
    assert key.startswith("qwen3moe-12L-h1024-e64x512-top8-")
    for changed in ({"init": 0.2}, {"seed": 1}, {"heads": 8}):
        assert moe_gguf.Shape(**changed).key() != key
    cfg = moe_gguf.hf_config(moe_gguf.BENCH)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (64, 8, 512)
    assert cfg.hidden_size == 1024 and cfg.num_hidden_layers == 12 and cfg.mlp_only_layers == []


def test_moe_gguf_dry_run(tmp_path, monkeypatch) -> None:
    why = moe_gguf.missing_tools()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    cache = tmp_path / "models"
    path = moe_gguf.main(["--dry-run", "--cache-dir", str(cache)])
    assert path.with_suffix(".png").stat().st_size > 0
    result = json.loads(path.read_text())
    assert {"machine", "commit", "settings", "summary", "goals", "model_file"} <= set(result)
    model = result["model_file"]
    assert model["kind"] == "Q4_K_M" and model["tensor_types"]["Q4_K"] > 0
    (gguf,) = cache.glob("qwen3moe-2L-*.Q4_K_M.gguf")
    assert model["path"] == str(gguf)
    cfg = load_model(str(gguf), progress=False).config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3moe", 8, 2)
    modes = ("headrace[quantized-int8]", "headrace[quantized]")
    for mode in modes:
        assert result["summary"][mode]["decode_tok_s"] > 0
        assert set(result["goals"][mode]) == {"decode_vs_llama", "many_vs_llama_2x"}
    if find_llama_server(None)[0] is None:
        return
    agree = {mode: result["summary"][mode]["greedy_tokens_as_llama_cpp"] for mode in modes}
    new_tokens = result["settings"]["new_tokens"]
    assert all(len(a) == 2 and all(0 <= n <= new_tokens for n in a) for a in agree.values())
    # The same model: the exact mode's first greedy token is llama.cpp's on some prompt.
    assert max(agree["headrace[quantized]"]) > 0
    # The second run finds the file in the cache.
    assert moe_gguf.build(moe_gguf.DRY, cache=cache) == gguf
