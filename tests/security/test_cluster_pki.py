"""``hypha up`` keeps the CA keys away from every node's files.

The root and org CA keys used to sit in ``pki/`` beside the nodes' keys,
where any process that could read a node's key could also mint an admin
certificate. They now live in ``ca/`` (0700), which no node config names.
"""

from __future__ import annotations

from pathlib import Path

from hypha.client.cluster import Cluster


def test_ca_keys_live_apart_from_the_nodes_files(tmp_path: Path) -> None:
    # Prepare / Execute
    cluster = Cluster(tmp_path / "state", workers=1)
    cluster.ensure_pki()
    config = cluster.ensure_config("worker0", "worker").read_text()

    # Assert
    assert sorted(p.name for p in cluster.ca_dir.glob("*-key.pem")) == ["local-ca-key.pem", "root-ca-key.pem"]
    assert not list(cluster.pki_dir.glob("*-ca-key.pem"))
    assert (cluster.pki_dir / "worker0-key.pem").stat().st_mode & 0o777 == 0o600
    assert cluster.ca_dir.stat().st_mode & 0o777 == 0o700
    assert str(cluster.ca_dir) not in config and str(cluster.pki_dir) in config


def test_a_state_dir_from_before_has_its_ca_keys_moved_out(tmp_path: Path) -> None:
    # Prepare: the old layout, CA keys in pki/
    cluster = Cluster(tmp_path / "state", workers=1)
    cluster.ensure_pki()
    for key in cluster.ca_dir.glob("*-key.pem"):
        key.replace(cluster.pki_dir / key.name)
    node_cert = (cluster.pki_dir / "worker0-cert.pem").read_bytes()

    # Execute
    cluster.ensure_pki()

    # Assert: moved, not regenerated (the nodes' certificates still chain to the same CA)
    assert not list(cluster.pki_dir.glob("*-ca-key.pem"))
    assert len(list(cluster.ca_dir.glob("*-key.pem"))) == 2
    assert (cluster.pki_dir / "worker0-cert.pem").read_bytes() == node_cert
