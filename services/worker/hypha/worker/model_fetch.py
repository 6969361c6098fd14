"""Model and preprocessor files for a job: from a Hugging Face repository or a local path.

The files end up in a directory inside the job's work dir, so an executor
only ever reads from its own sandbox. Hub downloads go through
``huggingface_hub.snapshot_download`` into one cache shared by every job on
the worker (a second job of the same model downloads nothing), honouring
the spec's revision, file patterns and token and the worker's endpoint
setting; the cached blobs are then copied into the work dir (never hard
linked: a job could write through a link into the shared cache).

A local path is only taken from below the roots the operator allowed
(``local_model_roots``): the path comes from a scheduler, and without that
rule any scheduler holding a lease could copy any readable file of the
worker into a job and fetch it back as the "result".
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hypha.errors import (
    HyphaError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from hypha.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResourceSource:
    """Where a model or preprocessor comes from (the shared fields of ModelSpec and PreprocessorSpec)."""

    repository: str = ""
    revision: str = ""
    filenames: tuple[str, ...] = ()
    token: str = ""
    local_path: str = ""

    @classmethod
    def from_proto(cls, spec: common_pb2.ModelSpec | common_pb2.PreprocessorSpec) -> ResourceSource:
        return cls(spec.repository, spec.revision, tuple(spec.filenames), spec.token, spec.local_path)

    @property
    def empty(self) -> bool:
        return not self.repository and not self.local_path


@dataclass(frozen=True)
class HubSettings:
    #: Shared download cache (huggingface_hub layout).
    cache_dir: Path
    #: Hub endpoint; None means huggingface_hub's default (``HF_ENDPOINT`` or huggingface.co).
    endpoint: str | None = None
    #: Token used when the job's spec carries none.
    token: str | None = None
    #: Local paths a job may name must lie under one of these (resolved).
    local_roots: tuple[Path, ...] = ()


class ResourceFetcher:
    def __init__(self, settings: HubSettings) -> None:
        self.settings = settings

    async def fetch(self, source: ResourceSource, dest: Path) -> Path:
        """Fill ``dest`` (replaced if present) with the source's files; returns ``dest``."""
        if source.local_path:
            return await asyncio.to_thread(self._from_local, source, dest)
        if source.repository:
            snapshot = await asyncio.to_thread(self._download, source)
            return await asyncio.to_thread(_link_tree, snapshot, dest, source.filenames or None)
        raise NotFoundError("the job's spec names no repository and no local path for this resource")

    # ---- local ------------------------------------------------------------------

    def _from_local(self, source: ResourceSource, dest: Path) -> Path:
        path = Path(source.local_path).expanduser()
        if not path.is_absolute():
            raise InvalidArgumentError(f"local path {source.local_path!r} must be absolute")
        real = path.resolve()
        roots = [root.resolve() for root in self.settings.local_roots]
        if not any(real.is_relative_to(root) for root in roots):
            raise PermissionDeniedError(
                f"local path {source.local_path!r} is outside the allowed local model roots "
                "(worker setting local_model_roots)"
            )
        if not real.exists():
            raise NotFoundError(f"local path {source.local_path!r} does not exist on this worker")
        if real.is_file():
            _reset(dest)
            _link_file(real, dest / real.name)
            return dest
        return _link_tree(real, dest, source.filenames or None, roots=roots)

    # ---- hub ----------------------------------------------------------------------

    def _download(self, source: ResourceSource) -> Path:
        import huggingface_hub

        self.settings.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            folder = huggingface_hub.snapshot_download(
                source.repository,
                revision=source.revision or None,
                cache_dir=self.settings.cache_dir,
                allow_patterns=list(source.filenames) or None,
                token=source.token or self.settings.token or False,
                endpoint=self.settings.endpoint,
            )
        except Exception as err:
            raise _hub_error(source, err) from None
        snapshot = Path(folder)
        if source.filenames:
            missing = [
                name for name in source.filenames if "*" not in name and not (snapshot / name).exists()
            ]
            if missing:
                raise NotFoundError(f"{source.repository}: no file {missing[0]!r} in the repository")
        return snapshot


def _hub_error(source: ResourceSource, err: Exception) -> HyphaError:
    """The project's error for a hub failure: missing things are NOT_FOUND, the rest UNAVAILABLE."""
    from huggingface_hub import errors as hf_errors

    where = f"{source.repository}@{source.revision or 'main'}"
    # A failed lookup that found no cached copy wraps the remote error it got, if any.
    cause = err.__cause__ or err.__context__ if isinstance(err, hf_errors.LocalEntryNotFoundError) else err
    if isinstance(err, hf_errors.OfflineModeIsEnabled) or isinstance(cause, hf_errors.OfflineModeIsEnabled):
        return UnavailableError(f"{where}: the hub is offline on this worker (HF_HUB_OFFLINE)")
    if isinstance(cause, hf_errors.GatedRepoError):
        return PermissionDeniedError(f"{where}: gated repository: {_first_line(cause)}")
    if isinstance(cause, hf_errors.HfHubHTTPError) and cause.response is not None:
        if cause.response.status_code in (401, 403) and not isinstance(
            cause, hf_errors.RepositoryNotFoundError
        ):
            return PermissionDeniedError(f"{where}: refused by the hub: {_first_line(cause)}")
    if isinstance(
        cause,
        hf_errors.RepositoryNotFoundError
        | hf_errors.RevisionNotFoundError
        | hf_errors.RemoteEntryNotFoundError,
    ):
        return NotFoundError(f"{where}: {_first_line(cause)}")
    if isinstance(cause, hf_errors.HFValidationError):
        return InvalidArgumentError(f"{where}: {_first_line(cause)}")
    return UnavailableError(f"{where}: download failed: {_first_line(cause or err)}")


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _reset(dest: Path) -> None:
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    elif dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True, mode=0o700)


def _link_file(source: Path, target: Path) -> None:
    """A copy of a cached file for one job.

    NOTE: not a hard link: a link is the cache's own inode, so a job that
    writes to (or chmods) its model file would change every later job's model.
    ``copyfile`` copies inside the kernel; the work dir is the job's anyway.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def _link_tree(
    source: Path, dest: Path, names: Sequence[str] | None, *, roots: Sequence[Path] | None = None
) -> Path:
    """Mirror the files under ``source`` (or only ``names``) into ``dest``, following links.

    With ``roots``, a file whose real path leaves them (a symlink pointing
    elsewhere) is refused; hub snapshots are links into the cache's blobs
    and need no such check.
    """
    for name in names or ():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise InvalidArgumentError(f"file name {name!r} must stay inside the repository")
    _reset(dest)
    if names:
        files = []
        for name in names:
            matches = sorted(p for p in source.glob(name) if p.is_file())
            if not matches:
                raise NotFoundError(f"no file matches {name!r}")
            files.extend(matches)
    else:
        files = sorted(p for p in source.rglob("*") if p.is_file() and ".cache" not in p.parts)
    for path in files:
        relative = path.relative_to(source)
        real = path.resolve()
        if roots is not None and not any(real.is_relative_to(root) for root in roots):
            raise PermissionDeniedError(f"{relative} links outside the allowed local model roots")
        _link_file(real, dest / relative)
    if not files:
        raise NotFoundError(f"no files in {source.name}")
    return dest
