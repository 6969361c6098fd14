"""Persisting the parameter server after every round, so a restarted server resumes exactly.

A checkpoint is two files in one directory:

- ``state-<round>-<token>.safetensors``: θ_global (``params/<name>``) and the
  momentum buffer (``momentum/<name>``), fp32 (a ``pack``, which ``unpack`` reads: the
  parameter server publishes this file for the scheduler, so a round's state
  is serialized once);
- ``checkpoint.json``: round number, expected workers, outer settings and step
  count, quorum and timeouts, and the name and sha256 of the tensors file.

Each file is written to a temporary name and moved into place, and fsynced
before the JSON names it (``write_pack``, then ``commit``). The JSON goes last,
with ``os.replace``, and is the commit point: until it is
replaced, the previous JSON still names the previous tensors file, which is
only deleted afterwards. A crash at any moment therefore leaves one complete,
verifiable checkpoint (the old or the new), never a mix. Tensor files carry a
random token so that saving the same round twice never overwrites the file the
current JSON points to.

The round in progress (deltas received but not yet aggregated) is not saved:
after a restart the server collects that round again from scratch.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from safetensors.torch import save_file as _st_save_file

from hypha.diloco.outer import NesterovOuter, OuterStateDict
from hypha.diloco.rounds import Quorum
from hypha.diloco.server_core import ParameterServerCore
from hypha.errors import DataLossError, HyphaError, NotFoundError
from hypha.fsutil import fsync_dir, write_atomic
from hypha.tensors.payload import read_metadata

FORMAT_VERSION = 1
MANIFEST_NAME = "checkpoint.json"
#: Header metadata of a ``pack`` blob: the manifest (JSON), and the round alone.
PACKED_MANIFEST_KEY = "hypha.ps_checkpoint"
PACKED_ROUND_KEY = "hypha.ps_round"
_PARAMS = "params/"
_MOMENTUM = "momentum/"


@dataclass(frozen=True)
class Checkpoint:
    """The persisted state of a parameter server, as read back from disk."""

    round_number: int
    expected: frozenset[str]
    outer: OuterStateDict
    round_timeout_s: float
    quorum: Quorum
    give_up_after_s: float | None
    reject_non_finite: bool
    #: Streaming fragments (parameter names per fragment); None: whole-model rounds.
    fragments: tuple[tuple[str, ...], ...] | None = None


def save(directory: str | Path, core: ParameterServerCore) -> Path:
    """Write ``core``'s state atomically under ``directory``; returns the manifest's path.

    Call it after each completed round (the state then holds the round that
    is about to collect). Older tensor files are removed once the new
    manifest is in place.
    """
    return commit(write_pack(directory, core))


@dataclass(frozen=True)
class PackFile:
    """A state written as a ``pack`` file in a checkpoint directory, not yet committed.

    It is a ``pack`` (what ``unpack`` reads; the header's metadata order is safetensors'
    hash-map order, so not always the same bytes), so the parameter server publishes this very
    file (a hard link) for the scheduler while ``commit`` makes it durable: a round's
    state is serialized once, straight to disk (``safetensors.torch.save_file``; a
    ``bytes`` of a large state faults in fresh pages twice, docs/performance.md).
    """

    path: Path
    manifest: dict[str, Any]


def write_pack(directory: str | Path, core: ParameterServerCore) -> PackFile:
    """Write ``core``'s state as a new ``state-<round>-<token>.safetensors`` in ``directory``.

    No manifest names it yet: until ``commit``, the checkpoint is still the old one,
    and a file left by a crash here is removed by the next commit.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, manifest = _tensors_and_manifest(core)
    path = directory / f"state-{core.round_number:08d}-{secrets.token_hex(4)}.safetensors"
    partial = path.with_name(f".{path.name}.tmp")
    try:
        _st_save_file(tensors, partial, metadata=_pack_metadata(manifest))
        partial.rename(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return PackFile(path, manifest)


def commit(written: PackFile) -> Path:
    """Make ``written`` the checkpoint: fsync it, then replace the manifest; its path.

    The file's sha256 is taken while the fsync waits for the disk (a second thread: both
    drop the GIL), not after it: each took 4-5 ms of a round for a 0.85M-parameter
    model's pack, on the parameter server's path to the next θ_global (docs/performance.md).
    """
    directory, name = written.path.parent, written.path.name
    with open(written.path, "rb") as handle, ThreadPoolExecutor(1, "hypha-fsync") as fsync:
        synced = fsync.submit(os.fsync, handle.fileno())
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
        synced.result()
    fsync_dir(directory)
    manifest = {**written.manifest, "tensors_file": name, "tensors_sha256": digest}
    manifest_path = directory / MANIFEST_NAME
    write_atomic(manifest_path, json.dumps(manifest, indent=2, sort_keys=True).encode())
    for stale in directory.glob("state-*.safetensors"):
        if stale.name != name:
            stale.unlink(missing_ok=True)
    return manifest_path


def _tensors_and_manifest(core: ParameterServerCore) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """θ_global and momentum as named CPU fp32 tensors, and everything else as a JSON-able manifest."""
    state = core.outer.state_dict()
    tensors = {_PARAMS + name: t for name, t in state["params"].items()}
    if state["momentum_buffer"] is not None:
        tensors.update({_MOMENTUM + name: t for name, t in state["momentum_buffer"].items()})
    # Contiguous CPU fp32 views, no copies for state that already lives there.
    tensors = {k: t.detach().to("cpu", torch.float32).contiguous() for k, t in tensors.items()}
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "round_number": core.round_number,
        "expected": sorted(core.expected),
        "names": list(state["params"]),
        "lr": state["lr"],
        "momentum": state["momentum"],
        "steps": state["steps"],
        "has_momentum_buffer": state["momentum_buffer"] is not None,
        "round_timeout_s": core.round_timeout_s,
        "quorum": core.quorum,
        "give_up_after_s": core.give_up_after_s,
        "reject_non_finite": core.reject_non_finite,
    }
    if core.fragments is not None:
        manifest["fragments"] = core.fragments
    return tensors, manifest


