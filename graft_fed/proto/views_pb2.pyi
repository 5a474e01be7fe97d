from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PublishSummariesView(_message.Message):
    __slots__ = ("summaries",)
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    summaries: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, summaries: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SummaryListsView(_message.Message):
    __slots__ = ("lengths", "mean_logprobs")
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    lengths: _containers.RepeatedScalarFieldContainer[bytes]
    mean_logprobs: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lengths: _Optional[_Iterable[bytes]] = ..., mean_logprobs: _Optional[_Iterable[bytes]] = ...) -> None: ...
