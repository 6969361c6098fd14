"""Δ transfer: a 100 MB state dict from a trainer's worker to the parameter
server's worker over mTLS gRPC (the real TensorExchange on both ends: 1 MiB
chunks, sha256, verified before it is queued; above 64 MiB spooled to disk as it arrives), beside a raw TLS
socket moving the same bytes with the same certificates, in the same run.

    python benchmarks/transfer.py [--quick] [--one-process]

As deployed, sender and receiver are two processes: the receiving worker (its
gRPC server and the worker's real push handler; it drains each verified payload
and compares the first with the sender's bytes) is a child process
(``transfer.py --serve-receiver``), and so is the raw TLS receiver
(``--serve-raw``); the sending side stays in this process. ``--one-process``
runs both ends in this one process and event loop (the mode of the earlier
figures in docs/performance.md; the JSON's ``mode`` says which ran).

Then the pulls: the receiving worker publishes the first payload it checked as the job's
global state, as a parameter server's worker publishes θ_global, and this process pulls it
(``TensorExchange.fetch``, verified and spooled like a trainer's pull), one puller at a time
(``pull_mib_s``) and four at once (``pull_4_mib_s``, their MiB/s together).
``serving_cpu_s_per_gib`` is the serving process's CPU seconds per GiB pulled from it (the
whole process's in ``--one-process`` mode, pullers included).

figure = our push throughput (MiB/s, median), baseline = raw TLS throughput, ratio = ours/baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import Child, median, report, start_child, temp_pki

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


def _raw_server(pki_dir: Path, size: int, ready: threading.Event, port: list[int]) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki_dir / "worker-cert.pem", pki_dir / "worker-key.pem")
    ctx.load_verify_locations(pki_dir / "worker-trust.pem")
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


def _receiver_server(tls: Any, receiver: Any, work_dir: Path) -> Any:
    """A NodeServer with the worker's real push handler in front of ``receiver``: the push passes
    the same membership check as on a node (a job opened by hand has no dispatch, so any
    authenticated worker may push to it)."""
    from hypha.net.server import NodeServer
    from hypha.v1 import worker_pb2_grpc
    from hypha.worker.job_manager import JobManager
    from hypha.worker.jobs_config import JobsSection
    from hypha.worker.jobs_servicer import WorkerJobs, WorkerJobsMixin
    from hypha.worker.tensor_frames import add_worker_servicer

    def no_scheduler(dispatch: object) -> Any:
        raise AssertionError("the benchmark dispatches no job")

    manager = JobManager(JobsSection(), work_dir, exchange=receiver, link_factory=no_scheduler)
    jobs = WorkerJobs(manager, receiver, lease_ok=lambda lease, scheduler: False)

    class PsWorker(WorkerJobsMixin, worker_pb2_grpc.WorkerServicer):
        def __init__(self) -> None:
            self.jobs = jobs

    return NodeServer(tls, "127.0.0.1:0", [(add_worker_servicer, PsWorker(), "hypha.v1.Worker")])


async def serve_receiver(pki_dir: Path, sha256: str) -> None:
    """The receiving worker's process: prints its address and peer id, then "checked" once the
    first payload's bytes matched ``sha256``; drains every later one; stops on SIGTERM."""
    from hypha.memtune import tune_malloc
    from hypha.net.tls import PathsTls, TlsMaterial
    from hypha.worker.transfer import TensorExchange

    tune_malloc()  # as every node process does (hypha.cli.node)
    tls = TlsMaterial.load(PathsTls.from_certs_dir(pki_dir, "worker"))
    receiver = TensorExchange(None)
    receiver.open_job("bench")
    scratch = tempfile.TemporaryDirectory(prefix="hypha-transfer-rx-")
    server = _receiver_server(tls, receiver, Path(scratch.name))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    kept: list[Any] = []

    async def drain() -> None:
        while True:
            got = await receiver.next_received("bench", "delta", 3600)
            if got is None:
                continue
            if kept:
                got.release()
                continue
            # The exchange verified the sender's sha256; this checks the bytes kept, which are
            # then published for the pulls, as a parameter server publishes θ_global.
            kept.append(got)
            same = hashlib.sha256(await asyncio.to_thread(got.read)).hexdigest() == sha256
            await _publish(receiver, got, Path(scratch.name))
            print("checked" if same else "received payload differs", flush=True)

    async def answer() -> None:  # "cpu": this process's CPU seconds so far
        stdin = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        while line := (await stdin.readline()).decode().strip():
            if line == "cpu":
                print(time.process_time(), flush=True)

    await server.start()
    tasks = [asyncio.create_task(drain()), asyncio.create_task(answer())]
    try:
        print(json.dumps({"address": server.address, "peer_id": tls.identity.peer_id}), flush=True)
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await server.stop(0)
        for got in kept:
            got.release()
        scratch.cleanup()


async def _publish(exchange: Any, payload: Any, scratch: Path) -> None:
    """Publish a received payload as the job's global state (its spool file, or a file of it)."""
    path = payload.path
    if path is None:
        path = scratch / "global.safetensors"
        await asyncio.to_thread(path.write_bytes, payload.read())
    await exchange.publish("bench", "global", 1, path)