def pack(core: ParameterServerCore) -> bytes:
    """The whole checkpoint as one self-describing safetensors blob: what leaves the machine.

    The manifest rides in the header's metadata (``PACKED_MANIFEST_KEY``), the
    round number also under ``PACKED_ROUND_KEY`` so a reader without torch (the
    scheduler) can tell which round a blob holds from its header alone.
    """
    tensors, manifest = _tensors_and_manifest(core)
    return bytes(_st_save(tensors, metadata=_pack_metadata(manifest)))


def _pack_metadata(manifest: dict[str, Any]) -> dict[str, str]:
    return {
        PACKED_MANIFEST_KEY: json.dumps(manifest, sort_keys=True),
        PACKED_ROUND_KEY: str(manifest["round_number"]),
    }


def unpack(blob: bytes) -> Checkpoint:
    """Read a ``pack`` blob back; DataLossError if it is not a complete, consistent one."""
    try:
        manifest = json.loads(read_metadata(blob)[PACKED_MANIFEST_KEY])
        tensors = _st_load(blob)
    except (HyphaError, KeyError, TypeError, ValueError, SafetensorError) as exc:
        raise DataLossError(f"packed parameter-server state is damaged: {exc!r}") from None
    try:
        return _checkpoint_of(manifest, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLossError(f"packed parameter-server state is damaged: {exc!r}") from None


def state_digest(outer: OuterStateDict) -> str:
    """sha256 over θ_global and the momentum buffer, name by name (dtype, shape and raw bytes).

    Two states with the same digest are equal bit for bit: what a restored
    server logs, and what tests compare with the checkpoint it came from.
    """
    digest = hashlib.sha256()
    parts = [("params", outer["params"]), ("momentum", outer["momentum_buffer"] or {})]
    for prefix, tensors in parts:
        for name in sorted(tensors):
            tensor = tensors[name].detach().to("cpu").contiguous()
            digest.update(f"{prefix}/{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def exists(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST_NAME).is_file()


def read(directory: str | Path) -> Checkpoint:
    """Read and verify the checkpoint; NotFoundError if there is none, DataLossError if it is damaged."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except FileNotFoundError:
        raise NotFoundError(f"no parameter-server checkpoint in {directory}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataLossError(f"checkpoint manifest {manifest_path} is damaged: {exc}") from None
    try:
        return _from_manifest(directory, manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLossError(f"checkpoint manifest {manifest_path} is damaged: {exc!r}") from None


def restore(checkpoint: Checkpoint, *, device: torch.device | str | None = None) -> ParameterServerCore:
    """A parameter server core in exactly the checkpointed state, collecting its round afresh."""
    outer = NesterovOuter.from_state_dict(checkpoint.outer, device=device)
    return ParameterServerCore(
        outer,
        checkpoint.expected,
        checkpoint.round_timeout_s,
        checkpoint.quorum,
        round_number=checkpoint.round_number,
        give_up_after_s=checkpoint.give_up_after_s,
        reject_non_finite=checkpoint.reject_non_finite,
        fragments=checkpoint.fragments,
    )


def load(directory: str | Path, *, device: torch.device | str | None = None) -> ParameterServerCore:
    """``restore(read(directory))``: resume a parameter server from its directory."""
    return restore(read(directory), device=device)


def _from_manifest(directory: Path, manifest: dict[str, Any]) -> Checkpoint:
    if manifest.get("format") != FORMAT_VERSION:
        raise DataLossError(f"unsupported checkpoint format {manifest.get('format')!r}")
    tensors_path = directory / Path(manifest["tensors_file"]).name
    try:
        blob = tensors_path.read_bytes()
    except FileNotFoundError:
        raise DataLossError(f"checkpoint tensors file {tensors_path} is missing") from None
    if hashlib.sha256(blob).hexdigest() != manifest["tensors_sha256"]:
        raise DataLossError(f"checkpoint tensors file {tensors_path} does not match its sha256")
    try:
        tensors = _st_load(blob)
    except SafetensorError as exc:
        raise DataLossError(f"checkpoint tensors file {tensors_path} is damaged: {exc}") from None
    return _checkpoint_of(manifest, tensors)


def _checkpoint_of(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Checkpoint:
    if manifest.get("format") != FORMAT_VERSION:
        raise DataLossError(f"unsupported checkpoint format {manifest.get('format')!r}")
    names: list[str] = list(manifest["names"])
    params = {name: tensors[_PARAMS + name].clone() for name in names}
    buffer = (
        {name: tensors[_MOMENTUM + name].clone() for name in names}
        if manifest["has_momentum_buffer"]
        else None
    )
    quorum = manifest["quorum"]
    if isinstance(quorum, bool) or not isinstance(quorum, int | float):
        raise DataLossError(f"checkpoint quorum {quorum!r} is not a number")
    give_up = manifest["give_up_after_s"]
    fragments = manifest.get("fragments")  # absent before streaming existed
    return Checkpoint(
        round_number=int(manifest["round_number"]),
        expected=frozenset(str(w) for w in manifest["expected"]),
        outer=OuterStateDict(
            params=params,
            momentum_buffer=buffer,
            lr=float(manifest["lr"]),
            momentum=float(manifest["momentum"]),
            steps=int(manifest["steps"]),
        ),
        round_timeout_s=float(manifest["round_timeout_s"]),
        quorum=quorum,
        give_up_after_s=None if give_up is None else float(give_up),
        reject_non_finite=bool(manifest["reject_non_finite"]),
        fragments=None if fragments is None else tuple(tuple(str(n) for n in g) for g in fragments),
    )
