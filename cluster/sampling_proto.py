"""Sampling parameters between the engine's ``SamplingParams`` and protobuf, both
ways. Torch-free: the gateway converts requests with it, instances convert back."""

from __future__ import annotations

import math

from engine.sampling_params import SamplingParams
from engine.structured_output.spec import StructuredOutputSpec
from splitserve.v1 import generation_pb2

# proto3 ``optional`` fields: unset keeps the engine's default.
_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_params_from_proto(message: generation_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields keep the engine's defaults. Raises ValueError for bad values."""
    kwargs: dict[str, object] = {name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)}
    for name in _FLOAT_FIELDS:
        # The engine's range checks let +inf through (temperature >= 0 holds for it).
        if name in kwargs and not math.isfinite(kwargs[name]):  # type: ignore[arg-type]
            raise ValueError(f"{name} must be a finite number, got {kwargs[name]}")
    return SamplingParams(
        **kwargs,  # type: ignore[arg-type]
        min_tokens=message.min_tokens,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        include_stop_str_in_output=message.include_stop_str_in_output,
        structured=_structured_from_proto(message),
    )


def _structured_from_proto(message: generation_pb2.SamplingParams) -> StructuredOutputSpec | None:
    """The spec as sent; whether it compiles is the compiler's to say."""
    kind = message.WhichOneof("structured")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructuredOutputSpec("json", message.json_schema)
    if kind == "json_object":
        if not message.json_object:
            raise ValueError("json_object must be true when set; leave the structured oneof unset for free output")
        return StructuredOutputSpec("json_object")
    if kind == "choice":
        return StructuredOutputSpec.from_choices(list(message.choice.choices))
    return StructuredOutputSpec(kind, getattr(message, kind))  # regex, grammar


def _structured_to_proto(spec: StructuredOutputSpec, message: generation_pb2.SamplingParams) -> None:
    if spec.kind == "json":
        message.json_schema = spec.spec
    elif spec.kind == "json_object":
        message.json_object = True
    elif spec.kind == "choice":
        message.choice.choices.extend(spec.choices)
    else:
        setattr(message, spec.kind, spec.spec)


def sampling_params_to_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    """Everything an instance needs. Stop strings stay with the caller: instances see no text."""
    message = generation_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        skip_special_tokens=params.skip_special_tokens,
    )
    if params.structured is not None:
        _structured_to_proto(params.structured, message)
    return message
