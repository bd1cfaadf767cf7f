"""The model families of test_model_families.py from GGUF: the tiny transformers checkpoints
converted by llama.cpp's own convert_hf_to_gguf.py (`make llama-cpp-convert`; skipped
without it), served by the Engine; greedy tokens must equal transformers' on the same weights.

- f32 files: the weights are the checkpoint's, bit for bit, so the tokens must equal
  transformers' on the original model (RoPE from the file's metadata and rope_freqs tensor).
- q8_0 files, --weights quantized (the blocks on the CPU kernels, fp32 math): the reference
  is transformers with the file's dequantized weights loaded in.

Gemma 2's and Phi-3's converters read a SentencePiece `tokenizer.model`: those checkpoints
get one trained here (BPE with byte fallback, as those families use), beside the tokenizer
transformers builds from it (GemmaTokenizer, LlamaTokenizer for Phi-3); headrace's tokenizer
read back from the file must give transformers' ids.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from compute.engine import Engine
from compute.loaders import ModelLoadError, load_model
from compute.tokenizer.tokenizer import Tokenizer
from tests.engine.test_gemma3_270m import CHAT, CHAT_TEMPLATE
from tests.engine.test_gguf_sentencepiece import TEXTS
from tests.engine.test_model_families import (
    GREEDY,
    PROMPTS,
    WINDOW,
    build_hf_model,
    grpc_greedy,
    hf_greedy,
)

pytestmark = pytest.mark.slow

LLAMA_CPP_PY = "0.3.36"  # the Makefile's LLAMA_CPP_PY
CONVERTER_DIR = (
    Path(os.environ.get("HEADRACE_LLAMA_CPP_DIR", Path.home() / ".cache/headrace/llama-cpp"))
    / f"llama_cpp_python-{LLAMA_CPP_PY}/vendor/llama.cpp"
)
# Families whose converted file headrace serves (Mistral's converts to the llama architecture
# without its sliding window, so that file is not the same model: see test_mistral_...).
GGUF_FAMILIES = ("llama3", "llama-linear", "qwen3", "gemma3", "gemma2", "phi3")
# llama.cpp scales Gemma's attention by head_dim ** -0.5 whatever query_pre_attn_scalar says
# (but on the 27B models), and the converter writes no layer types (llama.cpp's Gemma 3
# pattern: five sliding layers, then a full one; Gemma 2's alternate, as transformers'
# default), so the checkpoints converted here have both as llama.cpp assumes.
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
OVERRIDES = {
    "gemma3": {"query_pre_attn_scalar": 32, "num_hidden_layers": 6, "layer_types": GEMMA3_LAYERS},
    "gemma2": {"query_pre_attn_scalar": 32},
    # Phi-3 mini's config has a window (2047), applied by transformers (llama.cpp reads it
    # but turns Phi-3's window off): here one the prompts pass.
    "phi3": {"sliding_window": WINDOW},
}
# Families whose converter needs a SentencePiece tokenizer.model: (transformers' tokenizer
# class, the trainer's settings as that family's tokenizer has them, tokens added after it).
SENTENCEPIECE = {
    # Gemma: <pad> <eos> <bos> <unk>, no dummy prefix, turn markers in the vocabulary.
    "gemma2": ("GemmaTokenizer", {
        "add_dummy_prefix": False, "pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3,
        "bos_piece": "<bos>", "eos_piece": "<eos>", "control_symbols": ["<mask>"],
        "user_defined_symbols": ["<start_of_turn>", "<end_of_turn>"]}, []),
    # Phi-3: Llama 2's <unk> <s> </s> and dummy prefix; its chat tokens added after them.
    "phi3": ("LlamaTokenizer", {"add_dummy_prefix": True, "unk_id": 0, "bos_id": 1,
                                "eos_id": 2, "pad_id": -1},
             ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"]),
}  # fmt: skip
# Phi-3 mini's chat template.
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
SPM_VOCAB = 2000


def _corpus() -> list[str]:
    """~6000 words of English and code to train on: the stdlib's own text (the Python
    reference's topics), and the prompts, so their words are in the vocabulary."""
    from pydoc_data.topics import topics

    lines: list[str] = list(PROMPTS)
    for key in sorted(topics)[:12]:
        lines += [line for line in topics[key].splitlines() if line.strip()]
    return lines


