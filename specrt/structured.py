"""What a structured output asks for: an answer held to a JSON schema, a regular expression, a
list of choices or a Lark grammar, as vLLM's structured outputs and OpenAI's ``response_format``
ask for it; checked and compiled to llguidance's grammar here, masked by
`specrt.runtime.grammar`. llguidance is imported only when one is asked for (``pip install
'specrt[structured]'``)."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields

from specrt.errors import InvalidInputError

FIELD = "structured_output"
INSTALL = "pip install 'specrt[structured]' (llguidance)"
MAX_GRAMMAR_CHARS = 1 << 20  # compiled for each request: far above any real schema


def llguidance_module():
    try:
        import llguidance
    except ImportError:
        raise InvalidInputError(f"structured output needs llguidance: {INSTALL}", FIELD) from None
    return llguidance


@dataclass(frozen=True)
class StructuredOutput:
    """What the answer must match, one of: ``json`` a JSON schema (a dict or its JSON text),
    ``json_object`` any JSON object (OpenAI's JSON mode), ``regex`` a regular expression (the
    whole answer), ``choice`` one of these strings, ``grammar`` a Lark grammar (llguidance's
    dialect). The answer then ends with EOS, where the grammar allows it to."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        schema = self.json
        if isinstance(schema, dict):  # as text, in its order (the answer keeps it): hashable
            object.__setattr__(self, "json", json.dumps(schema))
        elif schema is not None:
            try:
                parsed = json.loads(schema) if isinstance(schema, str) else None
            except ValueError as exc:
                message = f"the JSON schema is not valid JSON: {exc}"
                raise InvalidInputError(message, FIELD) from None
            if not isinstance(parsed, dict):
                raise InvalidInputError(f"json={schema!r}: give a JSON schema (an object)", FIELD)
        if isinstance(self.choice, (list, tuple)):
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.choice, tuple) or not all(
            isinstance(c, str) and c for c in self.choice
        ):
            raise InvalidInputError(f"choice={self.choice!r}: give non-empty strings", FIELD)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidInputError(f"{name}={value!r}: give a non-empty string", FIELD)
        if not isinstance(self.json_object, bool):
            raise InvalidInputError("json_object: use True or False", FIELD)
        given = [
            n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n)
        ]
        if len(given) != 1:
            rule = "give one of json, json_object, regex, choice, grammar"
            raise InvalidInputError(f"structured output with {given or 'nothing'}: {rule}", FIELD)
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise InvalidInputError(
                f"the structured output's grammar has {len(self.spec)} characters: give one of "
                f"at most {MAX_GRAMMAR_CHARS}",
                FIELD,
            )

    @classmethod
    def of(cls, given: object) -> StructuredOutput:
        """``given`` (a `StructuredOutput`, or a dict of its fields) as one."""
        if isinstance(given, dict):
            unknown = sorted(set(given) - {f.name for f in fields(cls)})
            if unknown:
                rule = "give one of json, json_object, regex, choice, grammar"
                raise InvalidInputError(f"structured output with {unknown}: {rule}", FIELD)
            given = cls(**given)
        if not isinstance(given, cls):
            message = (
                f"structured_output={given!r}: give a StructuredOutput (or a dict of its fields)"
            )
            raise InvalidInputError(message, FIELD)
        return given

    @functools.cached_property
    def spec(self) -> str:
        """llguidance's grammar for it (its JSON text), built once: a request's config and
        each of its rows read it."""
        matcher = llguidance_module().LLMatcher
        if self.json is not None:
            return matcher.grammar_from_json_schema(self.json)
        if self.json_object:
            return matcher.grammar_from_json_schema({"type": "object"})
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        if self.choice:  # vLLM builds its choices' regex so too
            return matcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        return matcher.grammar_from_lark(self.grammar)

    def check(self) -> None:
        """Refuse a grammar llguidance cannot compile (a bad regex, an unknown Lark rule),
        before any work (compiled once: a server reads the body, then makes its config)."""
        error = self._compile_error
        if error:  # llguidance's message, without the lines that point a caret at the text
            lines = [line.strip() for line in error.splitlines() if line.strip()]
            said = " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error"))])
            raise InvalidInputError(f"the structured output does not compile: {said}", FIELD)

    @functools.cached_property
    def _compile_error(self) -> str:
        return llguidance_module().LLMatcher.validate_grammar(self.spec)
