"""Hypothesis strategies built from protobuf descriptors, and the list of every RPC we serve.

No maintained library generates protobuf messages for hypothesis
(``hypothesis-protobuf`` stopped in 2015), so this walks the descriptor:
each field gets a strategy for its type, repeated fields short lists, maps
short dicts, one field of a oneof at most, and nested messages recurse to a
small depth. Values favour the edges a parser meets (empty, huge, negative,
NUL and non-ASCII text, path-like strings) rather than uniform noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor as pbd
from google.protobuf import message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import strategies as st

from hypha.net.policy import allowed_roles
from hypha.pki.identity import Role
from hypha.v1 import data_pb2, gateway_pb2, scheduler_pb2, worker_pb2

FD = pbd.FieldDescriptor

#: Strings a handler might treat as ids, names or paths; mixed with random text.
_TRICKY_TEXT = st.sampled_from(
    ["", ".", "..", "../../etc/passwd", "/etc/passwd", "a/../../b", "\x00", "job-1", "*", "%s%n", "é" * 300]
)
_TEXT = st.one_of(_TRICKY_TEXT, st.text(max_size=40))
_INT64 = st.one_of(st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
_UINT64 = st.one_of(st.sampled_from([0, 1, 2**64 - 1]), st.integers(0, 2**64 - 1))
_INT32 = st.one_of(st.sampled_from([0, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
_UINT32 = st.integers(0, 2**32 - 1)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=32)
_DOUBLE = st.one_of(st.sampled_from([0.0, -1.0, 1e308]), st.floats(allow_nan=True, allow_infinity=True))
_BYTES = st.one_of(st.just(b""), st.binary(max_size=64), st.just(b"\xff" * 2048))

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FD.TYPE_STRING: _TEXT,
    FD.TYPE_BYTES: _BYTES,
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_INT64: _INT64,
    FD.TYPE_SINT64: _INT64,
    FD.TYPE_SFIXED64: _INT64,
    FD.TYPE_UINT64: _UINT64,
    FD.TYPE_FIXED64: _UINT64,
    FD.TYPE_INT32: _INT32,
    FD.TYPE_SINT32: _INT32,
    FD.TYPE_SFIXED32: _INT32,
    FD.TYPE_UINT32: _UINT32,
    FD.TYPE_FIXED32: _UINT32,
    FD.TYPE_FLOAT: _FLOAT,
    FD.TYPE_DOUBLE: _DOUBLE,
}


def _value(field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    if field.type == FD.TYPE_ENUM:
        # Known values and unknown numbers alike: proto3 enums are open.
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 1000))
    return _SCALARS[field.type]


def _is_map(field: pbd.FieldDescriptor) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry and field.is_repeated


@st.composite
def _fill(draw: st.DrawFn, desc: pbd.Descriptor, depth: int) -> Message:
    cls = message_factory.GetMessageClass(desc)
    msg = cls()
    chosen_oneof = {o.name: draw(st.sampled_from([None, *o.fields])) for o in desc.oneofs}
    for field in desc.fields:
        oneof = field.containing_oneof
        if oneof is not None and chosen_oneof.get(oneof.name) is not field:
            continue
        if oneof is None and not draw(st.booleans()):
            continue  # leave most fields at their default, as real requests do
        if depth > 3 and field.type == FD.TYPE_MESSAGE:
            continue
        if _is_map(field):
            key_f = field.message_type.fields_by_name["key"]
            val_f = field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_value(key_f, depth), _value(val_f, depth), max_size=3))
            target = getattr(msg, field.name)
            for k, v in entries.items():
                if val_f.type == FD.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            items = draw(st.lists(_value(field, depth), max_size=3))
            target = getattr(msg, field.name)
            if field.type == FD.TYPE_MESSAGE:
                for item in items:
                    target.add().CopyFrom(item)
            else:
                target.extend(items)
        elif field.type == FD.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(_value(field, depth)))
        else:
            setattr(msg, field.name, draw(_value(field, depth)))
    return msg


def messages(desc: pbd.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Random, often malformed (in meaning, never in encoding) messages of type ``desc``."""
    return _fill(desc, depth)


#: Raw request bodies: random bytes, truncated varints, huge length prefixes, empty.
garbage = st.one_of(
    st.binary(max_size=256),
    st.sampled_from([b"", b"\x0a", b"\x0a\xff\xff\xff\xff\x0f", b"\x08\x80\x80\x80", b"\xff" * 64]),
)


@dataclass(frozen=True)
class Rpc:
    """One method of one service, with what a fuzzer needs to call it."""

    service: str
    method: pbd.MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def streams_in(self) -> bool:
        return bool(self.method.client_streaming)

    @property
    def streams_out(self) -> bool:
        return bool(self.method.server_streaming)

    @property
    def caller(self) -> Role:
        """A role the policy lets through, so fuzz input reaches the handler and not just the guard."""
        roles = allowed_roles(self.path)
        for preferred in (Role.SCHEDULER, Role.WORKER, Role.CLIENT, Role.GATEWAY, Role.ADMIN, Role.DATA):
            if preferred in roles:
                return preferred
        raise AssertionError(f"no role may call {self.path}")

    def __str__(self) -> str:
        return self.path


def every_rpc() -> list[Rpc]:
    """Every method of every service in libs/hypha/v1 (a new RPC is fuzzed without editing this),
    and the standard health and reflection services every node serves."""
    rpcs: list[Rpc] = []
    for module in (data_pb2, gateway_pb2, scheduler_pb2, worker_pb2, health_pb2, reflection_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            rpcs.extend(Rpc(service.full_name, m) for m in service.methods)
    return rpcs
