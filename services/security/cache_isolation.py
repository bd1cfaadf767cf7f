"""Per-tenant prefix caches (``--cache-isolation``): whose cache a call's request runs in.

The prefix cache is shared, and a response says how many prompt tokens it served
(``usage.cached_prompt_tokens``), so any client could learn whether someone else's
prompt is cached. ``none`` (the default) shares the cache between every caller that does
not name a ``cache_salt``; ``token`` keys every request under its caller's tenant -- a
digest of the bearer token the call carried (token auth must be on) -- so callers with
different tokens never share a KV block, whatever salts they send.

Salts reach the server as headrace.v1 ``GenerateRequest.cache_salt``; the vLLM worker
protocol has no such field, so a gateway or proxy passes one as the call metadata
``x-cache-salt`` (services/worker/servicer.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.security.auth import bearer_token

MODES = ("none", "token")
SALT_METADATA = "x-cache-salt"  # the worker protocol's way to name a salt


@dataclass(frozen=True)
class CacheIsolation:
    """The tenant a call belongs to, under one ``--cache-isolation`` mode."""

    mode: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            choices = ", ".join(MODES)
            raise ValueError(f"cache_isolation must be one of {choices}, got {self.mode!r}")

    def tenant(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """The call's tenant (``token`` mode: a digest of its bearer token), else None."""
        if self.mode != "token":
            return None
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        token = bearer_token(value or "")
        if token is None:  # the auth interceptor refuses such calls before they get here
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        return "tenant-" + digest[:32]


SHARED = CacheIsolation()  # one cache for all (the default)


def metadata_salt(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The salt a call names in its ``x-cache-salt`` metadata (first entry), if any."""
    value = next((v for k, v in metadata or () if k == SALT_METADATA), None)
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value or None
