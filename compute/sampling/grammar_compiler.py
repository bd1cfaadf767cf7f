"""Compiles a request's grammar constraint with llguidance, for stage 1 (never stage 2).

``GrammarCompiler.compile`` turns a ``Constraint`` into a ``CompiledGrammar`` whose template
matcher stage 2 copies per request, or raises ``FieldError`` naming the constraint's field
with llguidance's reason (capped). The library was chosen on measurements
(bench/grammar_libs.py, docs/structured-output.md): llguidance builds the lexer and parser
lazily, so a schema compiles in about a millisecond, and its mask work per step is bounded
by its parser limits (``_limits``), so no grammar can stall the step loop for long.

What each kind becomes:

- ``json_schema``: the schema through llguidance's JSON compiler, whitespace not flexible
  (separators ``", "`` and ``": "`` only), so a model cannot pad a structure with blanks
  until ``max_tokens``; a keyword llguidance does not implement is refused by name
  ("Unimplemented keys: [...]") rather than ignored. ``json_object``: the schema
  ``{"type": "object"}`` (what the OpenAI API's JSON mode promises).
- ``regex``: Rust-regex syntax, matched whole (the output is exactly one match).
- ``grammar``: a Lark grammar (llguidance's syntax), or a GBNF/EBNF one with ``::=`` rules
  (llama.cpp's and xgrammar's notation, what SGLang's ``ebnf`` extra sends), converted.
- ``choice``: exactly one of the given strings.
- ``structural_tag``: SGLang's form, ``{"type": "structural_tag", "structures": [{"begin",
  "schema", "end"}, ...], "triggers": [...]}`` (what SMG forwards from the OpenAI API's
  ``response_format``): free text, and wherever the text reaches a trigger, one of the
  structures whose ``begin`` starts with it: its ``begin``, a JSON value of its ``schema``,
  its ``end``; then free text again (llguidance's ``StructTag``, lazy lexemes: a trigger is
  text, never assumed to be a special token). xgrammar's newer ``format`` form is refused.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from compute.core.errors import FieldError, capped
from compute.core.grammar import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    CompiledGrammar,
    Constraint,
)

# JSON output: no free whitespace (it is the padding failure mode of JSON modes), the
# separators most models were trained on.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_REASON_CHARS = 240  # llguidance's reason, as a client sees it


class GrammarCompiler:
    """llguidance's tokenizer for one model's vocabulary, and compilation against it.

    Thread-safe: the tokenizer is built once (about 0.5 s) on first use, under a lock.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarCompiler:
        """For a compute.tokenizer.tokenizer.Tokenizer; ``vocab_size`` is the model's (the logits'
        width, which may exceed the tokenizer's)."""
        return cls(tokenizer.hf.to_str(), vocab_size, tuple(tokenizer.eos_token_ids))

    def warm_up(self) -> None:
        """Build the tokenizer now (startup) rather than on the first constrained request."""
        self._tokenizer()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled constraint; FieldError(constraint.field) when it is invalid."""
        import llguidance

        grammar = _grammar_text(constraint)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise FieldError(constraint.field, _reason(matcher.get_error()))
        return CompiledGrammar(constraint, matcher)

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer


def _limits() -> Any:
    """llguidance's resource limits (its defaults, errors kept short): a grammar that
    needs more fails to compile or fails its request, never the step."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _grammar_text(c: Constraint) -> str:
    """llguidance's grammar for ``c``; FieldError for what cannot be one."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if len(c.text) > MAX_CONSTRAINT_CHARS:
        raise FieldError(c.field, f"at most {MAX_CONSTRAINT_CHARS} characters")
    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(_schema(c), defaults=JSON_OPTIONS)
    if c.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.kind == "regex":
        if not c.text:
            raise FieldError(c.field, "must not be empty")
        return LLMatcher.grammar_from_regex(c.text)
    if c.kind == "grammar":
        if not c.text.strip():
            raise FieldError(c.field, "must not be empty")
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(c.text))
        except Exception as exc:  # the GBNF converter's own errors
            raise FieldError(c.field, _reason(f"not a valid GBNF/EBNF grammar: {exc}")) from exc
    if c.kind == "choice":
        _check_choices(c)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, c.choices)))
    if c.kind == "structural_tag":
        return LLMatcher.grammar_from_lark(_structural_tag_lark(c))
    raise FieldError(c.field, f"unknown constraint kind {capped(c.kind)}")


def _structural_tag_lark(c: Constraint) -> str:
    """The Lark grammar of a structural tag (see the top); FieldError naming what is wrong."""
    from llguidance import StructTag

    try:
        tag = json.loads(c.text)
    except ValueError as exc:
        raise FieldError(c.field, _reason(f"not valid JSON: {exc}")) from exc
    if not isinstance(tag, dict):
        raise FieldError(c.field, "a structural tag is a JSON object")
    if "format" in tag:
        raise FieldError(c.field, "the 'format' form is not supported; use structures and triggers")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise FieldError(c.field, "'structures' must be a non-empty list")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise FieldError(c.field, "'triggers' must be a list of non-empty strings")
    tags = []
    for i, st in enumerate(structures):
        if not isinstance(st, dict):
            raise FieldError(c.field, f"structures[{i}] must be an object")
        begin, end, schema = st.get("begin"), st.get("end", ""), st.get("schema", {})
        if not isinstance(begin, str) or not isinstance(end, str):
            raise FieldError(c.field, f"structures[{i}]: 'begin' and 'end' must be strings")
        if not isinstance(schema, dict | bool):
            raise FieldError(c.field, f"structures[{i}]: 'schema' must be a JSON schema")
        starts = [t for t in triggers if begin.startswith(t)]
        if not starts:
            raise FieldError(c.field, f"structures[{i}]: 'begin' starts with no trigger")
        grammar = {} if schema is True else schema
        if schema is False:
            raise FieldError(c.field, f"structures[{i}]: the schema false matches nothing")
        tags.append(StructTag(trigger=max(starts, key=len), begin=begin, grammar=grammar, end=end))
    return StructTag.to_grammar(tags, assume_special=False)


def _schema(c: Constraint) -> dict | bool:
    try:
        schema = json.loads(c.text)
    except ValueError as exc:
        raise FieldError(c.field, _reason(f"not valid JSON: {exc}")) from exc
    if not isinstance(schema, dict | bool):
        raise FieldError(c.field, "a JSON schema is an object (or true/false)")
    return schema


def _check_choices(c: Constraint) -> None:
    if not c.choices:
        raise FieldError(c.field, "at least one choice")
    if len(c.choices) > MAX_CHOICES:
        raise FieldError(c.field, f"at most {MAX_CHOICES} choices")
    if not all(0 < len(s) <= MAX_CHOICE_CHARS for s in c.choices):
        raise FieldError(c.field, f"each choice must have 1..{MAX_CHOICE_CHARS} characters")


def _reason(message: str) -> str:
    """llguidance's message on one line, capped (it may quote the whole grammar)."""
    text = " ".join(message.split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
