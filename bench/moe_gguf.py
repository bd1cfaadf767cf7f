"""The MoE benchmark's shape as a real GGUF file, served by headrace and by llama.cpp's
server: one stream decode and 48 mixed requests, and greedy-token agreement.

The file: a transformers Qwen3-MoE checkpoint built from a config of bench/moe.py's shape
(hidden 1024, 12 layers, 16 query / 8 KV heads of 64, 64 experts of moe_intermediate 512,
top-8 renormalised, tied embeddings) with the SmolLM2 tokenizer (vocabulary 49152), seeded
random weights drawn with a larger init (std ``--init``, so logits are peaked and greedy
tokens are not one repeated id), saved as safetensors, converted by llama.cpp's
convert_hf_to_gguf.py (``make llama-cpp-convert``) to f16 and quantized by its
llama-quantize (``make llama-quantize``) to ``--kind`` (Q4_K_M: Q4_K experts, some Q6_K).
Cached in ~/.cache/headrace/models/ under a name made of every setting, so the second run
starts at once.

The comparison is bench/cpu_compare's (``python -m bench.cpu_compare``) on that file:
headrace ``--weights quantized-int8`` and ``quantized`` against ``llama-server`` (``make
llama-server``), ``--threads`` each, no HF; then, untimed, ``--agree-prompts`` seeded
prompts on every system and how many leading greedy tokens each headrace mode shares with
llama.cpp's. The goals judged are issue 27's: one stream >= llama.cpp's, 48 mixed >= 2x.

Run: ``python -m bench.moe_gguf`` (every further flag goes to bench.cpu_compare, e.g.
``--reps 3``); writes bench/results/cpu-compare-moe-<stamp>.json and .png. ``--dry-run``:
a tiny model of the same family and tiny settings, end to end (the tests' check).
``--build-only`` prints the file's path.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import common, requantize
from bench.cpu_compare import __main__ as cpu_compare
from bench.cpu_compare.report import LLAMA, plot

LLAMA_CPP_PY = requantize.LLAMA_CPP_PYTHON  # the Makefile's LLAMA_CPP_PY


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Qwen3-MoE checkpoint's settings; every field is part of the cached file's name."""

    layers: int = 12
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    experts: int = 64
    top_k: int = 8
    expert_intermediate: int = 512
    init: float = 0.1  # weights' std (transformers' default 0.02 gives near-uniform logits)
    seed: int = 0

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]
        return (
            f"qwen3moe-{self.layers}L-h{self.hidden}-e{self.experts}x{self.expert_intermediate}"
            f"-top{self.top_k}-{digest}"
        )


BENCH = Shape()
# Small, but wide enough (256) for K-quant super-blocks, so llama-quantize keeps Q4_K/Q6_K.
DRY = Shape(layers=2, hidden=256, heads=4, kv_heads=2, experts=8, top_k=2, expert_intermediate=256)

# Issue 27's goals against llama.cpp's server on the same file (key, what, part, field, test).
GOALS = (
    ("decode_vs_llama", "single-stream decode >= llama.cpp's", "decode", "decode_tok_s",
     lambda v, s: _vs_llama(s, "decode_tok_s", v, 1.0)),
    ("many_vs_llama_2x", "48 mixed requests >= 2x llama.cpp's server", "many",
     "many_output_tok_s", lambda v, s: _vs_llama(s, "many_output_tok_s", v, 2.0)),
)  # fmt: skip


def _vs_llama(summary: dict[str, Any], field: str, value: float, factor: float) -> bool | None:
    theirs = summary.get(LLAMA, {}).get(field)
    return None if theirs is None else bool(value >= factor * theirs)


def converter_dir() -> Path:
    """llama.cpp's sources with convert_hf_to_gguf.py and gguf-py (``make llama-cpp-convert``;
    HEADRACE_LLAMA_CPP_DIR names another root, as in the GGUF family tests)."""
    root = Path(os.environ.get("HEADRACE_LLAMA_CPP_DIR", requantize.cache_dir() / "llama-cpp"))
    return root / f"llama_cpp_python-{LLAMA_CPP_PY}" / "vendor" / "llama.cpp"


