"""A task job's files on the worker: shipped ones unpacked before it starts, declared outputs kept after.

``unpack_files`` runs while the work dir is prepared, before the command:
the bundle is checked against the sha256 the scheduler named in the spec and
unpacked by ``hypha.bundles.unpack`` (no absolute names, no ``..``, no links
out of the work dir). ``keep_outputs`` runs once the command ended well:
the declared outputs move, under their relative names, into one folder that
becomes the execution's result dir, which the job manager keeps and the
scheduler pulls (``PullTensors`` kind ``result``) like a parameter server's
model. A declared output that is missing fails the task, naming it: a
"succeeded" job whose result is not there is worse than a failed one.

Blocking file-system work: callers run these in a thread.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hypha import bundles
from hypha.v1 import common_pb2

#: The folder, inside the work dir, that collects a task's outputs (then moved out as its result).
OUTPUTS_DIR = ".hypha-outputs"


def unpack_files(spec: common_pb2.TaskJobSpec, bundle: bytes, work_dir: Path) -> list[str]:
    """Unpack the job's files into its work dir; the files' relative names."""
    if not spec.files_sha256:
        return []
    return bundles.unpack(bundle, spec.files_sha256, work_dir)


def keep_outputs(spec: common_pb2.TaskJobSpec, work_dir: Path) -> tuple[Path | None, str]:
    """Move the declared outputs into ``OUTPUTS_DIR``: (that folder, "") or (None, what is missing)."""
    if not spec.outputs:
        return None, ""
    root = work_dir.resolve()
    missing = []
    for name in spec.outputs:
        source = (work_dir / bundles.check_relative(name, "outputs")).resolve()
        if not source.is_relative_to(root) or not source.exists():
            missing.append(name)
    if missing:
        return None, f"declared output(s) missing: {', '.join(missing)}"
    for name in spec.outputs:
        # A link would hand the scheduler whatever it points at on this worker.
        source = work_dir / name
        links = [source] if source.is_symlink() else [p for p in source.rglob("*") if p.is_symlink()]
        if links:
            return None, f"output {name!r} holds a symbolic link ({links[0].relative_to(work_dir)})"
    target = work_dir / OUTPUTS_DIR
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(mode=0o700)
    for name in spec.outputs:
        relative = bundles.check_relative(name, "outputs")
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(work_dir / relative, target / relative)
    return target, ""


__all__ = ["OUTPUTS_DIR", "keep_outputs", "unpack_files"]
