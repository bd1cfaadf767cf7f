"""Text <-> token ids and chat formatting for stage 1 (tokenize) and stage 3 (detokenize).

Wraps a Hugging Face `tokenizers.Tokenizer` built either from a GGUF file's metadata (byte-level
BPE: tokens, merges, token types; or SentencePiece, `tokenizer.ggml.model = "llama"`: tokens,
scores, token types, byte fallback, rebuilt as transformers rebuilds it, without sentencepiece)
or from an HF checkpoint's `tokenizer.json`, plus the model's
Jinja chat template rendered the way transformers renders it (sandboxed, trim/lstrip blocks).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# Tokens that end an assistant turn in common chat templates. A model's generation config lists
# them as EOS, but a GGUF only stores one EOS id, so we recover them from the template.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

_OWN_TOKENS = ("bos_token", "eos_token")  # a Tokenizer's own; the rest pass to templates

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
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


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
    tokens: list[str], scores: list[float], arch: str | None, unk: str | None
) -> HFTokenizer:
    """A SentencePiece vocabulary as the BPE transformers builds from a GGUF file (its
    gguf_tokenizer_mapping: LlamaTokenizer, GemmaTokenizer, Phi-3's normalizer): merges
    recovered from the scores (Gemma: from the order of the tokens, its scores do not
    follow its merges), byte fallback to <0xNN> tokens."""
    if arch in _GEMMA_ARCHITECTURES:
        # Tokens of spaces only are stored as spaces; the normalizer spells spaces as U+2581.
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        order = {token: -index for index, token in enumerate(tokens)}
        merges = _spm_merges(tokens, order)
    else:
        merges = _spm_merges(tokens, dict(zip(tokens, scores, strict=True)))
    vocab = {token: index for index, token in enumerate(tokens)}
    gemma = arch in _GEMMA_ARCHITECTURES
    hf = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=(unk or "<unk>") if gemma else None,
        )
    )
    replace = decoders.Replace(_SPACE, " ")
    if gemma:
        hf.normalizer = normalizers.Replace(" ", _SPACE)
        hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        hf.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse()])
        return hf
    if arch == "phi3":  # the prefix space from a normalizer, not from Metaspace
        hf.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first", split=False
        )
    hf.decoder = decoders.Sequence(
        [replace, decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
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


def _bos_processor(bos: str, bos_id: int) -> processors.PostProcessor:
    """Prepends BOS when `add_special_tokens=True`, for files that ask for it."""
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    # jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def read_chat_template(path: str | Path) -> str:
    """A chat template file's text, checked the way a chat request will use it: it must be
    UTF-8, compile in the sandbox and render one user message. Raises ValueError naming the
    file (an operator's ``--chat-template`` is refused at load, not at the first chat)."""
    path = Path(path)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat template {str(path)!r}: {exc}") from exc
    if not source.strip():
        raise ValueError(f"chat template {str(path)!r} is empty")
    try:
        template = _compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {str(path)!r}, line {exc.lineno}: {exc.message}") from exc
    try:
        template.render(
            messages=[{"role": "user", "content": "Hello"}],
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    except Exception as exc:  # the template's own raise_exception, undefined calls, ...
        raise ValueError(f"chat template {str(path)!r} fails on one user message: {exc}") from exc
    return source


class Tokenizer:
    """A model's tokenizer and chat template."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        special_tokens: dict[str, str | None] | None = None,
    ) -> None:
        self.hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        self.chat_template = chat_template
        # Passed to the template like transformers' special_tokens_map (bos/eos/unk/pad).
        self._template_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self._template_tokens.update(bos_token=self.bos_token, eos_token=self.eos_token)
        self.eos_token_ids = self._collect_eos_ids()
        self.chat_roles = self._collect_roles()

    def _collect_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        candidates = [self.hf.token_to_id(self.eos_token) if self.eos_token else None]
        for token in _END_OF_TURN_TOKENS:
            if self.chat_template and token in self.chat_template:
                candidates.append(self.hf.token_to_id(token))
        for token_id in candidates:
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return tuple(ids)

    def _collect_roles(self) -> frozenset[str]:
        roles = {"system", "user", "assistant"}
        if self.chat_template and "tool" in self.chat_template:
            roles.add("tool")
        return frozenset(roles)

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This vocabulary with another chat template (an operator's ``--chat-template``):
        the end-of-turn tokens it writes become stop tokens and the roles it names
        allowed, as for a template the model file carries."""
        specials = {k: v for k, v in self._template_tokens.items() if k not in _OWN_TOKENS}
        return Tokenizer(
            self.hf,
            bos_token=self.bos_token or None,
            eos_token=self.eos_token or None,
            chat_template=chat_template,
            special_tokens=specials,
        )

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
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
            scores = gguf_field(reader, "tokenizer.ggml.scores")
            if not tokens or not scores:
                raise ValueError("GGUF SentencePiece metadata lacks tokens or scores")
            arch = gguf_field(reader, "general.architecture")
            hf = _sentencepiece(tokens, scores, arch, named.get("unknown"))
            # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
            add_bos = gguf_field(reader, "tokenizer.ggml.add_bos_token", True)
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
            hf.post_processor = _bos_processor(named["bos"], hf.token_to_id(named["bos"]))
        return cls(
            hf,
            bos_token=named.get("bos"),
            eos_token=named.get("eos"),
            chat_template=gguf_field(reader, "tokenizer.chat_template"),
            special_tokens={"unk_token": named.get("unknown"), "pad_token": named.get("padding")},
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """`tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`) of a checkpoint."""
        path = Path(path)
        hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}
        return cls(
            hf,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=_hf_chat_template(path, config),
            special_tokens={
                "unk_token": _token_content(config.get("unk_token")),
                "pad_token": _token_content(config.get("pad_token")),
            },
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched as specials."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw prompt, as transformers' ``tokenizer(text)`` gives them: with
        the BOS the vocabulary asks for (Gemma, Llama 2: SentencePiece GGUFs; tokenizer.json
        post-processors), none where it asks for none (byte-level GGUFs without
        add_bos_token)."""
        return self.encode(text, add_special_tokens=True)

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))``, in O(1): no token covers more than
        ``max_token_chars`` characters of the input. Lets a caller refuse a text that can
        never fit a context before spending seconds and gigabytes tokenizing it."""
        return -(-len(text) // self.max_token_chars)

    @cached_property
    def max_token_chars(self) -> int:
        """The most input characters one token can stand for (with a margin when a
        normalizer, which can shrink text, runs before the model)."""
        longest = max(
            (len(token) for token in self.hf.get_vocab(with_added_tokens=True)), default=1
        )
        return max(1, longest) * (4 if self.hf.normalizer is not None else 1)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token = self.hf.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        return token

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("no chat template (a server takes one: --chat-template)")
        return _compile_template(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for a chat, rendered like transformers' `apply_chat_template`."""
        plain = [dict(message) for message in messages]  # the template must not mutate ours
        return self._template.render(
            messages=plain, add_generation_prompt=add_generation_prompt, **self._template_tokens
        )

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes any BOS itself, so none is added here (as in transformers).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))
