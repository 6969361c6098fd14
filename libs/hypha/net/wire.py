"""Frames that carry one large bytes field, encoded with one copy of that field.

Why (docs/performance.md, ``relay``): with the upb protobuf runtime, a 1 MiB
bytes field costs about 1 ms to ``SerializeToString`` (it is encoded into an
arena, then copied out again), and a message field set from another message
(``Forward(delivery=delivery)``) is serialized and parsed once more. A relayed
chunk crossed five such serializations and four such merges on its way
through two gateways; that, not the network, was most of the relay's cost.

Here a frame is its small header message serialized by protobuf, followed by
the large field encoded by hand: protobuf parsers accept fields in any order,
so the bytes parse to exactly the message the generated code would have built,
and the payload is copied once, by the final ``b"".join``. Field numbers come
from the descriptors, never from literals.

``frame_bytes`` is the serializer of the streams that carry such frames: it
passes pre-encoded bytes through and serializes messages as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

#: What a piece may be: bytes, or a byte-format memoryview (``len`` is its size in bytes).
Piece = bytes | bytearray | memoryview

#: Protobuf wire type of length-delimited fields (bytes, strings, messages).
_LEN = 2


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field_number(message: type[Message] | Message, name: str) -> int:
    """The number of field ``name`` of a message type (KeyError for a field it lacks)."""
    number: int = message.DESCRIPTOR.fields_by_name[name].number
    return number


class Encoded:
    """A message as a list of byte pieces not yet joined, with its total length.

    Nesting (``within``) only prepends a key and a length, so a payload at the
    bottom of three messages is still copied once, by ``bytes(encoded)``.
    """

    __slots__ = ("parts", "size")

    def __init__(self, parts: Sequence[Piece]) -> None:
        self.parts: list[Piece] = list(parts)
        self.size = sum(len(part) for part in self.parts)

    @classmethod
    def with_field(cls, header: Message, name: str, data: Piece) -> Encoded:
        """``header`` (that field left unset) with its bytes or message field ``name`` = ``data``
        (``data``: the field's value already encoded, for a message field)."""
        size = len(data)
        key = varint(field_number(header, name) << 3 | _LEN)
        return cls([header.SerializeToString(), key, varint(size), data])

    def within(self, header: Message, name: str) -> Encoded:
        """``header`` with its message field ``name`` set to this message."""
        key = varint(field_number(header, name) << 3 | _LEN)
        return Encoded([header.SerializeToString(), key, varint(self.size), *self.parts])

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def _varint_at(data: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; ValueError when it runs off the end."""
    value = shift = 0
    while shift < 64:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint too long")


def split_field(data: memoryview, number: int) -> tuple[list[memoryview], memoryview] | None:
    """Take the length-delimited field ``number`` out of the encoded message ``data``.

    Returns (the other fields' encodings, that field's value), all views of
    ``data``: nothing is copied, so a received payload can be re-framed with
    one copy (``Encoded``) instead of a parse and a read that copy it twice.
    None when the field is absent or repeated, or ``data`` is anything but
    plain wire format: the caller then lets protobuf parse it, and refuse it.
    """
    rest: list[memoryview] = []
    found: memoryview | None = None
    pos, end = 0, len(data)
    try:
        while pos < end:
            start = pos
            key, pos = _varint_at(data, pos)
            wire_type = key & 7
            if key >> 3 == number and (wire_type != _LEN or found is not None):
                return None
            if wire_type == 0:
                _, pos = _varint_at(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == _LEN:
                size, pos = _varint_at(data, pos)
                if key >> 3 == number and pos + size <= end:
                    found = data[pos : pos + size]
                pos += size
                if key >> 3 == number:
                    continue
            else:
                return None  # groups: not in our protocol
            if pos > end:
                return None
            rest.append(data[start:pos])
    except ValueError:
        return None
    return None if found is None else (rest, found)


def frame_bytes(frame: Any) -> bytes:
    """Stream serializer: pre-encoded frames pass through, messages are serialized."""
    if isinstance(frame, bytes):
        return frame
    data: bytes = frame.SerializeToString()
    return data


#: A generated ``add_<Service>Servicer_to_server`` function, or one like it.
AddServicer = Callable[[Any, Any], None]


class _Registration:
    """Stands in for a server while generated code registers a service's method handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the generated code registers the same handlers by name as well

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.services[service] = dict(handlers)


def with_codecs(add_servicer: AddServicer, codecs: Mapping[str, Mapping[str, Any]]) -> AddServicer:
    """``add_servicer`` with the named methods' (de)serializers replaced, e.g.
    ``{"StreamSlice": {"response_serializer": frame_bytes}}``: the streams that move large
    payloads send pre-encoded frames and read their payloads as views, the rest stay generated.
    Works for a ``grpc.aio.Server`` and for anything that takes handlers the same way (the relay)."""

    def add(servicer: Any, server: Any) -> None:
        registration = _Registration()
        add_servicer(servicer, registration)
        if not registration.services:
            raise RuntimeError(f"{add_servicer.__name__} registered no method handlers by name")
        for service, handlers in registration.services.items():
            unknown = set(codecs) - set(handlers)
            if unknown:
                raise KeyError(f"{service} has no method {sorted(unknown)}")
            recoded = {name: h._replace(**codecs.get(name, {})) for name, h in handlers.items()}
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, recoded),))
            server.add_registered_method_handlers(service, recoded)

    return add


__all__ = ["AddServicer", "Encoded", "field_number", "frame_bytes", "split_field", "varint", "with_codecs"]
