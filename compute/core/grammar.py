"""Grammar constraints as records: what a request asks for, and what stage 1 compiled.

A ``Constraint`` is the request's own words (a JSON schema's text, a regex, an EBNF grammar,
a list of choices, JSON-object mode); ``CompiledGrammar`` is what the grammar compiler
(compute/sampling/grammar_compiler.py) made of it in stage 1, carried to stage 2 in
``SamplingParams.grammar``, where compute/sampling/grammar_masks.py gives each request a matcher of
its own. Pure records: no llguidance import here (the compiled template is opaque).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The kinds a request may ask for, as the services name them (headrace.v1's Constraint
# oneof, the worker protocol's SamplingParams.constraint).
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar's text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


@dataclass(frozen=True)
class Constraint:
    """One grammar constraint as asked: ``kind`` is one of KINDS; ``text`` the schema,
    regex, grammar or structural tag (JSON), empty for json_object; ``choices`` for choice.
    ``field`` is the request field that carried it, for errors."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()
    field: str = "constraint"

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What the compiled grammar depends on: the compile cache's key."""
        return (self.kind, self.text, self.choices)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled constraint: ``template`` is a matcher in its start state, never advanced;
    each request gets its own copy (``new_matcher``). Shared by every request whose
    constraint had the same text (the compile cache)."""

    constraint: Constraint
    template: Any  # llguidance.LLMatcher

    def new_matcher(self) -> Any:
        return self.template.deep_copy()
