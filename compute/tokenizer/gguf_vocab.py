"""A GGUF file's vocabulary as a Hugging Face ``tokenizers.Tokenizer``.

Byte-level BPE (``tokenizer.ggml.model = "gpt2"``: tokens, merges, token types, the
``tokenizer.ggml.pre`` split) or SentencePiece (``"llama"``: tokens, scores, token types,
byte fallback), rebuilt as transformers rebuilds them from a GGUF file, without
sentencepiece. compute/tokenizer/tokenizer.py wraps the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from compute.models.families import GEMMA_VOCAB, NORMALIZER_PREFIX, gguf_sentencepiece

_CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED_TOKEN_TYPE = 4

# Split regexes of llama.cpp's `tokenizer.ggml.pre` types (the same ones transformers uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer:
    """Split text the way this vocabulary's merges were learned."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type == "smollm":
        # SmolLM's own tokenizer.json: digits one by one, then GPT-2's split. Its vocabulary has
        # no multi-digit tokens, so this gives the same ids as transformers' plain ByteLevel.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre_type in _PRE_SPLITS:
        split = pre_tokenizers.Split(Regex(_PRE_SPLITS[pre_type]), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    return byte_level


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value (``default`` when absent); the loader reads the rest with it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _byte_level_bpe(tokens: list[str], merges: list[str], pre_type: str | None) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A few converted vocabularies spell some tokens in raw UTF-8; respell them like transformers.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): index
        for index, tok in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = _pre_tokenizer(pre_type)
    hf.decoder = decoders.ByteLevel()
    return hf


_SPACE = "\u2581"  # SentencePiece's spelling of a space


def _spm_merges(tokens: list[str], scores: dict[str, float]) -> list[tuple[str, str]]:
    """transformers' generate_merges: every split of a token into two vocabulary pieces,
    best score first (ties: shorter left, then shorter right piece)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for merge, score in scores.items():
        local = [
            (merge[:i], merge[i:], score)
            for i in range(1, len(merge))
            if merge[:i] in vocab and merge[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(
    tokens: list[str], scores: list[float], style: str, unk: str | None
) -> HFTokenizer:
    """A SentencePiece vocabulary as the BPE transformers builds from a GGUF file (its
    gguf_tokenizer_mapping: LlamaTokenizer, GemmaTokenizer, Phi-3's normalizer; the family's
    ``style``, compute/models/families.py): merges recovered from the scores (Gemma: from the
    order of the tokens, its scores do not follow its merges), byte fallback to <0xNN> tokens."""
    gemma = style == GEMMA_VOCAB
    if gemma:
        # Tokens of spaces only are stored as spaces; the normalizer spells spaces as U+2581.
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        merges = _spm_merges(tokens, {token: -index for index, token in enumerate(tokens)})
    else:
        merges = _spm_merges(tokens, dict(zip(tokens, scores, strict=True)))
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_token = (unk or "<unk>") if gemma else None
    hf = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token=unk_token
        )
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # no prefix space: spaces split off as they are
        hf.normalizer = normalizers.Replace(" ", _SPACE)
        hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        hf.decoder = decoders.Sequence(steps)
        return hf
    if style == NORMALIZER_PREFIX:  # the prefix space from a normalizer, not from Metaspace
        hf.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first", split=False
        )
    hf.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return hf


def _add_gguf_specials(
    hf: HFTokenizer, tokens: list[str], token_types: list[int], byte_level: bool = True
) -> None:
    """Control tokens are matched whole as specials; user-defined ones whole as plain tokens."""
    alphabet = set(bytes_to_unicode().values())
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=True)
        # A control token outside the byte alphabet is a llama.cpp mislabel (transformers skips it).
        if kind == _CONTROL_TOKEN_TYPE and (not byte_level or set(tok) <= alphabet)
    ]
    vocab = hf.get_vocab() if not byte_level else None  # SentencePiece: as respelled
    user = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED_TOKEN_TYPE and (vocab is None or tok in vocab)
    ]
    hf.add_special_tokens(control)
    hf.add_tokens(user)


def bos_processor(bos: str, bos_id: int) -> processors.PostProcessor:
    """Prepends BOS when `add_special_tokens=True`, for files that ask for it."""
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


@dataclass(frozen=True)
class GGUFVocab:
    """What a Tokenizer is built from: the HF tokenizer, the named special tokens
    (bos, eos, unknown, padding: their text) and the file's chat template."""

    hf: HFTokenizer
    named: dict[str, str]
    chat_template: str | None


def read_gguf_vocab(reader_or_path: Any) -> GGUFVocab:
    """Byte-level BPE or SentencePiece from `tokenizer.ggml.*` metadata; raises ValueError
    for other tokenizer models."""
    if isinstance(reader_or_path, str | Path):
        import gguf  # only GGUF users pay for the import

        reader = gguf.GGUFReader(reader_or_path)
    else:
        reader = reader_or_path
    model = gguf_field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r} (only 'gpt2' BPE and 'llama' "
            "SentencePiece)"
        )
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    named = {
        name: tokens[token_id]
        for name in ("bos", "eos", "unknown", "padding")
        if tokens
        and (token_id := gguf_field(reader, f"tokenizer.ggml.{name}_token_id")) is not None
    }
    if model == "llama":
        hf, add_bos = _sentencepiece_of(reader, tokens, named)
    else:
        merges = gguf_field(reader, "tokenizer.ggml.merges")
        if not tokens or not merges:
            raise ValueError("GGUF tokenizer metadata lacks tokens or merges")
        hf = _byte_level_bpe(tokens, merges, gguf_field(reader, "tokenizer.ggml.pre"))
        add_bos = gguf_field(reader, "tokenizer.ggml.add_bos_token", False)
    _add_gguf_specials(
        hf, tokens, gguf_field(reader, "tokenizer.ggml.token_type", []), model == "gpt2"
    )
    if add_bos and "bos" in named:
        hf.post_processor = bos_processor(named["bos"], hf.token_to_id(named["bos"]))
    return GGUFVocab(hf, named, gguf_field(reader, "tokenizer.chat_template"))


def _sentencepiece_of(
    reader: Any, tokens: list[str], named: dict[str, str]
) -> tuple[HFTokenizer, bool]:
    scores = gguf_field(reader, "tokenizer.ggml.scores")
    if not tokens or not scores:
        raise ValueError("GGUF SentencePiece metadata lacks tokens or scores")
    style = gguf_sentencepiece(gguf_field(reader, "general.architecture"))
    hf = _sentencepiece(tokens, scores, style, named.get("unknown"))
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    return hf, gguf_field(reader, "tokenizer.ggml.add_bos_token", True)
