"""Loopback SANs are asked for: a production certificate names only where its node is reached.

A certificate that names ``127.0.0.1`` passes the name check of whatever
answers on the dialler's own loopback, and ``localhost`` means nothing to a
remote peer; only local clusters (tests, ``hypha up``, compose) ask for them
(``make_node(loopback=True)``, ``hypha-certutil node --loopback``). A node's
own health probe dials 127.0.0.1 and checks the node's name instead
(``probe --server-name``), so it works with either kind.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from hypha.net.probe import probe
from hypha.net.server import NodeServer
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.pki import certs
from hypha.pki.cli import main as certutil
from tests.conftest import Pki
from tests.helpers import cli

pytestmark = pytest.mark.timeout(60)
LOOPBACK = {x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))}


def sans_of(cert: Path) -> set[x509.GeneralName]:
    leaf = certs.load_cert_chain(cert)[0]
    return set(leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def org_args(pki: Pki) -> list[str]:
    return ["--ca-cert", str(pki.org_cert), "--ca-key", str(pki.org_key)]


def test_a_production_certificate_names_only_the_node_and_its_sans(pki: Pki, tmp_path: Path) -> None:
    by_api, _, _ = certs.make_node(
        pki.org_cert, pki.org_key, "gateway", "gw-prod", tmp_path, sans=["10.0.0.7"]
    )
    code = certutil(["node", *org_args(pki), "--role", "worker", "--name", "w-prod", "--san", "w.example.org",
                     "--out", str(tmp_path)])  # fmt: skip

    assert code == 0
    assert sans_of(by_api) == {x509.DNSName("gw-prod"), x509.IPAddress(ipaddress.ip_address("10.0.0.7"))}
    assert sans_of(tmp_path / "w-prod-cert.pem") == {x509.DNSName("w-prod"), x509.DNSName("w.example.org")}


def test_loopback_is_added_only_when_asked_for(pki: Pki, tmp_path: Path) -> None:
    by_api, _, _ = certs.make_node(pki.org_cert, pki.org_key, "data", "d-local", tmp_path, loopback=True)
    code = certutil(
        [
            "node",
            *org_args(pki),
            "--role",
            "worker",
            "--name",
            "w-local",
            "--loopback",
            "--out",
            str(tmp_path),
        ]
    )

    assert code == 0
    assert sans_of(by_api) == {x509.DNSName("d-local"), *LOOPBACK}
    assert sans_of(tmp_path / "w-local-cert.pem") == {x509.DNSName("w-local"), *LOOPBACK}
    # The test PKI is a local cluster's: its certificates ask for loopback.
    assert LOOPBACK <= sans_of(pki.paths("worker").cert)


@pytest.fixture
async def production_node(pki: Pki, tmp_path: Path) -> AsyncIterator[NodeServer]:
    """A gateway serving on 127.0.0.1 with a certificate that does not name 127.0.0.1."""
    certs.make_node(pki.org_cert, pki.org_key, "gateway", "gw-remote", tmp_path, sans=["gw.example.org"])
    server = NodeServer(TlsMaterial.load(PathsTls.from_certs_dir(tmp_path, "gw-remote")), "127.0.0.1:0", [])
    await server.start()
    yield server
    await server.stop(0)


async def test_dialling_127_0_0_1_fails_the_name_check_and_the_nodes_own_name_passes(
    pki: Pki, production_node: NodeServer
) -> None:
    client = pki.tls("client")

    by_address = await probe(client, production_node.address, timeout_s=5)
    by_name = await probe(client, production_node.address, timeout_s=5, server_name="gw-remote")

    assert by_address[0] is False
    assert by_name == (True, "SERVING")


async def test_the_probe_command_takes_the_server_name_as_the_containers_healthcheck_does(
    pki: Pki, production_node: NodeServer
) -> None:
    argv = [
        *cli("hypha-gateway"),
        "probe",
        production_node.address,
        "--certs",
        str(pki.dir),
        "--name",
        "client",
    ]

    async def run(*extra: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            *argv, *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 50)
        assert proc.returncode is not None
        return proc.returncode, (out + err).decode()

    refused = await run()
    served = await run("--server-name", "gw-remote")

    assert refused[0] == 1 and "unhealthy" in refused[1]
    assert served == (0, f"{production_node.address}: SERVING\n")
