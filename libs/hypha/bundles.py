"""A task job's files: packed by ``hypha submit``, checked by the scheduler, unpacked by the worker.

A bundle is one gzip-compressed tar of the paths a job file's ``files`` names
(relative to the job file's directory, kept under the same relative names).
It travels inline: in ``SubmitJobRequest.files_bundle`` to the scheduler,
which keeps it by its sha256 and names that digest in the job's spec, and in
``DispatchJobRequest.files_bundle`` to the worker, which checks the digest
and unpacks it into the job's work dir before the command starts.

Decisions (NOTE):
- Inline, so capped at ``MAX_BUNDLE_BYTES`` compressed (what one relayed
  message carries with room to spare): a bundle is code and small inputs;
  data sets go through a data node, models through a repository or a
  worker's model roots. The error says so.
- Unpacking uses ``tarfile``'s ``data`` filter (absolute names, ``..``,
  links pointing out, devices are refused; modes made safe) after our own
  check, which names the offending member; unpacked bytes are capped too, so
  a small archive cannot fill the worker's disk.
- Packing is reproducible (sorted, zeroed owners and times), so the same
  files give the same digest and the scheduler stores them once.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import struct
import tarfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from hypha.errors import DataLossError, InvalidArgumentError, NotFoundError
from hypha.fsutil import write_atomic
from hypha.net.options import CHUNK_BYTES

#: The scheduler's folder of kept bundles, under its state dir.
BUNDLES_DIR = "bundles"
#: Largest bundle (compressed), in bytes.
MAX_BUNDLE_BYTES = CHUNK_BYTES
#: Largest total size of a bundle's files once unpacked, in bytes.
MAX_UNPACKED_BYTES = 256 * 1024 * 1024


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_relative(path: str, key: str) -> PurePosixPath:
    """A job-declared path: relative, inside its root (no ``..``), not empty."""
    pure = PurePosixPath(path)
    if not path.strip() or pure.is_absolute() or ".." in pure.parts or pure == PurePosixPath("."):
        raise InvalidArgumentError(f"{key}: {path!r} must be a relative path inside the job's directory")
    return pure


def pack(paths: Sequence[str], base: Path, *, limit: int = MAX_BUNDLE_BYTES) -> bytes:
    """The tar.gz of ``paths`` (files or directories, relative to ``base``); errors name the path."""
    buffer = io.BytesIO()
    # mtime=0 and sorted members: the same files give the same bytes (and digest).
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as compressed,
        tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive,
    ):
        for name in paths:
            relative = check_relative(name, "files")
            source = base / relative
            if not source.exists():
                raise InvalidArgumentError(f"files: {name!r} does not exist (looked in {base})")
            members = [source] if source.is_file() else sorted(source.rglob("*"))
            if source.is_dir():
                members.insert(0, source)
            for path in members:
                if path.is_symlink():
                    raise InvalidArgumentError(f"files: {path.relative_to(base)} is a symbolic link")
                if not (path.is_file() or path.is_dir()):
                    continue
                info = archive.gettarinfo(str(path), arcname=path.relative_to(base).as_posix())
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isfile():
                    with open(path, "rb") as handle:
                        archive.addfile(info, handle)
                else:
                    archive.addfile(info)
                if buffer.tell() > limit:
                    raise InvalidArgumentError(_too_large(buffer.tell(), limit))
    data = buffer.getvalue()
    if len(data) > limit:
        raise InvalidArgumentError(_too_large(len(data), limit))
    return data


def _too_large(size: int, limit: int) -> str:
    return (
        f"files: the bundle is over {size / 2**20:.1f} MiB compressed, above the limit of "
        f"{limit / 2**20:.1f} MiB; ship data sets through a data node (hypha-data) "
        "and models through a repository or the workers' local model roots"
    )


def check(data: bytes, *, limit: int = MAX_BUNDLE_BYTES) -> str:
    """A received bundle's sha256, once it is within the cap and a readable tar.gz."""
    if len(data) > limit:
        raise InvalidArgumentError(_too_large(len(data), limit))
    _members(data)
    return sha256_hex(data)


