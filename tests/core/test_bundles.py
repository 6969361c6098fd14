"""Task files bundles: packed reproducibly, capped, and unpacked only inside the work dir."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from hypha import bundles
from hypha.errors import DataLossError, InvalidArgumentError, NotFoundError


def tree(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "data" / "a.txt").write_text("a")
    return root


def raw_tar(*members: tarfile.TarInfo, data: bytes = b"x") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for member in members:
            archive.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return buffer.getvalue()


def test_pack_then_unpack_gives_the_same_files_and_a_stable_digest(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    data = bundles.pack(["train.py", "data/"], src)

    names = bundles.unpack(data, bundles.sha256_hex(data), tmp_path / "work")

    assert sorted(names) == ["data/a.txt", "train.py"]
    assert (tmp_path / "work" / "train.py").read_text() == "print('hi')\n"
    assert (tmp_path / "work" / "data" / "a.txt").read_text() == "a"
    assert bundles.pack(["train.py", "data/"], src) == data  # reproducible: same bytes, same digest


def test_unpack_works_on_a_python_without_extraction_filters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python before 3.11.4 (Debian bookworm's 3.11.2, the worker image's stand-in base) has no ``filter``."""
    extractall = tarfile.TarFile.extractall

    def old_extractall(
        self: tarfile.TarFile, path: str | Path = ".", members: object = None, **kw: object
    ) -> None:
        if "filter" in kw:
            raise TypeError("TarFile.extractall() got an unexpected keyword argument 'filter'")
        extractall(self, path, members, **kw)  # type: ignore[arg-type]

    monkeypatch.delattr(tarfile, "data_filter")
    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    setuid = tarfile.TarInfo("run.sh")
    setuid.size, setuid.mode = 1, 0o4777
    data = raw_tar(setuid)

    assert bundles.unpack(data, bundles.sha256_hex(data), tmp_path / "work") == ["run.sh"]
    assert (tmp_path / "work" / "run.sh").read_bytes() == b"x"
    assert (tmp_path / "work" / "run.sh").stat().st_mode & 0o7777 == 0o755  # as the "data" filter leaves it


@pytest.mark.parametrize("name", ["/etc/passwd", "../up.txt", "", "."])
def test_pack_refuses_paths_outside_the_job_dir(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a relative path"):
        bundles.pack([name], tree(tmp_path))


def test_pack_names_a_missing_file_and_refuses_links(tmp_path: Path) -> None:
    src = tree(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"'nope\.py' does not exist"):
        bundles.pack(["nope.py"], src)
    (src / "data" / "link").symlink_to("/etc/passwd")
    with pytest.raises(InvalidArgumentError, match="symbolic link"):
        bundles.pack(["data"], src)


def test_a_bundle_over_the_cap_is_refused_with_advice(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(64 * 1024))
    with pytest.raises(InvalidArgumentError, match=r"above the limit .* data node"):
        bundles.pack(["big.bin"], src, limit=16 * 1024)


def test_unpack_checks_the_digest(tmp_path: Path) -> None:
    data = bundles.pack(["train.py"], tree(tmp_path / "src"))
    with pytest.raises(DataLossError, match="sha256"):
        bundles.unpack(data, "0" * 64, tmp_path / "work")


@pytest.mark.parametrize(
    ("member", "error"),
    [
        (tarfile.TarInfo("../escape.txt"), "outside its root"),
        (tarfile.TarInfo("/abs.txt"), "outside its root"),
    ],
)
def test_unpack_refuses_names_that_escape(tmp_path: Path, member: tarfile.TarInfo, error: str) -> None:
    member.size = 1
    data = raw_tar(member)
    with pytest.raises(InvalidArgumentError, match=error):
        bundles.unpack(data, bundles.sha256_hex(data), tmp_path / "work")
    assert not (tmp_path / "escape.txt").exists()


def test_unpack_refuses_links(tmp_path: Path) -> None:
    link = tarfile.TarInfo("data/passwd")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    data = raw_tar(link)
    with pytest.raises(InvalidArgumentError, match="not a file or directory"):
        bundles.unpack(data, bundles.sha256_hex(data), tmp_path / "work")


def test_unpack_caps_the_unpacked_size(tmp_path: Path) -> None:
    member = tarfile.TarInfo("zeros.bin")
    member.size = 4096
    data = raw_tar(member, data=bytes(4096))
    with pytest.raises(InvalidArgumentError, match="unpack to 4096 bytes"):
        bundles.unpack(data, bundles.sha256_hex(data), tmp_path / "work", max_unpacked=1024)


def test_store_keeps_bundles_by_digest_and_checks_them_on_read(tmp_path: Path) -> None:
    store = bundles.BundleStore(tmp_path / "bundles")
    data = bundles.pack(["train.py"], tree(tmp_path / "src"))

    sha = store.put(data)

    assert store.get(sha) == data and sha == bundles.sha256_hex(data)
    store.path(sha).write_bytes(data + b"junk")
    with pytest.raises(DataLossError):
        store.get(sha)
    with pytest.raises(NotFoundError):
        store.get("1" * 64)
    with pytest.raises(InvalidArgumentError, match=r"not a readable tar\.gz"):
        store.put(b"not a tarball")


def test_a_bundle_travels_as_a_one_tensor_safetensors_payload() -> None:
    from safetensors.numpy import load

    from hypha.tensors.payload import read_metadata

    data = bytes(range(256)) * 5 + b"tail"
    payload = bundles.as_payload(data)

    assert read_metadata(payload) == {}  # what a worker's inbox checks before queueing
    assert load(payload)[bundles.PAYLOAD_TENSOR].tobytes() == data
    assert bundles.from_payload(payload) == data
    with pytest.raises(DataLossError, match="not a bundle payload"):
        bundles.from_payload(payload[:-1])
