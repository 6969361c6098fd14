"""write_atomic / replace_dir: a reader sees the old file (directory) or the whole new one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hypha import fsutil
from hypha.fsutil import replace_dir, write_atomic


def test_write_atomic_replaces_the_file_with_the_mode_given(tmp_path: Path) -> None:
    # Prepare
    target = tmp_path / "cert.pem"
    target.write_bytes(b"old")

    # Execute
    write_atomic(target, b"new", mode=0o644)

    # Assert: new content, asked-for mode, no temporary file left beside it
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["cert.pem"]


def test_write_atomic_is_private_by_default(tmp_path: Path) -> None:
    write_atomic(tmp_path / "key.pem", b"secret")
    assert stat.S_IMODE((tmp_path / "key.pem").stat().st_mode) == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the rename into place fails (a full disk, a crash before the commit point)
    target = tmp_path / "manifest.json"
    target.write_bytes(b"old")

    def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(fsutil.os, "replace", broken_replace)

    # Execute
    with pytest.raises(OSError, match="disk gone"):
        write_atomic(target, b"new")

    # Assert
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_replace_dir_swaps_a_whole_directory_in(tmp_path: Path) -> None:
    # Prepare: a previous result, and the finished new one beside it
    target, new = tmp_path / "result", tmp_path / "result.partial"
    target.mkdir()
    (target / "old.safetensors").write_bytes(b"old")
    new.mkdir()
    (new / "config.json").write_bytes(b"{}")

    # Execute
    replace_dir(new, target)

    # Assert: only the new files, nothing left beside it
    assert _tree(target) == {"config.json": b"{}"}
    assert [p.name for p in tmp_path.iterdir()] == ["result"]


def test_an_interrupted_replace_dir_leaves_the_previous_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: renaming the new directory into place fails (a full disk, an I/O error)
    target, new = tmp_path / "result", tmp_path / "result.partial"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"old weights")
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"new weights")
    rename = os.rename

    def broken_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(src) == new:
            raise OSError("disk gone")
        rename(src, dst)

    monkeypatch.setattr(fsutil.os, "rename", broken_rename)

    # Execute
    with pytest.raises(OSError, match="disk gone"):
        replace_dir(new, target)

    # Assert: the previous result is whole and where it was; the new one is untouched
    assert _tree(target) == {"model.safetensors": b"old weights"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result", "result.partial"]
