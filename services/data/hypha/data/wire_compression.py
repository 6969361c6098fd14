"""Whether a dataset's slices travel gzip-compressed.

Token ids are stored as int64 (what every trainer feeds an embedding without
a cast), so a slice of a byte-level text or arithmetic dataset is mostly
zero bytes: gzip takes it to about a tenth (measured on the demo's dataset),
and on a 20 Mbit/s link the slices were half of a compressed DiLoCo round's
traffic. Images and float features hardly shrink, and gzip would only cost the
data node CPU, so ``auto`` samples each dataset once and compresses only
where it pays. Compression is gRPC's own message compression: every reader
decompresses it without being told, the relay included, and the bytes a
reader assembles (and checks against the manifest's sha256) are the same.
"""

from __future__ import annotations

import zlib

from hypha.data.config import WireCompression
from hypha.datasets.format import Dataset

#: Bytes of a slice file that ``auto`` compresses to judge the dataset.
SAMPLE_BYTES = 256 * 1024
#: ``auto`` compresses a dataset whose sample shrinks to at most this fraction.
WORTH_IT = 0.5


def compresses_well(sample: bytes) -> bool:
    """Whether gzip (at its fastest level, about what gRPC's costs) halves ``sample``."""
    if not sample:
        return False
    return len(zlib.compress(sample, 1)) <= WORTH_IT * len(sample)


class CompressionChoice:
    """The setting, and ``auto``'s verdict per dataset (taken once per dataset version)."""

    def __init__(self, mode: WireCompression = "auto") -> None:
        if mode not in ("auto", "gzip", "none"):
            raise ValueError(f"wire compression must be auto, gzip or none, got {mode!r}")
        self.mode = mode
        #: Dataset name -> (the dataset object judged, verdict); a dataset replaced under its
        #: name is a new object and is judged anew.
        self._verdicts: dict[str, tuple[Dataset, bool]] = {}

    def known(self, dataset: Dataset) -> bool | None:
        """The verdict without touching the disk, or None if the sample must be read first."""
        if self.mode != "auto":
            return self.mode == "gzip"
        held = self._verdicts.get(dataset.name)
        return held[1] if held is not None and held[0] is dataset else None

    def judge(self, dataset: Dataset, index: int) -> bool:
        """``auto``'s verdict from the start of slice ``index`` (blocking: a thread's work)."""
        verdict = self.known(dataset)
        if verdict is None:
            with open(dataset.slice_path(index), "rb") as f:
                verdict = compresses_well(f.read(SAMPLE_BYTES))
            self._verdicts[dataset.name] = (dataset, verdict)
        return verdict
