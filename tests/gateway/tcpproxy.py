"""A TCP proxy on 127.0.0.1:0 that a test can cut, the way a network fails.

- ``reset()``: abort every connection through it (RST: the peer notices at once);
- ``blackhole()``: keep the connections open but stop moving bytes, as when a
  container is taken off its network (nothing notices until a keepalive fails);
- ``restore()``: move bytes again (held ones first) and accept new connections.

``bytes_back`` counts what came back from the target: the bytes on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._forwarding = asyncio.Event()
        self._forwarding.set()
        self.address = ""
        #: Connections accepted so far (a reconnect shows up here).
        self.accepted = 0
        #: Bytes forwarded from the target to the clients.
        self.bytes_back = 0

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def reset(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()

    def blackhole(self) -> None:
        self._forwarding.clear()

    def restore(self) -> None:
        self._forwarding.set()

    async def close(self) -> None:
        self.restore()
        self.reset()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._writers |= pair
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer, back=True)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.wait(pumps)
            for w in pair:
                w.transport.abort()
            self._writers -= pair

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, back: bool = False
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                await self._forwarding.wait()
                if back:
                    self.bytes_back += len(data)
                writer.write(data)
                await writer.drain()
