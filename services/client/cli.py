"""``hypha``: the client CLI (jobs, workers, local cluster)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hypha import __version__
from hypha.client.cluster import DEFAULT_STATE_DIR, down, up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypha", description="Hypha client: jobs, workers, local cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    p_up = sub.add_parser("up", help="start a local cluster (foreground; Ctrl-C stops it)")
    p_up.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p_up.add_argument("--workers", type=int, default=3)
    p_down = sub.add_parser("down", help="stop the local cluster")
    p_down.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p_demo = sub.add_parser("demo", help="run the demo on the local cluster")
    p_demo.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p_demo.add_argument("--workers", type=int, default=3)
    p_demo.add_argument("--output", choices=["text", "json"], default="text")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "version":
        print(f"hypha-ml {__version__}")
        return 0
    if args.command == "up":
        return up(args.state_dir, args.workers)
    if args.command == "down":
        return down(args.state_dir)
    from hypha.client.demo import demo

    return demo(args.state_dir, args.workers, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