def serve_raw(pki_dir: Path, size: int) -> None:
    """The raw TLS receiver's process: prints its port, then serves until SIGTERM."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # for sigwait, in every thread
    ready, port = threading.Event(), []
    threading.Thread(target=_raw_server, args=(pki_dir, size, ready, port), daemon=True).start()
    ready.wait(10)
    print(port[0], flush=True)
    signal.sigwait({signal.SIGTERM})


async def main(quick: bool, one_process: bool) -> None:
    import torch

    from hypha.memtune import tune_malloc
    from hypha.tensors.payload import encode_state
    from hypha.worker.transfer import TensorExchange

    tune_malloc()  # as every node process does (hypha.cli.node)
    repeats = 3 if quick else 7
    pki = temp_pki()
    state = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(25)}  # 25 x 4 MiB = 100 MiB
    data = encode_state(state)
    scratch = tempfile.TemporaryDirectory(prefix="hypha-transfer-")  # the 100 MB file goes with it
    path = Path(scratch.name) / "delta.safetensors"
    path.write_bytes(data)
    children: list[Child] = []
    kept: list[Any] = []  # the payload published for the pulls (one-process mode)
    receiver: Any = None
    server: Any = None
    try:
        if one_process:
            receiver = TensorExchange(None)
            receiver.open_job("bench")
            server = _receiver_server(pki.tls("worker"), receiver, path.parent / "work")
            await server.start()
            address, peer_id = server.address, server.tls.identity.peer_id
            ready, port = threading.Event(), []
            threading.Thread(target=_raw_server, args=(pki.dir, len(data), ready, port), daemon=True).start()
            ready.wait(10)
            raw_port = port[0]
        else:
            digest = hashlib.sha256(data).hexdigest()
            here = (sys.executable, __file__, "--pki", str(pki.dir))
            rx, line = await start_child(
                "receiver", *here, "--serve-receiver", "--sha256", digest, stdin=True
            )
            children.append(rx)
            info = json.loads(line)
            address, peer_id = info["address"], info["peer_id"]
            raw, line = await start_child("raw TLS receiver", *here, "--serve-raw", "--size", str(len(data)))
            children.append(raw)
            raw_port = int(line)
        connector = _Connector(pki.tls("worker"), address)
        sender = TensorExchange(connector)  # type: ignore[arg-type]

        async def ours(check: bool = False) -> float:
            start = time.perf_counter()
            # Accepted means the receiver verified the sha256 of the whole payload and queued it
            # (above memory_payload_bytes it lies in a spool file, as a real 100 MB delta does).
            accepted, message = await sender.send("bench", peer_id, [address], "delta", 1, 100, path)
            assert accepted, message
            if receiver is not None:
                got = await receiver.next_received("bench", "delta", 60)
                assert got is not None and got.nbytes == len(data)
                if check:
                    assert got.read() == data, "received payload differs"
                    await _publish(receiver, got, path.parent)
                    kept.append(got)
                else:
                    got.release()
            elapsed = time.perf_counter() - start
            if check and receiver is None:
                assert children[0].proc.stdout is not None
                verdict = await asyncio.wait_for(children[0].proc.stdout.readline(), 60)
                assert verdict.strip() == b"checked", verdict.decode(errors="replace")
            return len(data) / MB / elapsed

        async def pulls(count: int) -> float:
            """``count`` trainers pulling the published state at once: their MiB/s together."""
            start = time.perf_counter()
            got = await asyncio.gather(
                *(sender.fetch("bench", peer_id, [address], "global", 1, 60) for _ in range(count))
            )
            elapsed = time.perf_counter() - start
            for payload in got:
                assert payload is not None and payload.nbytes == len(data)
                payload.release()
            return count * len(data) / MB / elapsed

        async def server_cpu() -> float:
            return float(await children[0].ask("cpu")) if children else time.process_time()

        try:
            await ours(check=True)
            ours_runs = [await ours() for _ in range(repeats)]
            _raw_send(pki, raw_port, data)
            raw_runs = [await asyncio.to_thread(_raw_send, pki, raw_port, data) for _ in range(repeats)]
            cpu_before = await server_cpu()
            pull_runs = [await pulls(1) for _ in range(repeats)]
            pull_4_runs = [await pulls(4) for _ in range(repeats)]
            pulled_gib = 5 * repeats * len(data) / (1 << 30)
            serving_cpu_s_per_gib = (await server_cpu() - cpu_before) / pulled_gib
        finally:
            await connector.direct.close()
    finally:
        for payload in kept:
            payload.release()
        if server is not None:
            await server.stop(0)
        for child in children:
            await child.stop()
        scratch.cleanup()
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
        pull_mib_s=round(median(pull_runs), 1),
        pull_4_mib_s=round(median(pull_4_runs), 1),
        pull_samples={"1": [round(x, 1) for x in pull_runs], "4": [round(x, 1) for x in pull_4_runs]},
        serving_cpu_s_per_gib=round(serving_cpu_s_per_gib, 3),
        repeats=repeats,
        mode="one-process" if one_process else "processes",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--one-process", action="store_true", help="sender and receivers in this one process (old mode)"
    )
    parser.add_argument("--serve-receiver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pki", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sha256", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.serve_receiver:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_receiver(args.pki, args.sha256))
    elif args.serve_raw:
        serve_raw(args.pki, args.size)
    else:
        asyncio.run(main(args.quick, args.one_process))
