from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("role", "address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("address", "drain")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    address: str
    drain: bool
    def __init__(self, address: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
