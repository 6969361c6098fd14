"""write_atomic: a reader sees the old file or the whole new one, with the mode asked for."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from hypha import fsutil
from hypha.fsutil import write_atomic


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
