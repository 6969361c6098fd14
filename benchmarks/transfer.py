"""Δ transfer: a 100 MB state dict from a trainer's worker to the parameter
server's worker over mTLS gRPC (the real TensorExchange on both ends: 1 MiB
chunks, sha256, verified before it is queued; above 64 MiB spooled to disk as it arrives), beside a raw TLS
socket moving the same bytes between the same two processes' worth of
certificates, in the same run.

    python benchmarks/transfer.py [--quick]

figure = our throughput (MiB/s, median), baseline = raw TLS throughput, ratio = ours/baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import median, report, temp_pki

MB = 1024 * 1024


class _Connector:
    """A direct channel to the one peer (what PeerConnector gives when the address is reachable)."""

    def __init__(self, tls: Any, address: str) -> None:
        from hypha.net.channel import secure_channel

        self.direct = secure_channel(tls, address)

    async def channel(self, peer_id: str, addresses: list[str]) -> Any:
        return self.direct

    async def invalidate(self, peer_id: str) -> None:
        return None


def _raw_server(pki: Any, size: int, ready: threading.Event, port: list[int]) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    paths = pki.paths("worker")
    ctx.load_cert_chain(paths.cert, paths.key)
    ctx.load_verify_locations(paths.trust)
    ctx.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))
    port.append(listener.getsockname()[1])
    ready.set()
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(conn, server_side=True) as tls:
            buf = bytearray(MB)
            got = 0
            while got < size:
                n = tls.recv_into(buf)
                if n == 0:
                    break
                got += n
            tls.sendall(b"k")


def _raw_send(pki: Any, port: int, data: bytes) -> float:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    paths = pki.paths("worker")
    ctx.load_cert_chain(paths.cert, paths.key)
    ctx.load_verify_locations(paths.trust)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            tls.sendall(data)
            assert tls.recv(1) == b"k"
    return len(data) / MB / (time.perf_counter() - start)


async def main(quick: bool) -> None:
    import torch

    from hypha.memtune import tune_malloc
    from hypha.net.server import NodeServer
    from hypha.tensors.payload import encode_state
    from hypha.v1 import worker_pb2_grpc
    from hypha.worker.job_manager import JobManager
    from hypha.worker.jobs_config import JobsSection
    from hypha.worker.jobs_servicer import WorkerJobs, WorkerJobsMixin
    from hypha.worker.transfer import TensorExchange

    tune_malloc()  # as every node process does (hypha.cli.node)
    repeats = 3 if quick else 7
    pki = temp_pki()
    state = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(25)}  # 25 x 4 MiB = 100 MiB
    data = encode_state(state)
    path = Path(tempfile.mkdtemp(prefix="hypha-transfer-")) / "delta.safetensors"
    path.write_bytes(data)

    receiver = TensorExchange(None)
    receiver.open_job("bench")

    def no_scheduler(dispatch: object) -> Any:
        raise AssertionError("the benchmark dispatches no job")

    # The worker's real handlers: the push passes the same membership check as on a node
    # (a job opened by hand has no dispatch, so any authenticated worker may push to it).
    manager = JobManager(JobsSection(), path.parent / "work", exchange=receiver, link_factory=no_scheduler)
    jobs = WorkerJobs(manager, receiver, lease_ok=lambda lease, scheduler: False)

    class PsWorker(WorkerJobsMixin, worker_pb2_grpc.WorkerServicer):
        def __init__(self) -> None:
            self.jobs = jobs

    server = NodeServer(
        pki.tls("worker"),
        "127.0.0.1:0",
        [(worker_pb2_grpc.add_WorkerServicer_to_server, PsWorker(), "hypha.v1.Worker")],
    )
    await server.start()
    connector = _Connector(pki.tls("worker"), server.address)
    sender = TensorExchange(connector)  # type: ignore[arg-type]
    ready, port = threading.Event(), []
    threading.Thread(target=_raw_server, args=(pki, len(data), ready, port), daemon=True).start()
    ready.wait(10)

    async def ours(check: bool = False) -> float:
        start = time.perf_counter()
        accepted, message = await sender.send(
            "bench", server.tls.identity.peer_id, [server.address], "delta", 1, 100, path
        )
        assert accepted, message
        got = await receiver.next_received("bench", "delta", 60)
        # The receiver verified the sha256 of the whole payload before queueing it; above
        # memory_payload_bytes it lies in a spool file, as a real 100 MB delta does.
        assert got is not None and got.nbytes == len(data)
        elapsed = time.perf_counter() - start
        if check:
            assert got.read() == data, "received payload differs"
        got.release()
        return len(data) / MB / elapsed

    try:
        await ours(check=True)
        ours_runs = [await ours() for _ in range(repeats)]
        _raw_send(pki, port[0], data)
        raw_runs = [await asyncio.to_thread(_raw_send, pki, port[0], data) for _ in range(repeats)]
    finally:
        await connector.direct.close()
        await server.stop(0)
    figure, base = median(ours_runs), median(raw_runs)
    report(
        "transfer",
        figure,
        "MiB/s",
        base,
        figure / base,
        payload_mib=round(len(data) / MB, 1),
        ours_mib_s=[round(x, 1) for x in ours_runs],
        raw_tls_mib_s=[round(x, 1) for x in raw_runs],
        repeats=repeats,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(parser.parse_args().quick))
