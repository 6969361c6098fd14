"""The committed generated code matches a fresh generation from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "genproto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


def test_generated_modules_import_under_the_hypha_namespace() -> None:
    from hypha.v1 import data_pb2, gateway_pb2_grpc, scheduler_pb2_grpc, worker_pb2

    assert worker_pb2.DESCRIPTOR.package == "hypha.v1"
    assert hasattr(gateway_pb2_grpc, "GatewayStub")
    assert hasattr(scheduler_pb2_grpc, "SchedulerControlStub")
    assert data_pb2.DESCRIPTOR.services_by_name["DataNode"]
