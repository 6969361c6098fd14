"""Slice serving throughput: a data node streaming verified slices over mTLS gRPC, beside a raw
TLS socket moving the same bytes with the same certificates, in the same run.

    python benchmarks/slices.py [--quick]

Ours: a real data node (``DataNodeServicer`` on a ``NodeServer``) in a child process; readers
call ``StreamSlice`` and put each slice back together with ``ChunkAssembler`` (which checks the
sha256), one channel per reader, slices requested one after another. That is the whole path a
worker pays for: the server reads and hashes the slice file (whole on its first stream, as it
reads on later ones), cuts 1 MiB chunks, gRPC carries them, the reader hashes again, one chunk
behind the wire (``ChunkFeeder``).

Baseline: a child process serving the same slice files over Python ``ssl`` sockets (TLS with
client certificates from the same PKI, one persistent connection per reader, a length prefix
and the raw file bytes, no hashing), read by threads with ``recv_into``: the transport floor.

figure = our single-reader MiB/s (median over rounds); ratio = figure / baseline single-reader
MiB/s. The JSON also carries the four-reader aggregate figures and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import median, report, start_child, temp_pki

MIB = 1024 * 1024
DATASET = "bench"
SLICE_MIB = 4
SAMPLES_PER_SLICE = 4


# ---- servers (child processes) --------------------------------------------------------


async def _serve_ours(pki_dir: Path, data_dir: Path) -> None:
    from hypha.data.servicer import DataNodeServicer, DatasetCatalog, add_data_node_servicer
    from hypha.memtune import tune_malloc
    from hypha.net.server import NodeServer
    from hypha.net.tls import PathsTls, TlsMaterial

    tune_malloc()  # as the data node process does (hypha.cli.node)
    tls = TlsMaterial.load(PathsTls.from_certs_dir(pki_dir, "data"))
    servicer = DataNodeServicer(DatasetCatalog(data_dir))
    server = NodeServer(tls, "127.0.0.1:0", [(add_data_node_servicer, servicer, "hypha.v1.DataNode")])
    port = await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(port, flush=True)
    await stop.wait()
    await server.stop(0)


def _serve_raw(pki_dir: Path, data_dir: Path) -> None:
    from hypha.memtune import tune_malloc

    tune_malloc()  # the same allocator settings as ours, so the floor stays a floor
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki_dir / "data-cert.pem", pki_dir / "data-key.pem")
    ctx.load_verify_locations(pki_dir / "data-trust.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def handle(conn: socket.socket) -> None:
        # Without TCP_NODELAY, Nagle and delayed ACKs add ~40 ms per request-response turn.
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(conn, server_side=True) as tls:
            while True:
                header = _recv_exact(tls, 4)
                if header is None:
                    return
                (index,) = struct.unpack(">I", header)
                data = (data_dir / DATASET / f"slice-{index:06d}.safetensors").read_bytes()
                tls.sendall(struct.pack(">Q", len(data)))
                tls.sendall(data)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


# ---- readers ---------------------------------------------------------------------------------


async def _ours_round(channels: list[Any], plan: list[list[int]]) -> float:
    from hypha.tensors.chunks import ChunkAssembler, ChunkFeeder
    from hypha.v1 import data_pb2
    from hypha.worker.slice_stream import stream_slice

    async def reader(channel: Any, indices: list[int]) -> int:
        call = stream_slice(channel)  # the worker's SliceFetcher's call
        total = 0
        for index in indices:
            assembler = ChunkAssembler(max_bytes=64 * MIB)
            feeder = ChunkFeeder(assembler)  # as the SliceFetcher does
            async for chunk in call(data_pb2.StreamSliceRequest(dataset=DATASET, index=index), timeout=60):
                await feeder.feed(chunk)
            await feeder.flush()
            total += len(assembler.finish())
        return total

    start = time.perf_counter()
    sizes = await asyncio.gather(*(reader(ch, idx) for ch, idx in zip(channels, plan, strict=True)))
    return sum(sizes) / MIB / (time.perf_counter() - start)


def _raw_connect(pki_dir: Path, address: str) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(pki_dir / "worker-cert.pem", pki_dir / "worker-key.pem")
    ctx.load_verify_locations(pki_dir / "worker-trust.pem")
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ctx.wrap_socket(sock, server_hostname=host)


def _raw_round(socks: list[ssl.SSLSocket], plan: list[list[int]]) -> float:
    totals = [0] * len(socks)

    def reader(k: int) -> None:
        sock = socks[k]
        for index in plan[k]:
            sock.sendall(struct.pack(">I", index))
            header = _recv_exact(sock, 8)
            assert header is not None
            (size,) = struct.unpack(">Q", header)
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                got += sock.recv_into(view[got:])
            totals[k] += size

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(len(socks))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(totals) / MIB / (time.perf_counter() - start)


def _plan(readers: int, slices: int, per_reader: int) -> list[list[int]]:
    """Each reader walks the dataset from its own starting point, as workers with different slices do."""
    return [[(r * slices // readers + i) % slices for i in range(per_reader)] for r in range(readers)]


async def main(quick: bool) -> None:
    import torch

    from hypha.datasets.prepare import write_dataset
    from hypha.memtune import tune_malloc
    from hypha.net.channel import secure_channel

    tune_malloc()  # the readers stand for a worker node process (hypha.cli.node)
    slices = 8 if quick else 16
    per_reader = 8 if quick else 16
    rounds = 5 if quick else 10
    pki = temp_pki()
    work = Path(tempfile.mkdtemp(prefix="hypha-bench-slices-"))
    floats = SLICE_MIB * MIB // 4 // SAMPLES_PER_SLICE
    write_dataset(
        {"x": torch.randn(slices * SAMPLES_PER_SLICE, floats)},
        work / "data",
        DATASET,
        samples_per_slice=SAMPLES_PER_SLICE,
    )
    serve = [sys.executable, __file__, "--pki", str(pki.dir), "--data", str(work / "data"), "--serve"]
    ours_srv, ours_port = await start_child("ours", *serve, "ours")
    try:
        raw_srv, raw_port = await start_child("raw", *serve, "raw")
    except BaseException:
        await ours_srv.stop()
        raise
    ours_address, raw_address = f"127.0.0.1:{int(ours_port)}", f"127.0.0.1:{int(raw_port)}"
    results: dict[str, list[float]] = {"ours_1": [], "ours_4": [], "raw_1": [], "raw_4": []}
    channels = [secure_channel(pki.tls("worker"), ours_address) for _ in range(4)]
    socks = [_raw_connect(pki.dir, raw_address) for _ in range(4)]
    try:
        # Warm-up: connections, page cache, both servers' first-call paths.
        await _ours_round(channels, _plan(4, slices, 2))
        await asyncio.to_thread(_raw_round, socks, _plan(4, slices, 2))
        for _ in range(rounds):  # interleaved, so drift in the machine's load hits both alike
            results["ours_1"].append(await _ours_round(channels[:1], _plan(1, slices, per_reader)))
            results["raw_1"].append(
                await asyncio.to_thread(_raw_round, socks[:1], _plan(1, slices, per_reader))
            )
            results["ours_4"].append(await _ours_round(channels, _plan(4, slices, per_reader)))
            results["raw_4"].append(await asyncio.to_thread(_raw_round, socks, _plan(4, slices, per_reader)))
    finally:
        for channel in channels:
            await channel.close()
        for sock in socks:
            sock.close()
        await ours_srv.stop()
        await raw_srv.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(pki.dir.parent, ignore_errors=True)
    m = {key: median(values) for key, values in results.items()}
    report(
        "slices",
        m["ours_1"],
        "MiB/s",
        m["raw_1"],
        m["ours_1"] / m["raw_1"],
        ours_1_reader_mib_s=round(m["ours_1"], 1),
        ours_4_readers_mib_s=round(m["ours_4"], 1),
        raw_tls_1_reader_mib_s=round(m["raw_1"], 1),
        raw_tls_4_readers_mib_s=round(m["raw_4"], 1),
        ratio_4_readers=round(m["ours_4"] / m["raw_4"], 4),
        rounds=rounds,
        slice_mib=SLICE_MIB,
        slices_per_reader=per_reader,
        samples={key: [round(v, 1) for v in values] for key, values in results.items()},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer slices and rounds (under a minute)")
    parser.add_argument("--serve", choices=["ours", "raw"], help=argparse.SUPPRESS)
    parser.add_argument("--pki", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.serve == "ours":
        asyncio.run(_serve_ours(args.pki, args.data))
    elif args.serve == "raw":
        _serve_raw(args.pki, args.data)
    else:
        asyncio.run(main(args.quick))
