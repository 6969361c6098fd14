"""``hypha-certutil``: the offline tool that builds and maintains the private PKI.

Subcommands: ``root``, ``org``, ``node``, ``revoke``, ``crl``, ``show`` (see
``--help``). Every failure prints one line ``hypha-certutil: error: ...`` on
stderr and exits with status 2, without a traceback, so scripts and people
see the cause at once.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from cryptography import x509

from hypha.errors import HyphaError
from hypha.pki import certs, crl
from hypha.pki.identity import Role, common_name_of, peer_id_of, role_of

PROG = "hypha-certutil"


class UsageError(Exception):
    """An argument error, reported in one line instead of argparse's usage dump."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Build and maintain the Hypha private PKI (ECDSA P-256).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    root = sub.add_parser(
        "root", help="create a self-signed root CA: DIR/root-ca-cert.pem, DIR/root-ca-key.pem"
    )
    root.add_argument("--out", required=True, type=Path, metavar="DIR")
    root.add_argument("--name", default="hypha-root", help="subject CN (default: %(default)s)")
    root.add_argument("--days", type=int, default=3650, help="validity in days (default: %(default)s)")
    root.add_argument("--force", action="store_true", help="replace an existing root CA")

    org = sub.add_parser(
        "org", help="create an organisation CA under the root: ORG-ca-cert.pem, ORG-ca-key.pem"
    )
    _ca_args(org)
    org.add_argument("--name", required=True, metavar="ORG")
    org.add_argument("--out", required=True, type=Path, metavar="DIR")
    org.add_argument("--days", type=int, default=1825, help="validity in days (default: %(default)s)")
    org.add_argument("--force", action="store_true", help="replace an existing organisation CA")

    node = sub.add_parser("node", help="issue a node certificate: N-cert.pem, N-key.pem, N-trust.pem")
    _ca_args(node)
    node.add_argument("--role", required=True, choices=[r.value for r in Role])
    node.add_argument("--name", required=True, metavar="N")
    node.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="S",
        help="subject alternative name (IP or DNS) peers reach the node at, besides N; repeatable",
    )
    node.add_argument(
        "--loopback",
        action="store_true",
        help="also name localhost and 127.0.0.1: only for nodes dialled on their own machine "
        "(a local cluster)",
    )
    node.add_argument("--out", required=True, type=Path, metavar="DIR")
    node.add_argument("--days", type=int, default=365, help="validity in days (default: %(default)s)")
    node.add_argument(
        "--key",
        type=Path,
        metavar="EXISTING_KEY",
        help="reuse this private key (renewal: the peer id stays the same)",
    )
    node.add_argument(
        "--force",
        action="store_true",
        help="replace an existing key in DIR (a new key is a new peer id; --key renews keeping it)",
    )
    node.add_argument("--json", action="store_true", help="print the result as one JSON object")

    revoke = sub.add_parser("revoke", help="add a certificate to its CA's CRL (creates or extends FILE)")
    _ca_args(revoke)
    revoke.add_argument("--cert", required=True, type=Path, metavar="LEAF")
    revoke.add_argument("--crl", required=True, type=Path, metavar="FILE")
    revoke.add_argument(
        "--reason",
        choices=[r.value for r in x509.ReasonFlags if r.value != "unspecified"],
        help="revocation reason recorded in the CRL",
    )

    crl_cmd = sub.add_parser("crl", help="write or refresh the CA's CRL (empty when new)")
    _ca_args(crl_cmd)
    crl_cmd.add_argument("--crl", required=True, type=Path, metavar="FILE")

    show = sub.add_parser("show", help="print a certificate's name, role, peer id, serial, issuer, validity")
    show.add_argument("cert", type=Path, metavar="CERT")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _ca_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ca-cert", required=True, type=Path, metavar="C")
    parser.add_argument("--ca-key", required=True, type=Path, metavar="K")


def _describe(cert: x509.Certificate) -> dict[str, Any]:
    try:
        role: str | None = role_of(cert).value
    except HyphaError:
        role = None  # CA certificates carry no role
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = bc.ca
    except x509.ExtensionNotFound:
        is_ca = False
    try:
        sans = [
            str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ]
    except x509.ExtensionNotFound:
        sans = []
    now = dt.datetime.now(dt.UTC)
    return {
        "name": common_name_of(cert.subject),
        "role": role,
        "peer_id": peer_id_of(cert),
        "serial": f"{cert.serial_number:x}",
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "expired": cert.not_valid_after_utc < now,
        "ca": is_ca,
        "sans": sans,
    }


def _print_fields(fields: dict[str, Any]) -> None:
    for key, value in fields.items():
        if isinstance(value, list):
            value = ", ".join(value)
        elif value is None:
            value = "-"
        print(f"{key.replace('_', ' ')}: {value}")


def _run(args: argparse.Namespace) -> None:
    if args.command == "root":
        cert, key = certs.make_root(args.out, args.name, args.days, overwrite=args.force)
        print(f"cert: {cert}\nkey: {key}")
    elif args.command == "org":
        cert, key = certs.make_org(
            args.ca_cert, args.ca_key, args.name, args.out, args.days, overwrite=args.force
        )
        print(f"cert: {cert}\nkey: {key}")
    elif args.command == "node":
        _refuse_new_key(args)
        cert, key, trust = certs.make_node(
            args.ca_cert,
            args.ca_key,
            Role(args.role),
            args.name,
            args.out,
            sans=args.san,
            days=args.days,
            key_path=args.key,
            loopback=args.loopback,
        )
        result = {
            "peer_id": peer_id_of(certs.load_cert_chain(cert)[0]),
            "cert": str(cert),
            "key": str(key),
            "trust": str(trust),
        }
        if args.json:
            print(json.dumps(result))
        else:
            _print_fields(result)
    elif args.command == "revoke":
        reason = x509.ReasonFlags(args.reason) if args.reason else None
        crl.revoke(args.ca_cert, args.ca_key, args.cert, args.crl, reason)
        leaf = certs.load_cert_chain(args.cert)[0]
        print(f"revoked {common_name_of(leaf.subject)} (serial {leaf.serial_number:x}) in {args.crl}")
    elif args.command == "crl":
        written = crl.write_crl(args.ca_cert, args.ca_key, args.crl)
        print(f"wrote CRL of {written.issuer.rfc4514_string()} ({len(written)} revoked) to {args.crl}")
    elif args.command == "show":
        fields = _describe(certs.load_cert_chain(args.cert)[0])
        if args.json:
            print(json.dumps(fields))
        else:
            _print_fields(fields)
    else:  # pragma: no cover - argparse restricts the choices
        raise UsageError(f"unknown command {args.command}")


def _refuse_new_key(args: argparse.Namespace) -> None:
    """A node's key is its identity (the peer id is derived from it): issuing into a dir that
    already holds the node's key, without reusing that key, would silently make a new peer."""
    existing = certs.node_paths(args.out, args.name)[1]
    reused = args.key is not None and Path(args.key).resolve() == existing.resolve()
    if existing.exists() and not reused and not args.force:
        raise FileExistsError(
            f"{existing} already exists; a new key would give {args.name} a new peer id "
            f"(--key {existing} renews the certificate keeping it)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
        _run(args)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except (UsageError, HyphaError, ValueError) as err:
        return _fail(str(err))
    except FileExistsError as err:
        return _fail(f"{err} (--force replaces it)")
    except OSError as err:
        where = f": {err.filename}" if err.filename else ""
        return _fail(f"{err.strerror or err}{where}")
    return 0


def _fail(message: str) -> int:
    # One line, whatever the error text holds.
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
