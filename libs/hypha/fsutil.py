"""Durable file writes: the one way this code base replaces a file on disk.

Certificates, keys, CRLs, checkpoints and dataset manifests must never be
seen half-written, even after a power cut: a reader finds the old file or the
whole new one. The pattern is the usual one: write a temporary file in the
same directory (so the rename stays on one file system), fsync it, rename it
over the target, then fsync the directory so the rename itself is durable.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically and durably; the file gets ``mode``.

    NOTE: the default is private (0600): most of what we write is a key, a
    checkpoint or state of one node; public files (certificates, CRLs) say 0644.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def replace_dir(source: Path, target: Path) -> None:
    """Put the finished directory ``source`` at ``target``, replacing what was there.

    A directory cannot be renamed over a non-empty one, so an existing
    ``target`` is first moved aside (``.NAME.old-XXXX`` beside it), ``source``
    renamed into place, and only then the old one removed. If the second
    rename fails the old directory is put back: a reader finds the old
    directory or the whole new one, never a mixture, and never nothing after
    an error (after a crash between the two renames, the old one is the
    ``.old-`` directory beside the target).
    """
    source, target = Path(source), Path(target)
    if not target.exists():
        os.rename(source, target)
    else:
        old = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
        os.rename(target, old)
        try:
            os.rename(source, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(target.parent)


def write_synced(path: Path, data: bytes) -> None:
    """Write a new file and fsync it, without the rename: for files inside a
    private temporary directory that is itself renamed into place afterwards."""
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable.

    Best effort: not every platform or file system lets a directory be
    opened or fsynced, and there is nothing better to do there.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["fsync_dir", "replace_dir", "write_atomic", "write_synced"]