def sentencepiece_tokenizer(directory: Path, family: str) -> dict[str, int]:
    """Trains `family`'s SentencePiece tokenizer.model into `directory`, saves the
    transformers tokenizer built from it beside; returns the model config's token fields."""
    import sentencepiece
    import transformers

    class_name, settings, added = SENTENCEPIECE[family]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=SPM_VOCAB,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
        **settings,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    tok = getattr(transformers, class_name).from_pretrained(str(directory), add_bos_token=True)
    if added:
        tok.add_tokens([transformers.AddedToken(t, special=True) for t in added], True)
        tok.eos_token = added[0]
    tok.chat_template = PHI3_TEMPLATE if family == "phi3" else CHAT_TEMPLATE
    tok.save_pretrained(str(directory))
    assert (directory / "tokenizer.model").is_file()
    # transformers 5 lists the added tokens in tokenizer.json only; the Hub's checkpoints
    # (saved by transformers 4) list them in tokenizer_config.json too, where the Gemma
    # converter looks: without them the turn markers would be written as plain pieces.
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("vocab_file", None)  # where it was trained, not where it is
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in tok.added_tokens_decoder.items()
    }  # fmt: skip
    config_file.write_text(json.dumps(config, indent=2))
    return {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id or 0,
    }


def convert(hf_dir: Path, out: Path, outtype: str) -> Path:
    script = CONVERTER_DIR / "convert_hf_to_gguf.py"
    if not script.is_file():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER_DIR}: run make llama-cpp-convert")
    env = {**os.environ, "PYTHONPATH": str(CONVERTER_DIR / "gguf-py")}
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def engine_for(path: Path, weights: str, kernels: str = "native", chunk: int = 1024) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk),
            device=DeviceConfig(device="cpu", cpu_kernels=kernels, weights=weights),
        )
    )


