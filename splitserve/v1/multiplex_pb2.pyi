from splitserve.v1 import disaggregation_pb2 as _disaggregation_pb2
from splitserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MuxMetadatum(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class MuxCall(_message.Message):
    __slots__ = ("call_id", "decode", "generate", "cancel", "metadata")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    decode: _disaggregation_pb2.DecodeRequest
    generate: _generation_pb2.GenerateRequest
    cancel: bool
    metadata: _containers.RepeatedCompositeFieldContainer[MuxMetadatum]
    def __init__(self, call_id: _Optional[int] = ..., decode: _Optional[_Union[_disaggregation_pb2.DecodeRequest, _Mapping]] = ..., generate: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., cancel: bool = ..., metadata: _Optional[_Iterable[_Union[MuxMetadatum, _Mapping]]] = ...) -> None: ...

class MuxCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[MuxCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[MuxCall, _Mapping]]] = ...) -> None: ...

class MuxEnd(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class MuxEvent(_message.Message):
    __slots__ = ("call_id", "decode", "generate", "end")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    decode: _disaggregation_pb2.DecodeResponse
    generate: _generation_pb2.GenerateResponse
    end: MuxEnd
    def __init__(self, call_id: _Optional[int] = ..., decode: _Optional[_Union[_disaggregation_pb2.DecodeResponse, _Mapping]] = ..., generate: _Optional[_Union[_generation_pb2.GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[MuxEnd, _Mapping]] = ...) -> None: ...

class MuxEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[MuxEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[MuxEvent, _Mapping]]] = ...) -> None: ...
