"""Stage 1: the tokenize pool, from a ``GenerateInput`` to an ``AddRequest``.

The prompt's own form (exactly one of prompt, token_ids, chat; roles the chat template
knows), the chat template and tokenization run on a small thread pool so the asyncio loop
and the step loop never wait for them; then ``check_request`` (compute/core/checks.py,
the same rules the engine's admission runs) checks the ids against the vocabulary, the
context and the KV cache. A bad request fails here with ``FieldError`` naming the
field, before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import jinja2

from compute.core.checks import RequestLimits, check_request
from compute.core.errors import FieldError, capped
from compute.core.messages import AddRequest
from compute.core.prefix_cache import cache_namespace
from compute.tokenizer.tokenizer import Tokenizer
from services.domain import ChatMessage, GenerateInput, prompt_form

T = TypeVar("T")


class TokenizeStage:
    """Validates and tokenizes requests on ``num_workers`` threads."""

    def __init__(
        self, tokenizer: Tokenizer | None, limits: RequestLimits, num_workers: int = 2
    ) -> None:
        self._tokenizer = tokenizer
        self._limits = limits
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="headrace-tokenize")

    async def prepare(self, inp: GenerateInput, request_id: str, arrival: float) -> AddRequest:
        """The engine-ready request; FieldError(field=...) for bad input."""
        return await self._in_pool(self.build_request, inp, request_id, arrival)

    async def tokenize(
        self,
        prompt: str | None,
        chat: tuple[ChatMessage, ...] | None,
        add_generation_prompt: bool = True,
    ) -> tuple[list[int], list[str]]:
        """Token ids of a prompt or chat, and each id's token string."""
        return await self._in_pool(self.tokenize_now, prompt, chat, add_generation_prompt)

    def shutdown(self) -> None:
        # Queued jobs still run (they are short): their callers then meet the closed
        # output stage and get Unavailable rather than a bare CancelledError.
        self._pool.shutdown(wait=False)

    async def _in_pool(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- runs on a pool thread ----------------------------------------------------------

    def build_request(self, inp: GenerateInput, request_id: str, arrival: float) -> AddRequest:
        field, ids = self._prompt_ids(inp)
        if inp.params.stop and self._tokenizer is None:
            raise FieldError("stop", "stop strings need a model with a tokenizer")
        params = check_request(ids, inp.params, self._limits, field)
        salt = cache_namespace(inp.tenant, inp.cache_salt)
        return AddRequest(request_id, tuple(ids), params, inp.priority, arrival, cache_salt=salt)

    def tokenize_now(
        self, prompt: str | None, chat: tuple[ChatMessage, ...] | None, add_generation_prompt: bool
    ) -> tuple[list[int], list[str]]:
        if prompt_form({"prompt": prompt, "chat": chat}) == "chat":
            ids = self._chat_ids(chat, add_generation_prompt)
        else:
            ids = self._encode_fitting("prompt", prompt)
        tokenizer = self._require_tokenizer("prompt")
        return ids, [tokenizer.id_to_token(i) for i in ids]

    def _prompt_ids(self, inp: GenerateInput) -> tuple[str, list[int]]:
        """(name of the field the prompt came in, its token ids)."""
        field = prompt_form(vars(inp))
        if field == "token_ids":
            return field, list(inp.token_ids)
        if field == "chat":
            return field, self._chat_ids(inp.chat, inp.add_generation_prompt)
        return field, self._encode_fitting(field, inp.prompt)

    def _encode_fitting(self, field: str, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the BOS the vocabulary asks for unless
        ``add_special_tokens`` is false); FieldError at once, without tokenizing, when the
        text is too long to leave room for output in the context whatever its tokens are."""
        tokenizer = self._require_tokenizer(field)
        at_least, limit = tokenizer.min_tokens(text), self._limits.max_model_len
        if at_least >= limit:
            raise FieldError(
                field,
                f"prompt of at least {at_least} tokens ({len(text)} characters) leaves no room "
                f"for output within max_model_len {limit}",
            )
        if add_special_tokens:
            return tokenizer.encode_prompt(text)
        return tokenizer.encode(text)

    def _chat_ids(self, chat: tuple[ChatMessage, ...], add_generation_prompt: bool) -> list[int]:
        tokenizer = self._require_tokenizer("chat")
        for i, message in enumerate(chat):
            if message.role not in tokenizer.chat_roles:
                roles = ", ".join(sorted(tokenizer.chat_roles))
                raise FieldError(
                    f"chat.messages[{i}].role",
                    f"must be one of {roles} (got {capped(message.role)})",
                )
        messages = [{"role": m.role, "content": m.content} for m in chat]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt)
        except (jinja2.TemplateError, ValueError) as exc:  # e.g. the template's own checks
            raise FieldError("chat", capped(str(exc), quote=False)) from exc
        # The template writes any BOS itself: none is added (as transformers' tokenize=True).
        return self._encode_fitting("chat", text, add_special_tokens=False)

    def _require_tokenizer(self, field: str) -> Tokenizer:
        if self._tokenizer is None:
            raise FieldError(field, "this model has no tokenizer; send token_ids")
        return self._tokenizer