@pytest.fixture(scope="module", params=GGUF_FAMILIES)
def converted(request, tmp_path_factory: pytest.TempPathFactory):
    """(family, hf model, f32 GGUF, q8_0 GGUF, prompt ids)."""
    if not (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not in {CONVERTER_DIR}: run make llama-cpp-convert")
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    overrides = OVERRIDES.get(request.param, {})
    if request.param in SENTENCEPIECE:
        tokens = sentencepiece_tokenizer(root / "hf", request.param)
        model = build_hf_model(root / "hf", request.param, tokenizer=False, **overrides, **tokens)
    else:
        model = build_hf_model(root / "hf", request.param, **overrides)
    f32 = convert(root / "hf", root / "model-f32.gguf", "f32")
    q8 = convert(root / "hf", root / "model-q8_0.gguf", "q8_0")
    tok = Tokenizer.from_hf_dir(root / "hf")
    return request.param, model, f32, q8, [tok.encode(p) for p in PROMPTS]


def on_file_weights(name: str, model, path: Path):
    """A copy of transformers' `model` with the GGUF file's weights, dequantized by
    headrace's loader, loaded in (Phi-3's q|k|v and gate|up fused again)."""
    dense = load_model(str(path), progress=False).weights
    if name in ("gemma2", "gemma3"):  # the converter folded Gemma's (1 + w) into its norms
        dense = {k: v - 1 if k.endswith("norm.weight") else v for k, v in dense.items()}
    if name == "phi3":
        for key in [k for k in dense if k.endswith("self_attn.q_proj.weight")]:
            prefix = key.removesuffix("q_proj.weight")
            parts = [dense.pop(f"{prefix}{p}_proj.weight") for p in "qkv"]
            dense[f"{prefix}qkv_proj.weight"] = torch.cat(parts)
        for key in [k for k in dense if k.endswith("mlp.gate_proj.weight")]:
            prefix = key.removesuffix("gate_proj.weight")
            parts = [dense.pop(f"{prefix}{p}_proj.weight") for p in ("gate", "up")]
            dense[f"{prefix}gate_up_proj.weight"] = torch.cat(parts)
    model = copy.deepcopy(model)
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    torch.testing.assert_close(
        dense["model.embed_tokens.weight"], model.get_input_embeddings().weight
    )
    return model


def test_f32_gguf_greedy_equals_transformers(converted) -> None:
    name, model, f32, _, prompts = converted
    loaded = load_model(str(f32), progress=False)
    cfg = loaded.config
    if name == "llama3":
        assert cfg.rope_freq_factors is not None  # the converter's rope_freqs
    if name == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 32
    if name == "gemma3":
        assert cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.qk_norm
        assert cfg.rope_local_theta == 1e4 and cfg.rope_theta == 1e6
        assert cfg.layer_types == ("sliding",) * 5 + ("full",)
    if name == "gemma2":  # soft-caps, window and layer pattern from the file's metadata
        assert cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and not cfg.qk_norm
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (20.0, 15.0)
        assert cfg.sliding_window == WINDOW and cfg.layer_types == ("sliding", "full", "sliding")
        assert cfg.attn_scale == 32**-0.5 and cfg.head_dim == 32
    if name == "phi3":  # fused attn_qkv / ffn_up split at load; the window on every layer
        assert cfg.architecture == "phi3" and cfg.sliding_window == WINDOW
        assert "model.layers.0.self_attn.k_proj.weight" in loaded.weights
        assert "model.layers.0.mlp.gate_proj.weight" in loaded.weights
    if name in SENTENCEPIECE:  # the prompts reach past the window
        assert min(len(p) for p in prompts[:2]) > WINDOW
    # The file's tokenizer is the checkpoint's.
    assert [loaded.tokenizer.encode(p) for p in PROMPTS] == prompts
    expected = hf_greedy(model, prompts)
    for kernels in ("torch", "native"):
        engine = engine_for(f32, "dense", kernels)
        assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected, kernels


def test_q8_0_gguf_quantized_greedy_equals_transformers_on_its_weights(converted) -> None:
    name, model, _, q8, prompts = converted
    expected = hf_greedy(on_file_weights(name, model, q8), prompts)
    engine = engine_for(q8, "quantized")
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected
    alone = [engine.generate([ids], GREEDY)[0].token_ids for ids in prompts]
    assert alone == expected


def test_sentencepiece_gguf_tokenizer_equals_transformers(converted) -> None:
    """The vocabulary the converter wrote from tokenizer.model, read by headrace, gives the
    ids of transformers reading the file, of the checkpoint's own transformers tokenizer and
    of sentencepiece itself: BOS as the family asks, byte fallback, chat tokens, template.

    One difference is transformers', not the file's: its LlamaTokenizer (Phi-3's class)
    rebuilds a Metaspace pre-tokenizer that adds the prefix space once, to a text that does
    not start with one (" x" -> "▁x"), where sentencepiece always adds it ("▁▁x") and
    llama.cpp, like transformers reading a Phi-3 GGUF, after every special token too; so
    on Phi-3, texts starting with a space or holding its chat tokens are compared with
    transformers reading the file only."""
    name, _, f32, _, _ = converted
    if name not in SENTENCEPIECE:
        pytest.skip("a SentencePiece vocabulary: Gemma 2 and Phi-3 here")
    import sentencepiece
    import transformers

    ours = Tokenizer.from_gguf(f32)
    hf_dir = f32.parent / "hf"
    checkpoint = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    from_file = transformers.AutoTokenizer.from_pretrained(str(f32.parent), gguf_file=f32.name)
    spm = sentencepiece.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    added = SENTENCEPIECE[name][2]

    def oracles(text: str) -> list:
        if name == "phi3" and (text[:1].isspace() or any(t in text for t in added)):
            return [from_file]
        return [from_file, checkpoint]

    for text in [*PROMPTS, *TEXTS]:
        for theirs in oracles(text):
            assert ours.encode_prompt(text) == theirs(text)["input_ids"], text
            assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
            ids = ours.encode(text)
            assert ours.decode(ids) == theirs.decode(ids), text
        if not any(token in text for token in added):
            assert ours.encode(text) == spm.encode(text), text
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode("日本 🙂"))
    assert ours.encode_prompt("Hi")[0] == checkpoint.bos_token_id
    assert checkpoint.eos_token_id in ours.eos_token_ids
    chat = ours.encode_chat(CHAT, add_generation_prompt=True)
    marker = "<start_of_turn>" if name == "gemma2" else "<|system|>"
    assert ours.hf.token_to_id(marker) in chat  # matched whole
    for theirs in oracles(ours.apply_chat_template(CHAT)):
        want = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        assert chat == list(want["input_ids"] if hasattr(want, "keys") else want)


