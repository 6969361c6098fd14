from hypha.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_PEER_UNKNOWN: _ClassVar[ErrorCode]
    ERROR_CODE_FRAME_TOO_LARGE: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_FRAME: _ClassVar[ErrorCode]
    ERROR_CODE_FORBIDDEN: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_PEER_UNKNOWN: ErrorCode
ERROR_CODE_FRAME_TOO_LARGE: ErrorCode
ERROR_CODE_BAD_FRAME: ErrorCode
ERROR_CODE_FORBIDDEN: ErrorCode

class Hello(_message.Message):
    __slots__ = ("addresses", "name")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    name: str
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ...) -> None: ...

class Subscribe(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class Unsubscribe(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class Publish(_message.Message):
    __slots__ = ("topic", "payload", "message_id")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    topic: str
    payload: bytes
    message_id: str
    def __init__(self, topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., message_id: _Optional[str] = ...) -> None: ...

class Send(_message.Message):
    __slots__ = ("to_peer", "payload", "message_id", "channel")
    TO_PEER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    to_peer: str
    payload: bytes
    message_id: str
    channel: str
    def __init__(self, to_peer: _Optional[str] = ..., payload: _Optional[bytes] = ..., message_id: _Optional[str] = ..., channel: _Optional[str] = ...) -> None: ...

class ClientFrame(_message.Message):
    __slots__ = ("hello", "subscribe", "unsubscribe", "publish", "send", "ping")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    UNSUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    subscribe: Subscribe
    unsubscribe: Unsubscribe
    publish: Publish
    send: Send
    ping: Ping
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., subscribe: _Optional[_Union[Subscribe, _Mapping]] = ..., unsubscribe: _Optional[_Union[Unsubscribe, _Mapping]] = ..., publish: _Optional[_Union[Publish, _Mapping]] = ..., send: _Optional[_Union[Send, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("gateway_id", "peer_id")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    peer_id: str
    def __init__(self, gateway_id: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("from_peer", "from_role", "topic", "payload", "message_id", "direct", "from_cert_serial", "from_cert_issuer", "from_cert_issuer_key_id")
    FROM_PEER_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    FROM_CERT_SERIAL_FIELD_NUMBER: _ClassVar[int]
    FROM_CERT_ISSUER_FIELD_NUMBER: _ClassVar[int]
    FROM_CERT_ISSUER_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    from_peer: str
    from_role: _common_pb2.Role
    topic: str
    payload: bytes
    message_id: str
    direct: bool
    from_cert_serial: bytes
    from_cert_issuer: str
    from_cert_issuer_key_id: bytes
    def __init__(self, from_peer: _Optional[str] = ..., from_role: _Optional[_Union[_common_pb2.Role, str]] = ..., topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., message_id: _Optional[str] = ..., direct: _Optional[bool] = ..., from_cert_serial: _Optional[bytes] = ..., from_cert_issuer: _Optional[str] = ..., from_cert_issuer_key_id: _Optional[bytes] = ...) -> None: ...

class GatewayError(_message.Message):
    __slots__ = ("code", "message", "message_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    message_id: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class ServerFrame(_message.Message):
    __slots__ = ("welcome", "delivery", "error", "pong")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    delivery: Delivery
    error: GatewayError
    pong: Pong
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., delivery: _Optional[_Union[Delivery, _Mapping]] = ..., error: _Optional[_Union[GatewayError, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class PeerPresence(_message.Message):
    __slots__ = ("gateway_id", "attached", "detached", "full")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    attached: _containers.RepeatedCompositeFieldContainer[_common_pb2.PeerInfo]
    detached: _containers.RepeatedScalarFieldContainer[str]
    full: bool
    def __init__(self, gateway_id: _Optional[str] = ..., attached: _Optional[_Iterable[_Union[_common_pb2.PeerInfo, _Mapping]]] = ..., detached: _Optional[_Iterable[str]] = ..., full: _Optional[bool] = ...) -> None: ...

class Forward(_message.Message):
    __slots__ = ("message_id", "origin_gateway", "hops", "delivery", "to_peer")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_GATEWAY_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    TO_PEER_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    origin_gateway: str
    hops: int
    delivery: Delivery
    to_peer: str
    def __init__(self, message_id: _Optional[str] = ..., origin_gateway: _Optional[str] = ..., hops: _Optional[int] = ..., delivery: _Optional[_Union[Delivery, _Mapping]] = ..., to_peer: _Optional[str] = ...) -> None: ...

class Bounce(_message.Message):
    __slots__ = ("to_peer", "error", "hops")
    TO_PEER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    to_peer: str
    error: GatewayError
    hops: int
    def __init__(self, to_peer: _Optional[str] = ..., error: _Optional[_Union[GatewayError, _Mapping]] = ..., hops: _Optional[int] = ...) -> None: ...

class FederationFrame(_message.Message):
    __slots__ = ("presence", "forward", "bounce")
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    BOUNCE_FIELD_NUMBER: _ClassVar[int]
    presence: PeerPresence
    forward: Forward
    bounce: Bounce
    def __init__(self, presence: _Optional[_Union[PeerPresence, _Mapping]] = ..., forward: _Optional[_Union[Forward, _Mapping]] = ..., bounce: _Optional[_Union[Bounce, _Mapping]] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[_common_pb2.PeerInfo]
    def __init__(self, peers: _Optional[_Iterable[_Union[_common_pb2.PeerInfo, _Mapping]]] = ...) -> None: ...

class RelayStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("call_id", "seq", "open", "message", "half_close", "status", "cancel", "timeout_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HALF_CLOSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    seq: int
    open: str
    message: bytes
    half_close: bool
    status: RelayStatus
    cancel: bool
    timeout_s: float
    def __init__(self, call_id: _Optional[str] = ..., seq: _Optional[int] = ..., open: _Optional[str] = ..., message: _Optional[bytes] = ..., half_close: _Optional[bool] = ..., status: _Optional[_Union[RelayStatus, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...
