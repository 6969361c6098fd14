"""``hypha-certutil``: the documented command shape, its output, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from hypha.pki import certs
from hypha.pki.cli import main
from hypha.pki.identity import Role, peer_id_of, role_of


def run_ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def fields(out: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


@pytest.fixture
def pki(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """root + org "acme" made through the CLI, in tmp_path."""
    run_ok(capsys, "root", "--out", str(tmp_path))
    run_ok(
        capsys,
        "org",
        "--ca-cert",
        str(tmp_path / "root-ca-cert.pem"),
        "--ca-key",
        str(tmp_path / "root-ca-key.pem"),
        "--name",
        "acme",
        "--out",
        str(tmp_path),
    )
    return tmp_path


def org_args(pki: Path) -> list[str]:
    return ["--ca-cert", str(pki / "acme-ca-cert.pem"), "--ca-key", str(pki / "acme-ca-key.pem")]


def test_root_org_node_write_the_documented_files(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_ok(
        capsys,
        "node",
        *org_args(pki),
        "--role",
        "worker",
        "--name",
        "w1",
        "--san",
        "10.0.0.7",
        "--out",
        str(pki / "nodes"),
    )

    written = {p.name for p in pki.iterdir()} | {p.name for p in (pki / "nodes").iterdir()}
    assert {
        "root-ca-cert.pem",
        "root-ca-key.pem",
        "acme-ca-cert.pem",
        "acme-ca-key.pem",
        "w1-cert.pem",
        "w1-key.pem",
        "w1-trust.pem",
    } <= written
    leaf = certs.load_cert_chain(pki / "nodes" / "w1-cert.pem")[0]
    assert role_of(leaf) is Role.WORKER
    assert fields(out)["cert"] == str(pki / "nodes" / "w1-cert.pem")
    certs.verify_chain(
        certs.load_cert_chain(pki / "nodes" / "w1-cert.pem"), certs.load_cert_chain(pki / "root-ca-cert.pem")
    )


def test_node_prints_the_peer_id_of_the_written_certificate(
    pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_ok(capsys, "node", *org_args(pki), "--role", "scheduler", "--name", "s1", "--out", str(pki))
    as_json = json.loads(
        run_ok(
            capsys, "node", *org_args(pki), "--role", "scheduler", "--name", "s2", "--out", str(pki), "--json"
        )
    )

    assert fields(out)["peer id"] == peer_id_of(certs.load_cert_chain(pki / "s1-cert.pem")[0])
    assert as_json["peer_id"] == peer_id_of(certs.load_cert_chain(pki / "s2-cert.pem")[0])


def test_node_with_key_keeps_the_peer_id(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = fields(
        run_ok(capsys, "node", *org_args(pki), "--role", "data", "--name", "d1", "--out", str(pki))
    )
    renewed = fields(
        run_ok(
            capsys,
            "node",
            *org_args(pki),
            "--role",
            "data",
            "--name",
            "d1",
            "--out",
            str(pki / "renewed"),
            "--key",
            str(pki / "d1-key.pem"),
        )
    )
    other = fields(
        run_ok(capsys, "node", *org_args(pki), "--role", "data", "--name", "d1", "--out", str(pki / "other"))
    )
    assert renewed["peer id"] == first["peer id"] != other["peer id"]


def test_node_refuses_to_replace_an_existing_key_without_force(
    pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: w1 issued once.
    args = ["node", *org_args(pki), "--role", "worker", "--name", "w1", "--out", str(pki)]
    first = fields(run_ok(capsys, *args))["peer id"]
    key_before = (pki / "w1-key.pem").read_bytes()

    # Execute / Assert: again without --force is refused and changes nothing ...
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "w1-key.pem already exists" in err and "new peer id" in err and "--force" in err
    assert (pki / "w1-key.pem").read_bytes() == key_before
    # ... renewal with the same key in place is allowed and keeps the peer id ...
    renewed = fields(run_ok(capsys, *args, "--key", str(pki / "w1-key.pem")))["peer id"]
    assert renewed == first and (pki / "w1-key.pem").read_bytes() == key_before
    # ... and --force replaces the key: a new peer.
    assert fields(run_ok(capsys, *args, "--force"))["peer id"] != first


def test_revoke_then_crl_list_the_serial(pki: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_ok(capsys, "node", *org_args(pki), "--role", "client", "--name", "c1", "--out", str(pki))
    crl_path = pki / "crl.pem"
    out = run_ok(
        capsys,
        "revoke",
        *org_args(pki),
        "--cert",
        str(pki / "c1-cert.pem"),
        "--crl",
        str(crl_path),
        "--reason",
        "keyCompromise",
    )
    run_ok(capsys, "crl", *org_args(pki), "--crl", str(crl_path))

    serial = certs.load_cert_chain(pki / "c1-cert.pem")[0].serial_number
    assert f"{serial:x}" in out
    crl = x509.load_pem_x509_crl(crl_path.read_bytes().split(b"-----END CERTIFICATE-----\n", 1)[1])
    assert [e.serial_number for e in crl] == [serial]


def test_show_prints_name_role_peer_id_serial_issuer_validity(
    pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_ok(capsys, "node", *org_args(pki), "--role", "gateway", "--name", "gw", "--out", str(pki))
    leaf = certs.load_cert_chain(pki / "gw-cert.pem")[0]

    shown = fields(run_ok(capsys, "show", str(pki / "gw-cert.pem")))
    as_json = json.loads(run_ok(capsys, "show", str(pki / "gw-cert.pem"), "--json"))
    ca_shown = fields(run_ok(capsys, "show", str(pki / "root-ca-cert.pem")))

    assert shown["name"] == "gw" and shown["role"] == "gateway"
    assert shown["peer id"] == peer_id_of(leaf) == as_json["peer_id"]
    assert shown["serial"] == f"{leaf.serial_number:x}"
    assert shown["issuer"] == leaf.issuer.rfc4514_string()
    assert shown["not after"] == leaf.not_valid_after_utc.isoformat()
    assert "not before" in shown
    assert ca_shown["role"] == "-" and ca_shown["ca"] == "True"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["show", "/nonexistent/cert.pem"], "/nonexistent/cert.pem"),
        (
            [
                "node",
                "--ca-cert",
                "{d}/acme-ca-cert.pem",
                "--ca-key",
                "{d}/acme-ca-key.pem",
                "--role",
                "emperor",
                "--name",
                "x",
                "--out",
                "{d}",
            ],
            "emperor",
        ),
        (
            [
                "node",
                "--ca-cert",
                "{d}/acme-ca-cert.pem",
                "--ca-key",
                "{d}/acme-ca-cert.pem",
                "--role",
                "worker",
                "--name",
                "x",
                "--out",
                "{d}",
            ],
            "private key",
        ),
        (
            [
                "node",
                "--ca-cert",
                "{d}/acme-ca-cert.pem",
                "--ca-key",
                "{d}/missing-key.pem",
                "--role",
                "worker",
                "--name",
                "x",
                "--out",
                "{d}",
            ],
            "missing-key.pem",
        ),
        (
            [
                "node",
                "--ca-cert",
                "{d}/acme-ca-cert.pem",
                "--ca-key",
                "{d}/root-ca-key.pem",
                "--role",
                "worker",
                "--name",
                "x",
                "--out",
                "{d}",
            ],
            "does not belong",
        ),
        (
            [
                "revoke",
                "--ca-cert",
                "{d}/acme-ca-cert.pem",
                "--ca-key",
                "{d}/acme-ca-key.pem",
                "--cert",
                "{d}/root-ca-cert.pem",
                "--crl",
                "{d}/crl.pem",
            ],
            "issued by",
        ),
        (["root", "--out", "{d}"], "already exists"),
        (["show", "{d}/acme-ca-key.pem"], "error"),
        (["frobnicate"], "frobnicate"),
        ([], "required"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    pki: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code = main([a.replace("{d}", str(pki)) for a in argv])
    out, err = capsys.readouterr()

    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hypha-certutil: error: ")
    assert needle in lines[0]
    assert "Traceback" not in err


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "node" in capsys.readouterr().out


def test_runs_as_a_module(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "hypha.pki.cli", "root", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "root-ca-cert.pem").is_file()
    bad = subprocess.run(
        [sys.executable, "-m", "hypha.pki.cli", "show", str(tmp_path / "nope.pem")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("hypha-certutil: error: ")
