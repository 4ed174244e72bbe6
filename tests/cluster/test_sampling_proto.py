"""SamplingParams to protobuf and back: every structured output kind survives the trip as its text."""

from __future__ import annotations

import pytest

from cluster.sampling_proto import sampling_params_from_proto, sampling_params_to_proto
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec
from splitserve.v1 import generation_pb2


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (None, None),
        (StructuredOutputSpec.from_json_schema({"type": "object", "properties": {"b": {}, "a": {}}}), "json_schema"),
        (StructuredOutputSpec("json_object"), "json_object"),
        (StructuredOutputSpec("regex", r"\d+"), "regex"),
        (StructuredOutputSpec.from_choices(["a", "b c", '"quoted"']), "choice"),
        (StructuredOutputSpec("grammar", 'root ::= "x"'), "grammar"),
    ],
)
def test_structured_outputs_travel_in_the_oneof(spec: StructuredOutputSpec | None, field: str | None) -> None:
    message = sampling_params_to_proto(SamplingParams(temperature=0.0, structured=spec))
    assert message.WhichOneof("structured") == field
    wire = generation_pb2.SamplingParams.FromString(message.SerializeToString())
    assert sampling_params_from_proto(wire).structured == spec  # the same cache key on every side


def test_a_malformed_oneof_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="json_object must be true"):
        sampling_params_from_proto(generation_pb2.SamplingParams(json_object=False))
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        sampling_params_from_proto(generation_pb2.SamplingParams(choice=generation_pb2.Choices()))
    with pytest.raises(ValueError, match="the structured output regex is empty"):
        sampling_params_from_proto(generation_pb2.SamplingParams(regex=""))
