"""A push larger than the in-memory bound is spooled to disk as it arrives: the receiving
process's peak RSS grows by less than the bound, and the spooled file is the payload, verified.

The receiver runs in a child process (``python -m tests.worker.test_transfer_memory``) so its
peak RSS (``resource.getrusage``) counts nothing but the receiving; it prints its port, then one
JSON line once the payload is queued.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hypha.net.channel import secure_channel
from hypha.net.tls import TlsMaterial
from hypha.worker.transfer import TensorExchange, TransferSettings
from tests.conftest import Pki

MIB = 1 << 20
BOUND = 32 * MIB
PAYLOAD = 128 * MIB


def _write_safetensors(path: Path, size: int) -> str:
    """A valid safetensors file of one uint8 tensor, ``size`` bytes of data; returns its sha256."""
    header = json.dumps({"x": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as handle:
        for block in (len(header).to_bytes(8, "little"), header):
            handle.write(block)
            digest.update(block)
        block = os.urandom(MIB)
        for _ in range(size // MIB):
            handle.write(block)
            digest.update(block)
    return digest.hexdigest()


class _Direct:
    """A ChannelSource with one direct channel (the receiver is reachable on loopback)."""

    def __init__(self, tls: TlsMaterial, address: str) -> None:
        self.direct = secure_channel(tls, address)

    async def channel(self, peer_id: str, addresses: list[str]) -> Any:
        return self.direct

    async def invalidate(self, peer_id: str) -> None:
        return None


async def test_a_push_larger_than_the_memory_bound_stays_under_it(pki: Pki, tmp_path: Path) -> None:
    # Prepare: a 128 MiB payload, a receiver in its own process that keeps at most 32 MiB in memory
    source = tmp_path / "delta.safetensors"
    sha = await asyncio.to_thread(_write_safetensors, source, PAYLOAD)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.worker.test_transfer_memory",
        str(pki.dir),
        str(tmp_path / "spool"),
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert child.stdout is not None
    try:
        port = int(await asyncio.wait_for(child.stdout.readline(), 30))
        connector = _Direct(pki.tls("worker"), f"127.0.0.1:{port}")
        sender = TensorExchange(connector)  # type: ignore[arg-type]

        # Execute
        accepted, message = await sender.send(
            "job-m", pki.tls("worker").identity.peer_id, [], "delta", 0, 1, source
        )
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        await connector.direct.close()
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()

    # Check: whole, verified, on disk, and the receiver's peak RSS grew by less than the bound
    assert accepted, message
    report = json.loads(line)
    assert report["size"] == PAYLOAD + 8 + report["header"]
    assert report["sha256"] == sha
    assert report["peak_growth"] < BOUND, f"peak RSS grew by {report['peak_growth'] / MIB:.1f} MiB"
    assert report["spooled"]


def _digest_of(path: Path | None, data: bytes) -> tuple[int, str]:
    """(safetensors header length, sha256) of a received payload, spooled or in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") if path is not None else io.BytesIO(data) as handle:
        head = handle.read(8)
        digest.update(head)
        while block := handle.read(MIB):
            digest.update(block)
    return int.from_bytes(head, "little"), digest.hexdigest()


async def _receive(pki_dir: Path, spool: Path) -> None:
    from types import SimpleNamespace

    from hypha.net.server import NodeServer
    from hypha.net.tls import PathsTls
    from hypha.v1 import worker_pb2_grpc
    from hypha.worker.jobs_servicer import WorkerJobs, WorkerJobsMixin
    from hypha.worker.tensor_frames import add_worker_servicer

    exchange = TensorExchange(None, TransferSettings(memory_payload_bytes=BOUND, spool_dir=spool))
    exchange.open_job("job-m")

    class PushOnly(WorkerJobsMixin, worker_pb2_grpc.WorkerServicer):
        def __init__(self) -> None:
            self.jobs = WorkerJobs.__new__(WorkerJobs)
            self.jobs.exchange = exchange
            # No execution: the member check defers to the exchange (``job_scope.check_member``).
            self.jobs.manager = SimpleNamespace(live_dispatches=lambda job_id: [])  # type: ignore[assignment]

    tls = TlsMaterial.load(PathsTls.from_certs_dir(pki_dir, "worker"))
    server = NodeServer(tls, "127.0.0.1:0", [(add_worker_servicer, PushOnly(), "hypha.v1.Worker")])
    port = await server.start()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(port, flush=True)
    payload = await exchange.next_received("job-m", "delta", 60)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert payload is not None
    header, sha = await asyncio.to_thread(_digest_of, payload.path, payload.data)
    result = {
        "size": payload.nbytes,
        "header": header,
        "sha256": sha,
        "spooled": payload.path is not None and payload.path.parent == spool,
        "peak_growth": peak - before,
    }
    payload.release()
    print(json.dumps(result), flush=True)
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(_receive(Path(sys.argv[1]), Path(sys.argv[2])))
elif sys.platform != "linux":  # pragma: no cover - ru_maxrss is in KiB on Linux only
    pytest.skip("peak RSS is measured in Linux units", allow_module_level=True)
