"""What a request asks its output to follow: a JSON schema, any JSON object, a regex,
one of several strings, or a grammar. Plain data: no grammar engine is imported here,
so the gateway's request models and the protobuf conversion can use it freely."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]
STRUCTURED_OUTPUT_KINDS: tuple[StructuredOutputKind, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """Frozen and hashable: (kind, spec) is the key of every compiled-grammar cache.

    ``spec`` by kind:
      - ``json``: a JSON schema, as JSON text;
      - ``json_object``: empty (any JSON object);
      - ``regex``: a regular expression the whole output must match;
      - ``choice``: a JSON list of the allowed strings (use :meth:`from_choices`);
      - ``grammar``: an EBNF grammar (llama.cpp's GBNF, as vLLM takes it) or a Lark grammar.
    """

    kind: StructuredOutputKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(
                f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {self.kind!r}"
            )
        if self.kind != "json_object" and not self.spec.strip():
            raise ValueError(f"the structured output {self.kind} is empty; send a non-empty {self.kind}")

    @classmethod
    def from_choices(cls, choices: list[str]) -> StructuredOutputSpec:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(choices))

    @classmethod
    def from_json_schema(cls, schema: dict[str, object] | str) -> StructuredOutputSpec:
        """A schema object, or its JSON text (kept as sent: the cache key is the text)."""
        if isinstance(schema, str):
            return cls("json", schema)
        # Keys keep their order: a schema's property order is the order of the output's fields.
        return cls("json", json.dumps(schema))

    @property
    def choices(self) -> list[str]:
        """The allowed strings of a ``choice`` spec."""
        if self.kind != "choice":
            raise RuntimeError(f"bug: choices of a {self.kind} spec")
        return json.loads(self.spec)
