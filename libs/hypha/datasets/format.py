"""The on-disk dataset format that data nodes serve and ``hypha-data prepare`` writes.

A dataset is a directory ``<data_dir>/<name>/`` holding SafeTensors slice files
(``slice-000000.safetensors`` ...) and a ``manifest.json``. Each slice is one
batch of samples stored as named tensors that share their first dimension.
The manifest records the per-slice sha256 so that a data node never serves
bytes that rotted on disk, and so that a receiver can check what it got.

Every slice holds ``samples_per_slice`` samples except possibly the last one,
which holds the remainder (``sample_count`` says how many there are in all):
dropping a user's trailing samples silently would be worse than one short
batch. The tensor shapes in the manifest are those of a full slice.

Reading is synchronous (plain file I/O); an async server calls these functions
through ``asyncio.to_thread``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypha.errors import DataLossError, HyphaError, InvalidArgumentError, NotFoundError, OutOfRangeError

if TYPE_CHECKING:
    import torch

    from hypha.v1 import data_pb2

logger = logging.getLogger(__name__)

FORMAT = "hypha-dataset"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CONTENT_TYPE = "application/safetensors"
#: Largest chunk a slice is streamed in; gRPC's default message limit is 4 MiB.
DEFAULT_CHUNK_SIZE = 1 << 20

#: Dataset names become directory names and DHT keys: keep them boring.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
#: Element types a slice may hold, spelled as torch spells them without "torch.".
DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
    }
)
#: Keys ``to_proto`` adds to the proto's metadata map for fields the proto lacks.
_PROTO_KEYS = ("format_version", "sample_count", "slice_bytes")


def slice_file_name(index: int) -> str:
    return f"slice-{index:06d}.safetensors"


def validate_dataset_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidArgumentError(
            f"invalid dataset name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of every slice; ``shape`` is a full slice's shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Manifest:
    name: str
    slice_count: int
    samples_per_slice: int
    sample_count: int
    tensors: tuple[TensorSpec, ...]
    #: Hex sha256 of each slice file, in slice order.
    sha256: tuple[str, ...]
    #: Size in bytes of each slice file, so truncation shows without hashing.
    slice_bytes: tuple[int, ...]
    #: Free-form description (source, tokenizer, vocab_size, seq_len, ...);
    #: strings only, because the proto carries a string map.
    metadata: Mapping[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        validate_dataset_name(self.name)
        if self.format_version != FORMAT_VERSION:
            raise InvalidArgumentError(
                f"dataset {self.name}: unsupported format version {self.format_version} "
                f"(this build reads {FORMAT_VERSION})"
            )
        if self.slice_count < 1:
            raise InvalidArgumentError(f"dataset {self.name}: slice_count must be >= 1")
        if self.samples_per_slice < 1:
            raise InvalidArgumentError(f"dataset {self.name}: samples_per_slice must be >= 1")
        low = (self.slice_count - 1) * self.samples_per_slice + 1
        high = self.slice_count * self.samples_per_slice
        if not low <= self.sample_count <= high:
            raise InvalidArgumentError(
                f"dataset {self.name}: sample_count {self.sample_count} does not fit "
                f"{self.slice_count} slices of {self.samples_per_slice}"
            )
        if not self.tensors:
            raise InvalidArgumentError(f"dataset {self.name}: no tensors described")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"dataset {self.name}: duplicate tensor names {names}")
        for spec in self.tensors:
            if spec.dtype not in DTYPES:
                raise InvalidArgumentError(
                    f"dataset {self.name}: tensor {spec.name}: unknown dtype {spec.dtype}"
                )
            if not spec.shape or spec.shape[0] != self.samples_per_slice or min(spec.shape) < 0:
                raise InvalidArgumentError(
                    f"dataset {self.name}: tensor {spec.name}: shape {list(spec.shape)} must start "
                    f"with samples_per_slice ({self.samples_per_slice})"
                )
        if len(self.sha256) != self.slice_count or len(self.slice_bytes) != self.slice_count:
            raise InvalidArgumentError(
                f"dataset {self.name}: need one sha256 and one size per slice ({self.slice_count})"
            )
        for digest in self.sha256:
            if not _SHA256_RE.match(digest):
                raise InvalidArgumentError(f"dataset {self.name}: malformed sha256 {digest!r}")
        if any(size <= 0 for size in self.slice_bytes):
            raise InvalidArgumentError(f"dataset {self.name}: slice sizes must be positive")
        for key, value in self.metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidArgumentError(f"dataset {self.name}: metadata must map strings to strings")

    def samples_in_slice(self, index: int) -> int:
        if not 0 <= index < self.slice_count:
            raise OutOfRangeError(
                f"dataset {self.name}: slice {index} out of range 0..{self.slice_count - 1}"
            )
        if index < self.slice_count - 1:
            return self.samples_per_slice
        return self.sample_count - (self.slice_count - 1) * self.samples_per_slice

    def digest(self) -> str:
        """Hex sha256 of ``to_json()``: the pin a data node's provider record carries.

        The manifest lists every slice's sha256, so this one value pins the
        whole dataset's content; it survives the proto round trip because
        ``to_json`` is a function of the fields alone (metadata sorted)."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    # ---- JSON ------------------------------------------------------------

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "format_version": self.format_version,
            "name": self.name,
            "slice_count": self.slice_count,
            "samples_per_slice": self.samples_per_slice,
            "sample_count": self.sample_count,
            "tensors": [t.to_dict() for t in self.tensors],
            "sha256": list(self.sha256),
            "slice_bytes": list(self.slice_bytes),
            "metadata": dict(sorted(self.metadata.items())),
        }
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"manifest is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgumentError("manifest must be a JSON object")
        if body.get("format") != FORMAT:
            raise InvalidArgumentError(f"manifest format must be {FORMAT!r}, got {body.get('format')!r}")
        try:
            return cls(
                name=_typed(body, "name", str),
                format_version=_typed(body, "format_version", int),
                slice_count=_typed(body, "slice_count", int),
                samples_per_slice=_typed(body, "samples_per_slice", int),
                sample_count=_typed(body, "sample_count", int),
                tensors=tuple(
                    TensorSpec(
                        name=_typed(t, "name", str),
                        dtype=_typed(t, "dtype", str),
                        shape=tuple(_int(d, "tensors[].shape") for d in _typed(t, "shape", list)),
                    )
                    for t in _typed(body, "tensors", list)
                ),
                sha256=tuple(_str(d, "sha256[]") for d in _typed(body, "sha256", list)),
                slice_bytes=tuple(_int(n, "slice_bytes[]") for n in _typed(body, "slice_bytes", list)),
                metadata=dict(_typed(body, "metadata", dict)),
            )
        except (TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"malformed manifest: {exc}") from None

    # ---- proto -----------------------------------------------------------

    def to_proto(self) -> data_pb2.DatasetManifest:
        """The wire form. Fields the proto has no slot for ride in its metadata
        map under reserved keys (``format_version``, ``sample_count``,
        ``slice_bytes``), which ``from_proto`` takes back out."""
        from hypha.v1 import data_pb2

        metadata = dict(self.metadata)
        metadata["format_version"] = str(self.format_version)
        metadata["sample_count"] = str(self.sample_count)
        metadata["slice_bytes"] = ",".join(str(n) for n in self.slice_bytes)
        return data_pb2.DatasetManifest(
            name=self.name,
            slice_count=self.slice_count,
            samples_per_slice=self.samples_per_slice,
            tensors=[
                data_pb2.TensorInfo(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in self.tensors
            ],
            sha256=list(self.sha256),
            metadata=metadata,
        )

    @classmethod
    def from_proto(cls, msg: data_pb2.DatasetManifest) -> Manifest:
        metadata = dict(msg.metadata)
        extra = {key: metadata.pop(key, "") for key in _PROTO_KEYS}
        try:
            sizes = tuple(int(n) for n in extra["slice_bytes"].split(",")) if extra["slice_bytes"] else ()
            return cls(
                name=msg.name,
                slice_count=msg.slice_count,
                samples_per_slice=msg.samples_per_slice,
                sample_count=int(extra["sample_count"] or 0),
                tensors=tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in msg.tensors),
                sha256=tuple(msg.sha256),
                slice_bytes=sizes,
                metadata=metadata,
                format_version=int(extra["format_version"] or 0),
            )
        except ValueError as exc:
            raise InvalidArgumentError(f"malformed dataset manifest {msg.name!r}: {exc}") from None


