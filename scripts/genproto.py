"""Regenerate (or, with --check, verify) the committed gRPC/protobuf code.

Generated modules go to libs/hypha/v1 so imports read ``from hypha.v1 import
worker_pb2``. The output depends on the grpcio-tools version, which
constraints.txt pins, so a fresh generation is byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "libs"
PACKAGE = Path("hypha") / "v1"


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO)) for p in (PROTO / PACKAGE).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out / PACKAGE / "__init__.py").write_text('"""Generated protobuf and gRPC code. Do not edit."""\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code differs")
    args = parser.parse_args()
    if not args.check:
        target = OUT / PACKAGE
        for old in target.glob("*_pb2*.py*"):
            old.unlink()
        generate(OUT)
        print(f"generated into {target}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / PACKAGE
        committed = OUT / PACKAGE
        names = {p.name for p in fresh.iterdir()} | {
            p.name for p in committed.iterdir() if p.name != "__pycache__"
        }
        stale = sorted(
            n
            for n in names
            if not (fresh / n).exists()
            or not (committed / n).exists()
            or not filecmp.cmp(fresh / n, committed / n, shallow=False)
        )
        if stale:
            print("generated code is stale; run: python scripts/genproto.py", file=sys.stderr)
            for n in stale:
                print(f"  differs: {PACKAGE / n}", file=sys.stderr)
            return 1
    print("generated code is fresh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
