"""Write the served model's tokenizer as an HF tokenizer directory a gateway can load.

SMG tokenizes and applies the chat template itself, from ``tokenizer.json`` and
``tokenizer_config.json`` (its ``chat_template``). headrace's tokenizer may come from
a GGUF (no such files exist), so the worker writes them from the very Tokenizer the
engine uses -- the gateway then produces the token ids headrace.v1 would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compute.tokenizer.tokenizer import Tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def tokenizer_files(tokenizer: Tokenizer, max_model_len: int) -> dict[str, str]:
    """The text of each of FILES: what ``export_tokenizer`` writes and what GetTokenizer
    zips (services/worker/tokenizer_bundle.py)."""
    specials = {k: v for k, v in tokenizer._template_tokens.items() if v}  # bos/eos/unk/pad
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_model_len,
        "add_bos_token": False,  # tokenizer.json's post-processor already adds it, if any
        **specials,
        "chat_template": tokenizer.chat_template,
    }
    generation = {"eos_token_id": list(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    return {
        "tokenizer.json": tokenizer.hf.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
        "generation_config.json": json.dumps(generation, indent=2),
    }


def export_tokenizer(tokenizer: Tokenizer, directory: str | Path, max_model_len: int) -> Path:
    """Write FILES into ``directory`` (created); each file is replaced atomically."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(tokenizer, max_model_len).items():
        _atomic(out / name, text)
    return out


def _atomic(path: Path, text: str) -> None:
    # Replicas sharing one directory may write it at the same time; readers never see half.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