def unpack(data: bytes, sha256: str, target: Path, *, max_unpacked: int = MAX_UNPACKED_BYTES) -> list[str]:
    """Verify ``data`` against ``sha256`` and unpack it under ``target``; returns the files' names.

    Blocking (file I/O): async callers run it in a thread.
    """
    if sha256_hex(data) != sha256:
        raise DataLossError("the job's files bundle does not match its sha256")
    members = _members(data)
    total = sum(member.size for member in members if member.isfile())
    if total > max_unpacked:
        raise InvalidArgumentError(
            f"the job's files unpack to {total} bytes, more than the {max_unpacked} allowed"
        )
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(target, filter="data")
        else:
            # Python before 3.11.4 (Debian bookworm's 3.11.2, the images' stand-in base) has no
            # extraction filters: the members are checked already (_members: relative names,
            # files and directories only), and their modes are cut as the "data" filter cuts them.
            checked = archive.getmembers()
            for member in checked:
                member.mode = (member.mode & 0o755) | (0o700 if member.isdir() else 0o600)
            archive.extractall(target, members=checked)
    return [member.name for member in members if member.isfile()]


#: The one tensor of a bundle sent as a tensor payload (``as_payload``).
PAYLOAD_TENSOR = "bundle"


def as_payload(data: bytes) -> bytes:
    """``data`` as a safetensors payload of one uint8 tensor, for the verified tensor streams.

    NOTE: a finished job's result is shipped to an inference job this way, without the
    inline cap: tensor pushes are chunked and spooled, and accept only safetensors.
    Written by hand (an 8-byte header length, the JSON header, the bytes): no torch needed.
    """
    header = {PAYLOAD_TENSOR: {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def from_payload(payload: bytes) -> bytes:
    """The bytes ``as_payload`` wrapped; a payload of any other shape is a DataLossError."""
    try:
        (size,) = struct.unpack("<Q", payload[:8])
        entry = json.loads(payload[8 : 8 + size])[PAYLOAD_TENSOR]
        start, end = entry["data_offsets"]
        if entry["dtype"] != "U8" or 8 + size + end != len(payload) or start != 0:
            raise ValueError("not one uint8 tensor filling the payload")
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise DataLossError(f"not a bundle payload: {err}") from None
    return payload[8 + size :]


class BundleStore:
    """Bundles by sha256 in one directory (the scheduler's ``<state_dir>/bundles``).

    Content-addressed: a job names its bundle by digest, so resubmitting the
    same files stores nothing new, and a read is checked against its name.
    Blocking (file I/O): async callers run it in a thread.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise InvalidArgumentError(f"{sha256!r} is not a sha256 digest")
        return self.root / f"{sha256}.tar.gz"

    def put(self, data: bytes) -> str:
        """Check and keep a bundle; its sha256."""
        sha256 = check(data)
        target = self.path(sha256)
        if not target.is_file():
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(target, data)
        return sha256

    def get(self, sha256: str) -> bytes:
        try:
            data = self.path(sha256).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"the files bundle {sha256[:12]} is not on this scheduler") from None
        if sha256_hex(data) != sha256:
            raise DataLossError(f"the files bundle {sha256[:12]} on disk no longer matches its sha256")
        return data


def _members(data: bytes) -> list[tarfile.TarInfo]:
    """The archive's members, each checked: a relative name inside the root, a file or directory."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            members = archive.getmembers()
    except (tarfile.TarError, OSError, EOFError) as err:
        raise InvalidArgumentError(f"the job's files bundle is not a readable tar.gz: {err}") from None
    for member in members:
        pure = PurePosixPath(member.name)
        if pure.is_absolute() or ".." in pure.parts:
            raise InvalidArgumentError(f"the job's files bundle names {member.name!r}, outside its root")
        if not (member.isfile() or member.isdir()):
            raise InvalidArgumentError(
                f"the job's files bundle holds {member.name!r}, which is not a file or directory"
            )
    return members


__all__ = [
    "BUNDLES_DIR",
    "MAX_BUNDLE_BYTES",
    "MAX_UNPACKED_BYTES",
    "BundleStore",
    "check",
    "check_relative",
    "pack",
    "sha256_hex",
    "unpack",
]
