"""A structured output spec to a compiled grammar, cached by (kind, spec).

Compiling means: the spec to an llguidance grammar, then a matcher built for this
vocabulary (llguidance builds the lexer and checks the grammar there). A compiled
grammar is a pristine matcher; each request gets a ``deep_copy`` of it, which is
cheap, so the cache saves the compile, not the per-request state.

The gateway owns one compiler (to refuse a bad spec with a 400 before any instance
is touched) and so does every instance (it compiles again from the spec it got in
the protobuf; nothing compiled crosses the network). Thread-safe: the gateway
compiles on its tokenizer pool, an instance on a worker thread and its engine thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import llguidance
from llguidance import LLMatcher, LLTokenizer

from engine.structured_output.spec import StructuredOutputSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept; a JSON schema's costs ~100 KB to a few MB
# No free whitespace in JSON output: a model (a small one especially) can fill its
# whole budget with spaces and newlines where any amount is allowed, and then the
# output never closes. Separators are the ones json.dumps writes.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_JSON_OBJECT = '{"type": "object"}'


class CompiledGrammar:
    """A grammar compiled for one vocabulary; :meth:`new_matcher` gives a request its own state."""

    __slots__ = ("_pristine",)

    def __init__(self, pristine: LLMatcher) -> None:
        self._pristine = pristine

    def new_matcher(self) -> LLMatcher:
        return self._pristine.deep_copy()


class GrammarCompiler:
    """Compiles specs for one vocabulary and keeps the last ``cache_size`` in an LRU."""

    def __init__(self, tokenizer: LLTokenizer, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_hf_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerFast,
        eos_token_ids: Iterable[int] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> GrammarCompiler:
        """``eos_token_ids``: what ends a request on this model (the engine's, from
        generation_config.json); by default the tokenizer's EOS."""
        import llguidance.hf  # imports transformers: only where a tokenizer is at hand anyway

        eos = sorted(eos_token_ids) if eos_token_ids else None
        return cls(llguidance.hf.from_tokenizer(tokenizer, eos_token=eos), cache_size)

    @property
    def vocab_size(self) -> int:
        """Token ids the grammar knows: a bitmask holds one bit for each."""
        return self.tokenizer.vocab_size

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar for ``spec``, from the cache when there. Raises ValueError
        naming the problem for a spec that does not compile (a bad schema, regex or grammar)."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        # Outside the lock: compiles of different specs run in parallel (llguidance drops the GIL).
        compiled = CompiledGrammar(self._build(spec))
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutputSpec) -> LLMatcher:
        grammar = to_llguidance_grammar(spec)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {_NAMES[spec.kind]} does not compile: {_first_lines(matcher.get_error())}")
        return matcher


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def to_llguidance_grammar(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar text of a spec. Raises ValueError for a spec that is not even
    well-formed (a schema that is not a JSON object, a grammar llguidance cannot read)."""
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        if spec.kind == "json":
            return LLMatcher.grammar_from_json_schema(spec.spec, defaults=_JSON_OPTIONS)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            # Each choice is a literal, never a pattern: JSON string syntax is Lark's literal syntax.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
        return llguidance.grammar_from("grammar", spec.spec)  # EBNF (GBNF) converted to Lark, or Lark
    except ValueError as error:
        raise ValueError(f"the {_NAMES[spec.kind]} is not valid: {_first_lines(str(error))}") from None


def _first_lines(message: str, max_lines: int = 6) -> str:
    """llguidance's errors end with parser state and the whole grammar: keep the head."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return "\n".join(lines[:max_lines])
