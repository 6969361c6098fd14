"""A node ``hypha up`` restarts comes back on the ports it had (a real gateway process).

The other nodes were started with its addresses (gateways, DHT bootstrap);
a restarted gateway on a fresh port would be unreachable for good, and after
both gateways of a chaos run were restarted once, no job could lease a worker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hypha.client.cluster import Cluster
from hypha.client.supervisor import Supervisor

pytestmark = pytest.mark.timeout(120)


def test_a_restarted_gateway_listens_on_its_old_address_and_dht_port(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "state", workers=0)
    cluster.ensure_pki()
    supervisor = Supervisor(cluster)
    try:
        first = supervisor.start_node("gw0", "gateway", [])
        again = supervisor.restart_node("gw0")
        assert again["pid"] != first["pid"]
        assert (again["address"], again["dht"]) == (first["address"], first["dht"])
        # Pinned for this start only: the overrides it was started with stay as given.
        assert supervisor._started_with["gw0"] == ("gateway", [])
    finally:
        supervisor.stop_all()