def _typed(body: Any, key: str, kind: type) -> Any:
    if not isinstance(body, dict) or key not in body:
        raise InvalidArgumentError(f"manifest: missing field {key!r}")
    value = body[key]
    # bool is an int subclass; a manifest saying "slice_count": true is wrong.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgumentError(f"manifest: field {key!r} must be {kind.__name__}")
    return value


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"manifest: {where} must be integers")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"manifest: {where} must be strings")
    return value


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class Dataset:
    """A prepared dataset on disk, opened and checked (not hashed) once."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = root
        self.manifest = manifest

    @property
    def name(self) -> str:
        return self.manifest.name

    @classmethod
    def open(cls, path: str | Path) -> Dataset:
        """Read the manifest and check that every slice file is there with its
        recorded size. Contents are hashed only when read, so opening a large
        data dir stays fast."""
        root = Path(path)
        manifest_path = root / MANIFEST_NAME
        if not root.is_dir():
            raise NotFoundError(f"dataset directory {root} does not exist")
        try:
            text = manifest_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise NotFoundError(f"{manifest_path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise DataLossError(f"cannot read {manifest_path}: {exc}") from None
        try:
            manifest = Manifest.from_json(text)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{manifest_path}: {exc.message}") from None
        dataset = cls(root, manifest)
        for index in range(manifest.slice_count):
            file = dataset.slice_path(index)
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise DataLossError(f"dataset {manifest.name}: slice file {file.name} is missing") from None
            if size != manifest.slice_bytes[index]:
                raise DataLossError(
                    f"dataset {manifest.name}: slice file {file.name} has {size} bytes, "
                    f"manifest says {manifest.slice_bytes[index]}"
                )
        return dataset

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.manifest.slice_count:
            raise OutOfRangeError(
                f"dataset {self.name}: slice {index} out of range 0..{self.manifest.slice_count - 1}"
            )

    def slice_path(self, index: int) -> Path:
        self._check_index(index)
        return self.root / slice_file_name(index)

    def slice_sha256(self, index: int) -> str:
        self._check_index(index)
        return self.manifest.sha256[index]

    def slice_size(self, index: int) -> int:
        self._check_index(index)
        return self.manifest.slice_bytes[index]

    def read_slice_bytes(self, index: int) -> bytes:
        """The slice file's bytes, refused (``DataLossError``) unless they still
        hash to the manifest's sha256."""
        path = self.slice_path(index)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DataLossError(f"dataset {self.name}: cannot read {path.name}: {exc}") from None
        if sha256_hex(data) != self.manifest.sha256[index]:
            raise DataLossError(f"dataset {self.name}: slice {index} ({path.name}) fails its sha256 check")
        return data

    def load_slice(self, index: int) -> dict[str, torch.Tensor]:
        return load_slice_tensors(self.read_slice_bytes(index))

    def verify(self) -> list[int]:
        """Indices of slices whose bytes no longer match the manifest."""
        bad = []
        for index in range(self.manifest.slice_count):
            try:
                self.read_slice_bytes(index)
            except DataLossError:
                bad.append(index)
        return bad


def load_slice_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Decode one slice's SafeTensors bytes (as served) into tensors."""
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as exc:  # the library raises its own error types and plain ones
        raise DataLossError(f"slice bytes are not valid safetensors: {exc}") from None


def scan_data_dir(path: str | Path) -> dict[str, Dataset]:
    """Every servable dataset in a data dir, by name. Temp and hidden dirs
    (``.<name>.tmp-*`` from an unfinished prepare) are skipped silently;
    broken datasets are logged and skipped so one bad dir cannot take the
    node down."""
    root = Path(path)
    if not root.is_dir():
        raise NotFoundError(f"data directory {root} does not exist")
    found: dict[str, Dataset] = {}
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            dataset = Dataset.open(child)
        except HyphaError as exc:
            logger.warning("skipping dataset dir %s: %s", child, exc.message)
            continue
        if dataset.name != child.name:
            logger.warning(
                "skipping dataset dir %s: manifest names it %r; the dir must carry its name",
                child,
                dataset.name,
            )
            continue
        found[dataset.name] = dataset
    return found


def load_slice_file(path: Path | str) -> dict[str, torch.Tensor]:
    """A slice file's tensors; damaged bytes are a DataLossError."""
    return load_slice_tensors(Path(path).read_bytes())