def missing_tools() -> str | None:
    """What to build first, or None when the converter and llama-quantize are both here."""
    if not (converter_dir() / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is not in {converter_dir()}: run `make llama-cpp-convert`"
    if requantize.quantize_tool() is None:
        return "llama-quantize is not built: run `make llama-quantize`"
    return None


def hf_config(shape: Shape):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=49152,  # the SmolLM2 tokenizer's
        hidden_size=shape.hidden,
        intermediate_size=shape.top_k * shape.expert_intermediate,  # unused: no dense layers
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.expert_intermediate,
        norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalises
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        initializer_range=shape.init,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def save_tokenizer(directory: Path) -> None:
    """The embedded SmolLM2's tokenizer as an HF tokenizer.json (what the converter reads)."""
    from compute.loaders.default_model import default_model_path
    from compute.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    tok.hf.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "chat_template": tok.chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def save_checkpoint(shape: Shape, directory: Path) -> None:
    """The random-weight checkpoint (bf16 safetensors: half the bytes of fp32 for the
    converter to read; the f16 GGUF it writes holds them exactly) and its tokenizer."""
    import torch
    import transformers

    torch.manual_seed(shape.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    del model
    save_tokenizer(directory)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout)[-3000:]}")


def build(shape: Shape = BENCH, kind: str = "Q4_K_M", cache: Path | None = None) -> Path:
    """The shape's GGUF file as `kind` (a llama-quantize type name): made once, then cached
    in `cache` (default ~/.cache/headrace/models). RuntimeError naming what to run when a
    tool is missing or fails."""
    out = (cache or requantize.cache_dir() / "models") / f"{shape.key()}.{kind}.gguf"
    if out.is_file():
        return out
    why = missing_tools()
    if why:
        raise RuntimeError(why)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".moe-build-") as tmp:
        hf_dir, f16 = Path(tmp) / "hf", Path(tmp) / "model-f16.gguf"
        save_checkpoint(shape, hf_dir)
        script = converter_dir() / "convert_hf_to_gguf.py"
        env = {**os.environ, "PYTHONPATH": str(converter_dir() / "gguf-py")}
        _run([sys.executable, str(script), str(hf_dir), "--outfile", str(f16), "--outtype", "f16"],
             env)  # fmt: skip
        shutil.rmtree(hf_dir)
        quantized = Path(tmp) / out.name
        _run([str(requantize.quantize_tool()), str(f16), str(quantized), kind])
        quantized.rename(out)
    return out


def describe(path: Path, shape: Shape, kind: str) -> dict[str, Any]:
    """The file: its settings, size and how many tensors of each quantization type it has."""
    import gguf

    reader = gguf.GGUFReader(path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "kind": kind,
        "shape": dataclasses.asdict(shape),
        "architecture": "qwen3moe (transformers Qwen3MoeForCausalLM, converted)",
        "tensor_types": types,
        "built_by": f"transformers + llama.cpp convert_hf_to_gguf.py and llama-quantize "
        f"(llama-cpp-python {LLAMA_CPP_PY} sdist)",
    }


# The dry run's cpu_compare settings: every part and the agreement check, a few tokens
# (24 decoded: with 4, the tiny model's stream could arrive all at once, leaving no time
# between the first and last token to rate).
DRY_ARGS = ["--reps", "1", "--new-tokens", "24", "--decode-prompt-len", "8",
            "--ttft-prompt-len", "16", "--num-requests", "3", "--output-mean", "2",
            "--output-cap", "4", "--idle-wait", "0", "--agree-prompts", "2"]  # fmt: skip


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.moe_gguf",
        description=__doc__,
        formatter_class=common.HelpFormatter,
    )
    parser.add_argument("--kind", default="Q4_K_M", help="llama-quantize type of the file")
    parser.add_argument("--layers", type=int, default=BENCH.layers)
    parser.add_argument("--init", type=float, default=BENCH.init, help="weights' std")
    parser.add_argument("--model-seed", type=int, default=BENCH.seed, help="weights' seed")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the file is kept")
    parser.add_argument("--dry-run", action="store_true", help="tiny model, tiny settings")
    parser.add_argument("--build-only", action="store_true", help="make the file, print it")
    args, rest = parser.parse_known_args(argv)
    base = DRY if args.dry_run else BENCH
    shape = dataclasses.replace(base, init=args.init, seed=args.model_seed)
    if not args.dry_run:
        shape = dataclasses.replace(shape, layers=args.layers)
    path = build(shape, args.kind, args.cache_dir)
    print(f"model file: {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)
    if args.build_only:
        return None
    compare = cpu_compare.parse_args(
        ["--gguf", str(path), "--no-hf", "--headrace-weights", "quantized-int8,quantized",
         "--agree-prompts", "4", "--name", "cpu-compare-moe"]
        + (DRY_ARGS if args.dry_run else []) + rest
    )  # fmt: skip
    payload = cpu_compare.collect(compare, GOALS)
    payload["model_file"] = describe(path, shape, args.kind)
    given = sys.argv[1:] if argv is None else argv
    payload["command"] = " ".join(["python -m bench.moe_gguf", *given])
    return common.publish(compare.name, payload, lambda stamp: plot(payload, stamp, compare.name))


if __name__ == "__main__":
    main()
