"""Chat templates: found in a checkpoint, read from an operator's file, compiled and
rendered the way transformers renders them (sandboxed Jinja, trim/lstrip blocks, its
``tojson``, ``raise_exception`` and ``strftime_now``)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
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


def compile_template(source: str) -> jinja2.Template:
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
        template = compile_template(source)
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