def test_sentencepiece_gguf_batched_chunked_and_over_grpc(converted) -> None:
    """Gemma 2 (soft-caps, alternating windows) and Phi-3 (fused projections, a window on
    every layer) from their files, in each exact --weights mode: alone, batched, in prefill
    chunks shorter than the window; Gemma 2's q8_0 file also through the gRPC server."""
    name, model, f32, q8, prompts = converted
    if name not in SENTENCEPIECE:
        pytest.skip("Gemma 2 and Phi-3 (the others: test_model_families.py)")
    expected = {f32: hf_greedy(model, prompts)}
    expected[q8] = hf_greedy(on_file_weights(name, model, q8), prompts)
    runs = [(f32, "dense", "torch"), (f32, "dense", "native"), (q8, "dense", "native"),
            (q8, "quantized", "native")]  # fmt: skip
    for path, weights, kernels in runs:
        chunked = engine_for(path, weights, kernels, chunk=16)
        got = [out.token_ids for out in chunked.generate(prompts, GREEDY)]
        assert got == expected[path], (path.name, weights, kernels)
    if name != "gemma2":
        return
    info, got = grpc_greedy(engine_for(q8, "quantized"), prompts)
    assert info.architecture == "gemma2" and info.num_layers == 3
    assert (info.sliding_window, info.sliding_window_layers) == (WINDOW, 2)
    assert (info.attn_logit_softcapping, info.final_logit_softcapping) == (20.0, 15.0)
    assert got == expected[q8]


def test_mistral_gguf_without_its_window_is_a_llama_model(tmp_path: Path) -> None:
    """llama.cpp's converter writes a Mistral checkpoint as architecture `llama` with no
    sliding window: the file is another model than the checkpoint once a prompt passes the
    window. headrace serves it as what it says, a llama model with full attention (as
    llama.cpp does): transformers' tokens on the same weights without the window. The same
    file given its window (llama.attention.sliding_window) is served with it."""
    model = build_hf_model(tmp_path / "hf", "mistral-window")
    assert model.config.sliding_window == WINDOW
    f32 = convert(tmp_path / "hf", tmp_path / "mistral-f32.gguf", "f32")
    loaded = load_model(str(f32), progress=False)
    assert loaded.config.architecture == "llama" and loaded.config.sliding_window is None
    assert loaded.config.features() == ()
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    assert min(len(p) for p in prompts[:2]) > WINDOW
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    expected = hf_greedy(full, prompts)
    assert expected != hf_greedy(model, prompts)  # the window changes these tokens
    for weights, kernels in (("dense", "torch"), ("dense", "native")):
        engine = engine_for(f32, weights, kernels)
        assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected
    from tests.engine.test_model_families_moe_gguf import _copy_gguf

    key = {"llama.attention.sliding_window": WINDOW}
    windowed = _copy_gguf(f32, tmp_path / "mistral-window.gguf", (), key)
    assert load_model(str(windowed), progress=False).config.sliding_window == WINDOW
    engine = engine_for(windowed, "dense", "native", chunk=16)
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == hf_greedy(model, prompts)


def test_phi3_longrope_gguf_is_refused(tmp_path: Path) -> None:
    """Phi-3 128k's LongRoPE, which the converter writes as rope_factors_long/short
    tensors, is refused at load, naming them, rather than served with plain RoPE."""
    tokens = sentencepiece_tokenizer(tmp_path / "hf", "phi3")
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 128}  # fmt: skip
    build_hf_model(tmp_path / "hf", "phi3", tokenizer=False, rope_scaling=rope, **tokens)
    f32 = convert(tmp_path / "hf", tmp_path / "phi3-longrope.gguf", "f32")
    with pytest.raises(ModelLoadError, match=r"rope_factors_long\.weight, rope_factors_short"
                       r"\.weight: LongRoPE scaling \(Phi-3 128k\) is not supported"):  # fmt: skip
        load_model(str(f32), progress=False)
