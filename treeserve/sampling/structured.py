"""``StructuredOutput``: what a request's output must match (one JSON schema, any JSON object, a
regex, an EBNF/GBNF grammar or one of a list of strings).

Only the shape of the spec is checked here (types, exactly one kind, JSON-serializable schema);
whether the schema / regex / grammar itself is valid is decided by compiling it
(``treeserve.sampling.grammar.GrammarCompiler.compile``), which the engine does when a request
is submitted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["STRUCTURED_KINDS", "StructuredOutput"]

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
"""The kinds of constraint, exactly one of which a ``StructuredOutput`` sets."""

_FIELD = "SamplingParams.structured"


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """Exactly one constraint on the generated text:

    - ``json_schema``: a JSON schema (a dict, or its JSON text); the output is one JSON value
      that validates against it;
    - ``json_object=True``: the output is any JSON object;
    - ``regex``: the output fully matches the regular expression;
    - ``grammar``: an EBNF / GBNF grammar whose start rule is ``root``;
    - ``choice``: the output is one of these (non-empty) strings.

    ``key`` is a hashable form of the spec (compiled grammars are cached by it): a schema given
    as a dict or as its text, with any spacing, has one key; properties in another order are
    another schema (the generated object follows their order).
    Raises ``TypeError`` / ``ValueError`` naming ``SamplingParams.structured.<kind>``.
    """

    json_schema: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise TypeError(f"{_FIELD}.json_object must be a bool, got {type(self.json_object).__name__}")
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"{_FIELD} must set exactly one of {', '.join(STRUCTURED_KINDS)}; got {set_kinds or 'none'}"
            )
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{_FIELD}.{name} must be a str, got {type(value).__name__}")
            if value == "":
                raise ValueError(f"{_FIELD}.{name} must be a non-empty str")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        """Which of ``STRUCTURED_KINDS`` this spec sets."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: equal for equal constraints."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            return kind, json.dumps(value)
        return kind, "" if kind == "json_object" else value

    @classmethod
    def of(cls, value: StructuredOutput | Mapping[str, Any]) -> StructuredOutput:
        """``value`` itself, or a ``StructuredOutput`` built from a dict of its fields."""
        if isinstance(value, StructuredOutput):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(STRUCTURED_KINDS))
            if unknown:
                raise ValueError(f"{_FIELD} has unknown keys {unknown}; allowed: {', '.join(STRUCTURED_KINDS)}")
            return cls(**value)
        raise TypeError(f"{_FIELD} must be a StructuredOutput, a dict or None, got {type(value).__name__}")


def _schema_text(schema: Any) -> str:
    """A JSON schema as compact JSON text, checked to be a JSON object. Key order is kept: it is
    the order of the generated object's properties."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{_FIELD}.json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise TypeError(f"{_FIELD}.json_schema must be a JSON object (dict or its text), got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{_FIELD}.json_schema is not JSON-serializable: {exc}") from None


def _choices(choice: Any) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not hasattr(choice, "__iter__"):
        raise TypeError(f"{_FIELD}.choice must be a sequence of strings, got {type(choice).__name__}")
    out = tuple(choice)
    if not out:
        raise ValueError(f"{_FIELD}.choice must list at least one string")
    for c in out:
        if not isinstance(c, str) or not c:
            raise ValueError(f"{_FIELD}.choice entries must be non-empty strings, got {c!r:.80}")
    return out
