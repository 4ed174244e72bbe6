"""Structured outputs at the edge: the request's fields to one spec, checked before dispatch.

A request may ask for a format in three dialects — OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and vLLM's older ``guided_*`` fields — and may use
only one of them, for one format. The spec is compiled here, on a work pool of its
own (``gateway/work_pool.py``: bounded, fair between clients, so a flood of huge
grammars never delays tokenizing), so an invalid schema, regex or grammar is a 400
naming the problem before any instance is touched. A compile that runs past
``--grammar-compile-timeout`` is a 400 too; llguidance cannot be interrupted, so its
worker stays taken until the compile ends (llguidance's own limits bound it). Compiled
grammars are cached by (kind, spec) in a bounded LRU; instances compile again from the
spec (nothing compiled is sent).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from engine.structured_output.compiler import GrammarCompiler
from engine.structured_output.spec import StructuredOutputSpec
from gateway.errors import bad_request
from gateway.gate import ClientId
from gateway.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, StructuredOutputsParams
from gateway.tokenizer import ModelTokenizer
from gateway.work_pool import WorkPool

logger = logging.getLogger(__name__)

NUM_WORKERS = 2  # one client may hold one of them
MAX_WAITING = 64
MAX_WAITING_PER_CLIENT = 16


@dataclass(frozen=True, slots=True)
class StructuredRequest:
    spec: StructuredOutputSpec
    param: str  # the request field it came from, for error messages


def structured_request(request: CompletionRequest | ChatCompletionRequest) -> StructuredRequest | None:
    """The one format a request asks for, or None. Raises APIError 400 for two at once or a malformed one."""
    found: list[StructuredRequest] = []
    try:
        if request.response_format is not None and request.response_format.type != "text":
            found.append(_from_response_format(request.response_format))
        if request.structured_outputs is not None:
            found.extend(_from_structured_outputs(request.structured_outputs))
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(request, name)
            if value is not None:
                found.append(_spec(kind, value, name))
    except ValueError as error:
        raise bad_request(str(error), param=_param_of(error)) from None
    if len(found) > 1:
        raise bad_request(
            f"one structured output per request, but {', '.join(f.param for f in found)} were given; send only one",
            param=found[1].param,
        )
    return found[0] if found else None


def _from_response_format(response_format: ResponseFormat) -> StructuredRequest:
    if response_format.type == "json_object":
        return StructuredRequest(StructuredOutputSpec("json_object"), "response_format")
    param = "response_format.json_schema.schema"
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise _ParamError(
            'response_format of type "json_schema" needs json_schema.schema, the JSON schema of the output '
            '({"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}})',
            param,
        )
    return StructuredRequest(StructuredOutputSpec.from_json_schema(response_format.json_schema.schema_), param)


def _from_structured_outputs(options: StructuredOutputsParams) -> list[StructuredRequest]:
    if options.model_extra:
        raise _ParamError(
            f"structured_outputs.{sorted(options.model_extra)[0]} is not supported by this server; "
            "use one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    found = []
    if options.json_ is not None:
        found.append(_spec("json", options.json_, "structured_outputs.json"))
    for kind in ("regex", "choice", "grammar"):
        value = getattr(options, kind)
        if value is not None:
            found.append(_spec(kind, value, f"structured_outputs.{kind}"))
    if options.json_object:
        found.append(StructuredRequest(StructuredOutputSpec("json_object"), "structured_outputs.json_object"))
    if not found:
        raise _ParamError(
            "structured_outputs is empty; set one of json, regex, choice, grammar, json_object", "structured_outputs"
        )
    return found


def _spec(kind: str, value: object, param: str) -> StructuredRequest:
    try:
        if kind == "json":
            spec = StructuredOutputSpec.from_json_schema(value)  # type: ignore[arg-type]
        elif kind == "choice":
            spec = StructuredOutputSpec.from_choices(value)  # type: ignore[arg-type]
        else:
            spec = StructuredOutputSpec(kind, value)  # type: ignore[arg-type]
    except ValueError as error:
        raise _ParamError(f"{param}: {error}", param) from None
    return StructuredRequest(spec, param)


class _ParamError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _param_of(error: ValueError) -> str | None:
    return error.param if isinstance(error, _ParamError) else None


class GrammarValidator:
    """The gateway's grammar compiler, made on the first structured request (a vocabulary
    of the model's size takes a moment to index), used on its own work pool."""

    def __init__(self, tokenizer: ModelTokenizer, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.pool = WorkPool("grammar", NUM_WORKERS, MAX_WAITING, MAX_WAITING_PER_CLIENT)
        self._compiler: GrammarCompiler | None = None
        self._lock = asyncio.Lock()

    async def check(self, spec: StructuredOutputSpec, param: str, client: ClientId) -> None:
        """Raises APIError 400 naming the problem when ``spec`` does not compile, or not in
        time; 429 when the pool is full."""
        compiler = await self._get_compiler(client)
        try:
            await self.pool.run(client, lambda stop: compiler.compile(spec), self.timeout_s)
        except ValueError as error:
            raise bad_request(f"{param}: {error}", param=param) from None
        except TimeoutError:
            raise bad_request(
                f"{param}: compiling it took over {self.timeout_s} s (--grammar-compile-timeout); simplify it",
                param=param,
            ) from None

    def close(self) -> None:
        self.pool.close()

    async def _get_compiler(self, client: ClientId) -> GrammarCompiler:
        async with self._lock:
            if self._compiler is None:
                self._compiler = await self.pool.run(
                    client, lambda stop: GrammarCompiler.from_hf_tokenizer(self.tokenizer.tokenizer)
                )
            return self._compiler
