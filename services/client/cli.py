"""``hypha``: the client CLI (jobs, workers, the local cluster)."""

from __future__ import annotations

import argparse
import sys

from hypha import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypha", description="Hypha client: jobs, workers, local cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "version":
        print(f"hypha-ml {__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
