"""What both halves of a relayed call share: frames, their message ids, ordering and bounds.

Split from ``relay_client`` (the caller's half) so that ``relay_server`` (the
serving half) and ``relay`` take the framing from one place. Frames of one
direction of one call carry consecutive ``seq`` numbers from 0; ``Sequencer``
puts them back in order and drops duplicates; ``Mailbox`` is a call's bounded
inbox; a frame's message id names its call, so a gateway's refusal of a frame
ends that call (``gateway_error_status``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from hypha.net.messages import Message
from hypha.net.options import CHUNK_BYTES
from hypha.net.wire import Encoded
from hypha.v1 import gateway_pb2

T = TypeVar("T")

#: Largest serialized request or response carried in one frame: one 1 MiB
#: chunk of the stream contracts plus room for the fields around it.
MAX_RELAY_MESSAGE_BYTES = CHUNK_BYTES + 64 * 1024

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The same exception type a direct grpc.aio call raises."""
    return grpc.aio.AioRpcError(
        code, initial_metadata=grpc.aio.Metadata(), trailing_metadata=grpc.aio.Metadata(), details=details
    )


class DirectLink(Protocol):
    """What the relay needs from a node's gateway link (``hypha.net.link.NodeLink``)."""

    @property
    def peer_id(self) -> str: ...

    #: Called with each error frame the gateway sends back; True when the callback owned it.
    on_error: list[Callable[[gateway_pb2.GatewayError], bool]]

    async def send(self, to_peer: str, payload: bytes, channel: str, message_id: str | None = None) -> object:
        """Send a direct message; raises UnavailableError when the gateway link is down.

        A gateway error about it (``on_error``) carries ``message_id``.
        """
        ...

    def direct(self, channel: str) -> AsyncIterator[Message]:
        """Direct messages on ``channel``; one consumer, registered before traffic arrives."""
        ...


@dataclass(frozen=True)
class RelayLimits:
    #: Largest serialized message in one frame; larger ones fail RESOURCE_EXHAUSTED.
    max_message_bytes: int = MAX_RELAY_MESSAGE_BYTES
    #: Relayed calls this node serves at once; more are refused with RESOURCE_EXHAUSTED.
    max_concurrent_calls: int = 64
    #: Of those, how many one caller may hold: one peer cannot take every slot.
    max_calls_per_peer: int = 16
    #: Longest a served call may run: its deadline when the caller set none (``timeout_s = 0``)
    #: or a longer one, so a call never holds a slot for ever.
    max_call_s: float = 3600.0
    #: Messages buffered per call and direction before the dispatcher waits.
    queue_messages: int = 8
    #: How long the dispatcher waits for a call to make room before failing it.
    stall_timeout_s: float = 10.0
    #: Out-of-order frames held per call before the gap counts as loss (UNAVAILABLE).
    reorder_window: int = 64


class FramesLostError(Exception):
    """A gap in a call's frame sequence did not fill within the reorder window."""


class Sequencer:
    """Puts one direction of one call back in ``seq`` order; drops duplicates."""

    def __init__(self, window: int, first: int = 0) -> None:
        self._window = window
        self._next = first
        self._held: dict[int, gateway_pb2.RelayFrame] = {}

    def accept(self, frame: gateway_pb2.RelayFrame) -> list[gateway_pb2.RelayFrame]:
        """The frames now deliverable in order (possibly none); raises FramesLostError."""
        seq = frame.seq
        if seq < self._next or seq in self._held:
            return []
        if seq != self._next:
            if seq - self._next > self._window or len(self._held) >= self._window:
                raise FramesLostError(f"frame {seq} while waiting for {self._next}")
            self._held[seq] = frame
            return []
        ready = [frame]
        self._next += 1
        while self._next in self._held:
            ready.append(self._held.pop(self._next))
            self._next += 1
        return ready


class Mailbox(Generic[T]):
    """A bounded FIFO that ends (drain, then None) or fails (raise at once).

    ``asyncio.Queue`` has no close on Python 3.11; a call's inbox needs one so
    that a deadline or a cancel wakes the reader and the writer immediately.
    """

    def __init__(self, maxsize: int) -> None:
        self._items: deque[T] = deque()
        self._maxsize = max(1, maxsize)
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._closed = False
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    async def put(self, item: T, timeout_s: float | None = None) -> bool:
        """Wait for room (TimeoutError after ``timeout_s``); False when closed (item dropped)."""
        if not self._closed and len(self._items) >= self._maxsize:
            async with asyncio.timeout(timeout_s):
                while not self._closed and len(self._items) >= self._maxsize:
                    self._writable.clear()
                    await self._writable.wait()
        if self._closed:
            return False
        self._items.append(item)
        self._readable.set()
        return True

    async def get(self) -> T | None:
        """The next item; None after a clean close; the close error after a failure."""
        while not self._items and not self._closed:
            self._readable.clear()
            await self._readable.wait()
        if self._error is not None:
            raise self._error
        if self._items:
            item = self._items.popleft()
            self._writable.set()
            return item
        return None

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._error = error
        self._readable.set()
        self._writable.set()


def relay_frame_bytes(header: gateway_pb2.RelayFrame, message: bytes) -> bytes:
    """``header`` (call id and seq) as a message frame carrying ``message``: the same bytes a
    parser reads as ``RelayFrame(message=message, ...)``, without serializing ``message`` twice."""
    return bytes(Encoded.with_field(header, "message", message))


def frame_kind(frame: gateway_pb2.RelayFrame) -> str | None:
    return frame.WhichOneof("kind")


#: Message id prefixes of relay frames: sent by the caller's half, by the serving half.
CLIENT_SIDE, SERVER_SIDE = "rc", "rs"


def frame_message_id(side: str, call_id: str, seq: int) -> str:
    """The link message id of one relay frame: a gateway error about it names the call."""
    return f"{side}.{call_id}.{seq}"


def parse_frame_message_id(message_id: str) -> tuple[str, str] | None:
    """(side, call id) of a relay frame's message id; None for any other message."""
    side, _, rest = message_id.partition(".")
    call_id, _, seq = rest.rpartition(".")
    if side not in (CLIENT_SIDE, SERVER_SIDE) or not call_id or not seq.isdigit():
        return None
    return side, call_id


def gateway_error_status(error: gateway_pb2.GatewayError) -> tuple[grpc.StatusCode, str]:
    """The status a relayed call ends with when a gateway refuses one of its frames."""
    name = gateway_pb2.ErrorCode.Name(error.code) if error.code in gateway_pb2.ErrorCode.values() else "?"
    details = f"gateway refused a relay frame ({name}): {error.message}"
    if error.code == gateway_pb2.ERROR_CODE_FRAME_TOO_LARGE:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, details
    if error.code == gateway_pb2.ERROR_CODE_FORBIDDEN:
        return grpc.StatusCode.PERMISSION_DENIED, details
    # PEER_UNKNOWN (not attached, or not yet re-attached): retryable, like a direct peer that is down.
    return grpc.StatusCode.UNAVAILABLE, details


Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]


def passthrough(value: Any) -> Any:
    return value
