"""``hypha up``'s cluster spread over a link lab (``hypha.testing.wan``): the core in the hub,
each worker behind its own capped link.

The gateways, the data node and the scheduler run in the lab's hub namespace, as the
well-connected core of a deployment would; worker i runs in site i's namespace, so
everything it sends or receives crosses its capped link (and a trainer's exchange with the
parameter server crosses two). The nodes are the ones ``hypha up`` starts (``Supervisor``:
the same configs, overrides and start order); only their network differs:

- each node runs under ``ip netns exec`` (``Cluster.launchers``), so the supervisor itself
  may run in any namespace;
- it listens on its namespace's lab address (``net.listen``; the hub's DHT endpoints too),
  and so advertises that address, not loopback;
- its certificate names that address besides loopback: peers check the address they dial
  against the certificate (``hypha.pki.certs.make_node``).

A client must dial the scheduler from the hub namespace (``lab.spawn(lab.hub, ...)``): the
lab's addresses exist only inside the lab.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypha.client.cluster import Cluster
from hypha.pki import certs
from hypha.testing.wan import WanLab

HUB_ROLES = ("gateway", "data", "scheduler")


def lab_cluster(lab: WanLab, state_dir: Path, overrides: dict[str, list[str]] | None = None) -> Cluster:
    """A ``Cluster`` with one worker per site of ``lab``, its PKI made for the lab's addresses.

    ``overrides`` are ``--set`` items by role or node name, applied after the lab's own.
    """
    cluster = Cluster(state_dir, workers=len(lab.sites))
    addresses: dict[str, str] = {}
    for name, role in cluster.node_names():
        if role in HUB_ROLES:
            namespace, address = lab.hub, lab.hub_address
        else:
            site = lab.sites[int(name.removeprefix("worker"))]
            namespace, address = site.namespace, site.address
        addresses[name] = address
        cluster.launchers[name] = lab.argv(namespace)
        placed = [f"net.listen={json.dumps(f'{address}:0')}"]
        if role in HUB_ROLES:
            # The DHT's UDP endpoint: workers bootstrap through the gateways' and find the data node's.
            placed.append(f"{role}.dht_host={json.dumps(address)}")
        cluster.overrides[name] = placed
    for key, items in (overrides or {}).items():
        cluster.overrides.setdefault(key, []).extend(items)
    issue_certificates(cluster, addresses)
    return cluster


def issue_certificates(cluster: Cluster, addresses: dict[str, str]) -> None:
    """The local cluster's PKI, each node's certificate also naming its lab address (same key)."""
    cluster.ensure_pki()
    roles = dict(cluster.node_names())
    org_cert, org_key = cluster.ca_dir / "local-ca-cert.pem", cluster.ca_dir / "local-ca-key.pem"
    for name, address in addresses.items():
        certs.make_node(
            org_cert,
            org_key,
            roles[name],
            name,
            cluster.pki_dir,
            sans=[address],
            key_path=cluster.pki_dir / f"{name}-key.pem",
            loopback=True,
        )
