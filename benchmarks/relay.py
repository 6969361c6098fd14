"""Relayed vs direct transfer of a 64 MiB payload (1 MiB chunks, server stream).

    python benchmarks/relay.py [--quick] [--sweep [--sizes 1,4,16]] [--one-process]

Every node in its own process, as deployed (the default): the source (a ``PullTensors``
servicer on its own mTLS gRPC server, and the same servicer behind a relay on a node link
attached to gateway B) is a child process (``relay.py --serve-source``); the two gateways are
real ``hypha-gateway run`` processes (configs from ``hypha-gateway init``, B federated to A);
the caller, the measuring side, stays in this process with its own node link on gateway A.
Direct: the caller pulls straight from the source process's server. Relayed: the same call
through gateway A, then B, then the source's relay, the path every relayed call takes.

``--one-process``: the old mode, sender, both gateways and receiver in this one process and
event loop (``hypha.testing.mesh``), where the three TLS hops share one core; kept so the two
modes can be compared.

figure = relayed throughput (MiB/s, median), baseline = direct throughput, ratio =
relayed/direct. ``--sweep`` runs N such pulls at once (default 1, 4 and 16 concurrent streams,
16 MiB each) over the same relay link and reports the aggregate throughput of each N against
N direct pulls at once (``_common.report_sweep``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import Child, median, report, report_sweep, sizes_arg, start_child, temp_pki

if TYPE_CHECKING:
    import grpc

    from hypha.testing.pki import Pki
    from hypha.v1 import worker_pb2, worker_pb2_grpc

SIZE = 64 * 1024 * 1024
SWEEP_SIZE = 16 * 1024 * 1024
CHUNK = 1024 * 1024
SWEEP = [1, 4, 16]
#: A ``PullTensors`` with this job id streams nothing: how the caller learns the relay path is up.
PING = "ping"
#: Seconds a child process gets to come up (gateways federate, the source attaches).
START_TIMEOUT_S = 60.0


def source_binding(size: int) -> list[Any]:
    """The source: ``PullTensors`` streams ``size`` bytes in ``CHUNK`` pieces (nothing for ``PING``),
    as a ``NodeServer`` / ``Relay`` binding."""

    from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    payload = bytes(CHUNK)

    class Source(worker_pb2_grpc.WorkerServicer):
        async def PullTensors(
            self, request: worker_pb2.PullTensorsRequest, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[worker_pb2.TensorChunk]:
            if request.job_id == PING:
                return
            for offset in range(0, size, CHUNK):
                yield worker_pb2.TensorChunk(chunk=common_pb2.Chunk(offset=offset, data=payload))

    return [(worker_pb2_grpc.add_WorkerServicer_to_server, Source(), "hypha.v1.Worker")]


async def one(stub: worker_pb2_grpc.WorkerStub, size: int) -> None:
    from hypha.v1 import worker_pb2

    total = 0
    async for chunk in stub.PullTensors(worker_pb2.PullTensorsRequest(job_id="bench"), timeout=300):
        total += len(chunk.chunk.data)
    assert total == size


async def pull(stub: worker_pb2_grpc.WorkerStub, size: int, streams: int = 1) -> float:
    """Aggregate MiB/s of ``streams`` concurrent pulls of ``size`` bytes."""
    start = time.perf_counter()
    await asyncio.gather(*[one(stub, size) for _ in range(streams)])
    return streams * size / (1024 * 1024) / (time.perf_counter() - start)


async def sample(
    direct_stub: worker_pb2_grpc.WorkerStub,
    relayed_stub: worker_pb2_grpc.WorkerStub,
    streams_list: list[int],
    size: int,
    repeats: int,
) -> list[dict[str, Any]]:
    """One point per stream count: ``repeats`` direct then relayed pulls, after one warm-up of each."""
    await pull(direct_stub, size)
    await pull(relayed_stub, size)
    points: list[dict[str, Any]] = []
    for streams in streams_list:
        direct = [await pull(direct_stub, size, streams) for _ in range(repeats)]
        relayed = [await pull(relayed_stub, size, streams) for _ in range(repeats)]
        ours, base = median(relayed), median(direct)
        points.append(
            {
                "streams": streams,
                "figure": round(ours, 3),
                "baseline": round(base, 3),
                "ratio": round(ours / base, 4),
                "relayed_mib_s": [round(x, 1) for x in relayed],
                "direct_mib_s": [round(x, 1) for x in direct],
            }
        )
    return points


# ---- every node in its own process (default) ------------------------------------------------


async def serve_source(pki_dir: Path, name: str, gateway: str, size: int) -> None:
    """The source process: its own gRPC server (direct) and a relay on a link to ``gateway``.

    Prints one JSON line (``address``, ``peer_id``) once both serve; stops on SIGTERM."""
    from hypha.memtune import tune_malloc
    from hypha.net.link import NodeLink
    from hypha.net.relay import Relay
    from hypha.net.server import NodeServer
    from hypha.net.tls import PathsTls, TlsMaterial

    tune_malloc()  # as every node process does (hypha.cli.node)
    tls = TlsMaterial.load(PathsTls.from_certs_dir(pki_dir, name))
    binding = source_binding(size)
    server = NodeServer(tls, "127.0.0.1:0", binding)
    link = NodeLink(tls, [gateway], name=name, backoff_base_s=0.05, backoff_cap_s=0.5)
    relay = Relay(link)
    relay.serve(binding)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await server.start()
    await link.start()
    await relay.start()
    try:
        await link.wait_connected(START_TIMEOUT_S)
        print(json.dumps({"address": server.address, "peer_id": link.peer_id}), flush=True)
        await stop.wait()
    finally:
        await relay.stop()
        await link.stop()
        await server.stop(0)


async def start_gateway(pki: Pki, workdir: Path, name: str, peers: list[str]) -> tuple[Child, str]:
    """``hypha-gateway init`` then ``hypha-gateway run``, as an operator does; returns the
    process and its address once its ready file is written."""
    from hypha.testing.polling import until

    pki.issue("gateway", name)
    gateway_cli = [sys.executable, "-m", "hypha.gateway.cli"]
    config = workdir / f"{name}.toml"
    init = await asyncio.create_subprocess_exec(
        *gateway_cli,
        *["init", "--name", name, "--certs", str(pki.dir), "--out", str(config)],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(init.communicate(), START_TIMEOUT_S)
    if init.returncode != 0:
        raise RuntimeError(f"hypha-gateway init {name} failed:\n{out.decode(errors='replace')}")
    ready, log = workdir / f"{name}.ready", workdir / f"{name}.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            *gateway_cli,
            *["run", "--config", str(config), "--ready-file", str(ready)],
            *["--set", f"gateway.peers={json.dumps(peers)}", "--set", "gateway.reconnect_base_s=0.05"],
            stdout=sink,
            stderr=asyncio.subprocess.STDOUT,
            cwd=workdir,
        )
    child = Child(name, proc, log)

    def is_ready() -> bool:
        if proc.returncode is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{child.tail()}")
        return ready.exists()

    try:
        await until(is_ready, f"{name} ready", timeout=START_TIMEOUT_S)
    except AssertionError:
        await child.stop()
        raise
    return child, str(json.loads(ready.read_text())["address"])


async def start_source(pki: Pki, name: str, gateway: str, size: int) -> tuple[Child, dict[str, str]]:
    """``relay.py --serve-source``; returns the process and its first stdout line (address, peer id)."""
    pki.issue("worker", name)
    child, line = await start_child(
        name,
        *[sys.executable, __file__, "--serve-source", "--pki", str(pki.dir), "--name", name],
        *["--gateway", gateway, "--payload", str(size)],
        timeout_s=START_TIMEOUT_S,
    )
    info: dict[str, str] = json.loads(line)
    return child, info


async def until_reachable(stub: worker_pb2_grpc.WorkerStub, what: str) -> None:
    """Poll a ``PING`` pull until it succeeds: gateways federated, source present on the far one."""
    import grpc

    from hypha.testing.polling import until
    from hypha.v1 import worker_pb2

    async def reachable() -> bool:
        try:
            async for _ in stub.PullTensors(worker_pb2.PullTensorsRequest(job_id=PING), timeout=2):
                pass
        except grpc.aio.AioRpcError as err:
            raise AssertionError(f"{what}: {err.code().name} {err.details()}") from err
        return True

    await until(reachable, what, timeout=START_TIMEOUT_S)


async def measure_processes(streams_list: list[int], size: int, repeats: int) -> list[dict[str, Any]]:
    """Aggregate MiB/s per stream count with every node in its own process: the gateways and
    the source are children, the caller (this process) is attached to gateway A."""
    from hypha.memtune import tune_malloc
    from hypha.net.channel import secure_channel
    from hypha.net.relay import Relay
    from hypha.testing.mesh import Mesh
    from hypha.v1 import worker_pb2_grpc

    tune_malloc()  # as every node process does (hypha.cli.node)
    pki = temp_pki()
    workdir = pki.dir.parent  # the benchmark's temporary directory: configs, ready files, logs
    children: list[Child] = []
    mesh = Mesh(pki)  # only the caller's link; the gateways are processes
    try:
        gw_a, address_a = await start_gateway(pki, workdir, "gw-a", [])
        children.append(gw_a)
        gw_b, address_b = await start_gateway(pki, workdir, "gw-b", [address_a])
        children.append(gw_b)
        source, info = await start_source(pki, "bench-source", address_b, size)
        children.append(source)
        sink = await mesh.add_link("worker", "bench-sink", [address_a])
        sink_relay = Relay(sink)
        await sink_relay.start()
        try:
            relayed_stub = worker_pb2_grpc.WorkerStub(sink_relay.channel(info["peer_id"]))
            async with secure_channel(pki.tls("worker"), info["address"]) as channel:
                direct_stub = worker_pb2_grpc.WorkerStub(channel)
                await until_reachable(direct_stub, "source reachable directly")
                await until_reachable(relayed_stub, "source reachable through gw-a -> gw-b")
                return await sample(direct_stub, relayed_stub, streams_list, size, repeats)
        finally:
            await sink_relay.stop()
    except BaseException:
        for child in children:
            if child.log is not None:
                print(f"--- {child.name} log (tail) ---\n{child.tail()}", file=sys.stderr)
        raise
    finally:
        await mesh.close()
        for child in reversed(children):
            await child.stop()


# ---- everything in this process (--one-process) ---------------------------------------------


async def measure_one_process(streams_list: list[int], size: int, repeats: int) -> list[dict[str, Any]]:
    """The same measurement with sender, both gateways and receiver in this one event loop."""
    from hypha.memtune import tune_malloc
    from hypha.net.channel import secure_channel
    from hypha.net.relay import Relay
    from hypha.net.server import NodeServer
    from hypha.testing.mesh import Mesh
    from hypha.testing.polling import until
    from hypha.v1 import worker_pb2_grpc

    # As every node and gateway process does (hypha.cli.node); the direct baseline shares the process.
    tune_malloc()
    pki = temp_pki()
    mesh = Mesh(pki)
    binding = source_binding(size)
    server = NodeServer(pki.tls("worker"), "127.0.0.1:0", binding)
    await server.start()
    try:
        gateways = await mesh.full_mesh(2)
        source = await mesh.add_link("worker", "bench-source", [gateways[1].address])
        sink = await mesh.add_link("worker", "bench-sink", [gateways[0].address])
        source_relay, sink_relay = Relay(source), Relay(sink)
        source_relay.serve(binding)
        await source_relay.start()
        await sink_relay.start()
        await until(lambda: any(source.peer_id in p for p in gateways[0].hub.remote.values()), "presence")
        relayed_stub = worker_pb2_grpc.WorkerStub(sink_relay.channel(source.peer_id))
        async with secure_channel(pki.tls("worker"), server.address) as channel:
            direct_stub = worker_pb2_grpc.WorkerStub(channel)
            points = await sample(direct_stub, relayed_stub, streams_list, size, repeats)
        await sink_relay.stop()
        await source_relay.stop()
    finally:
        await mesh.close()
        await server.stop(0)
    return points


async def main(quick: bool, sweep: list[int] | None, one_process: bool) -> None:
    measure: Callable[[list[int], int, int], Awaitable[list[dict[str, Any]]]] = (
        measure_one_process if one_process else measure_processes
    )
    mode = "one-process" if one_process else "processes"
    if sweep:
        points = await measure(sweep, SWEEP_SIZE, 3 if quick else 5)
        report_sweep(
            "relay",
            "MiB/s",
            "streams",
            points,
            payload_mib=SWEEP_SIZE // (1024 * 1024),
            gateways=2,
            mode=mode,
        )
        return
    (point,) = await measure([1], SIZE, 3 if quick else 7)
    report(
        "relay",
        point["figure"],
        "MiB/s",
        point["baseline"],
        point["ratio"],
        relayed_mib_s=point["relayed_mib_s"],
        direct_mib_s=point["direct_mib_s"],
        payload_mib=SIZE // (1024 * 1024),
        gateways=2,
        mode=mode,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="aggregate throughput at several stream counts")
    parser.add_argument("--sizes", type=sizes_arg, default=SWEEP, help="concurrent stream counts for --sweep")
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="gateways, source and caller in this one process (old mode)",
    )
    parser.add_argument("--serve-source", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pki", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--gateway", help=argparse.SUPPRESS)
    parser.add_argument("--payload", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.serve_source:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_source(args.pki, args.name, args.gateway, args.payload))
    else:
        asyncio.run(main(args.quick, args.sizes if args.sweep else None, args.one_process))
