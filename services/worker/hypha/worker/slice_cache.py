"""The worker's slice cache: verified slice files on disk, named by their sha256, bounded in size.

Split from ``fetcher`` (which streams slices from data nodes and decides when
to use this cache). A slice is stored as ``<dataset>/<index>-<sha256>.safetensors``
with an atomic rename, so a crash never leaves a half file under a real name;
every use re-hashes the file, so a rotted or torn one is deleted and fetched
again, never served. After each store the least recently used slices (by mtime,
which a hit refreshes) are deleted until the cache fits ``max_bytes`` (the
``jobs.slice_cache_bytes`` setting), and a slice larger than the whole cache is
refused naming that setting.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from hypha.errors import ResourceExhaustedError

log = logging.getLogger(__name__)

#: Bytes read at a time when a cached slice is re-hashed.
_READ_BLOCK = 1 << 20


class SliceCache:
    """Slice files of one worker under ``root``, at most ``max_bytes`` of them."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        #: Slices deleted to make room, since this cache was made.
        self.evicted = 0

    def find(self, dataset: str, index: int, expected: str) -> Path | None:
        """The cached file of a slice, not re-hashed (``verified`` does that); any copy if no ``expected``."""
        folder = self.root / dataset
        if expected:
            path = folder / f"{index:06d}-{expected}.safetensors"
            return path if path.is_file() else None
        matches = sorted(folder.glob(f"{index:06d}-*.safetensors")) if folder.is_dir() else []
        return matches[0] if matches else None

    def verified(self, dataset: str, index: int, expected: str) -> Path | None:
        """A cached copy whose bytes still hash to the sha256 in its name; a rotted one is deleted."""
        path = self.find(dataset, index, expected)
        if path is None:
            return None
        digest = hashlib.sha256()
        with path.open("rb") as file:
            while block := file.read(_READ_BLOCK):
                digest.update(block)
        if digest.hexdigest() == path.stem.rsplit("-", 1)[-1]:
            os.utime(path)  # recently used: the last to be evicted
            return path
        log.warning("cached slice %s fails its sha256 check; fetching it again", path)
        path.unlink(missing_ok=True)
        return None

    def store(self, dataset: str, index: int, payload: bytes, digest: str) -> Path:
        """Keep a verified slice (``digest`` is its sha256), then make room; its path."""
        if len(payload) > self.max_bytes:
            raise ResourceExhaustedError(
                f"{dataset} slice {index} has {len(payload)} bytes, more than the whole slice cache "
                f"(jobs.slice_cache_bytes = {self.max_bytes})"
            )
        folder = self.root / dataset
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"{index:06d}-{digest}.safetensors"
        fd, tmp_name = tempfile.mkstemp(prefix=f".{index:06d}-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(payload)
            # NOTE: no fsync: the cache is disposable and every read re-hashes the file, so a
            # torn write after a crash is caught and fetched again.
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        self._evict(keep=target)
        return target

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used slices until the cache holds at most ``max_bytes``."""
        entries = []
        for path in self.root.glob("*/*.safetensors"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda entry: entry[0]):
            if total <= self.max_bytes:
                return
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            total -= size
            self.evicted += 1
            log.debug("slice cache over %d bytes: evicted %s", self.max_bytes, path)
