"""The OpenAI REST API's request and response objects (pydantic v2), in the order
of the OpenAI spec, plus the extras vLLM users rely on (``top_k``, ``min_p``, ...).

Requests accept unknown fields (clients and benchmark tools send them); the
gateway logs and ignores them. Pydantic stays at this edge: handlers convert a
request into ``engine.sampling_params.SamplingParams`` once and pass nothing
pydantic inward.

Every number is bounded here. Integers travel to the instances in int32 / int64
protobuf fields, so a value that fits Python but not the wire is refused as a
400 naming the field, before the request takes a slot; floats must be finite
(Python's JSON parser accepts ``Infinity`` and ``NaN``). Ranges that depend on
the model or on flags (context length, vocabulary, stop-string limits) are
checked where those are known.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # top-N alternatives per token, as in vLLM
MAX_N = 128  # OpenAI's bound on n (this server serves n = 1; the bound keeps the error a 400 for any int)
MAX_MESSAGES = 2048  # in one conversation; each is a model to build (OpenAI's error: an array too long)
MAX_CACHE_SALT_CHARS = 1024  # vLLM suggests 43 characters (256 random bits, base64)

Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
NonNegativeInt32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
PositiveInt32 = Annotated[int, Field(ge=1, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = NonNegativeInt32  # checked against the vocabulary later, where the tokenizer is known
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


def _prompt_shape(value: Any) -> str | None:
    """Which of the prompt's four shapes ``value`` has, from its first element: pydantic then
    validates that one alone. Left to try every member (its smart mode), it tried ``list[str]``
    on every id of a list of ids first, and recorded an error for each element in each member
    that failed (docs/benchmarks.md, "Request bodies and the event loop")."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None  # refused as none of the four
    first = value[0] if value else 0
    if isinstance(first, list):
        return "list[list[int]]"
    if isinstance(first, str):
        return "list[str]"
    return "list[int]" if isinstance(first, int) else None


# The tags are pydantic's own names of the members, which error locations leave out (gateway/errors.py).
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[int], Tag("list[int]")]
    | Annotated[list[list[int]], Tag("list[list[int]]")],
    Discriminator(
        _prompt_shape,
        custom_error_type="prompt_shape",
        custom_error_message="Input should be a string, "
        "a list of strings, a list of token ids or a list of lists of token ids",
    ),
]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's shape."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None  # OpenAI requires it; this server only logs it
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these. Fields this server does not
    support (``structural_tag``, ...) are refused rather than ignored: ignoring one
    would return unconstrained output to a client that asked for a format."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingExtras(OpenAIRequest):
    """Fields both endpoints share, beyond OpenAI's own (named as in vLLM)."""

    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # 0 or -1 disables it
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt32 = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int32 = 0  # lower runs first; nonzero only with the gateway's --enable-priority
    cache_salt: CacheSalt | None = (
        None  # vLLM's: salts the prefix-cache hashes, so only requests with the same salt share blocks
    )
    # Structured outputs (gateway/structured_request.py turns these into one spec). OpenAI's
    # response_format (vLLM takes it on completions too), vLLM's structured_outputs, and
    # vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingExtras):
    # The order of https://platform.openai.com/docs/api-reference/completions/create
    model: str | None = None
    prompt: Prompt
    best_of: PositiveInt32 | None = None
    echo: bool = False
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: PositiveInt32 | None = 16
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingExtras):
    # The order of https://platform.openai.com/docs/api-reference/chat/create
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = None
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: PositiveInt32 | None = None
    max_tokens: PositiveInt32 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # extras (vLLM's names)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# ------------------------------------------------------------------ responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per output token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop token id or string that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------- the rest


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "splitserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(OpenAIRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIRequest):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
