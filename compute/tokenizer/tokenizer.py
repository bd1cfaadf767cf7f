"""Text <-> token ids and chat formatting for stage 1 (tokenize) and stage 3 (detokenize).

Wraps a Hugging Face `tokenizers.Tokenizer` built either from a GGUF file's metadata
(compute/tokenizer/gguf_vocab.py) or from an HF checkpoint's `tokenizer.json`, plus the
model's Jinja chat template (compute/tokenizer/chat_template.py).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from compute.tokenizer.chat_template import compile_template, hf_chat_template
from compute.tokenizer.gguf_vocab import read_gguf_vocab

# Tokens that end an assistant turn in common chat templates. A model's generation config lists
# them as EOS, but a GGUF only stores one EOS id, so we recover them from the template.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

_OWN_TOKENS = ("bos_token", "eos_token")  # a Tokenizer's own; the rest pass to templates


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


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
        """The vocabulary and chat template of a GGUF file (a path or an open reader)."""
        vocab = read_gguf_vocab(reader_or_path)
        named = vocab.named
        return cls(
            vocab.hf,
            bos_token=named.get("bos"),
            eos_token=named.get("eos"),
            chat_template=vocab.chat_template,
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
            chat_template=hf_chat_template(path, config),
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
        return compile_template(self.chat_template)

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
