"""The dataset format: manifest validation, verified reads, chunked streaming, data-dir scanning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from hypha.datasets.format import (
    MANIFEST_NAME,
    Dataset,
    Manifest,
    TensorSpec,
    load_slice_tensors,
    scan_data_dir,
    slice_file_name,
)
from hypha.datasets.prepare import write_dataset
from hypha.errors import DataLossError, InvalidArgumentError, NotFoundError, OutOfRangeError


def _tensors(samples: int = 10) -> dict[str, torch.Tensor]:
    return {
        "x": torch.arange(samples * 3, dtype=torch.float32).reshape(samples, 3),
        "y": torch.arange(samples, dtype=torch.int64),
    }


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    return write_dataset(_tensors(10), tmp_path, "toy", samples_per_slice=4, metadata={"source": "test"})


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_survives_json_and_proto_round_trips(dataset: Dataset) -> None:
    # Prepare
    manifest = dataset.manifest

    # Execute
    from_json = Manifest.from_json(manifest.to_json())
    from_proto = Manifest.from_proto(manifest.to_proto())

    # Assert
    assert from_json == manifest
    assert from_proto == manifest
    proto = manifest.to_proto()
    assert proto.slice_count == 3 and list(proto.sha256) == list(manifest.sha256)
    assert [(t.name, t.dtype, list(t.shape)) for t in proto.tensors] == [
        ("x", "float32", [4, 3]),
        ("y", "int64", [4]),
    ]
    assert proto.metadata["source"] == "test"


def test_last_slice_holds_the_remainder(dataset: Dataset) -> None:
    assert dataset.manifest.sample_count == 10
    assert [dataset.manifest.samples_in_slice(i) for i in range(3)] == [4, 4, 2]
    assert dataset.load_slice(2)["y"].tolist() == [8, 9]


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda b: b.pop("slice_count"), id="missing-field"),
        pytest.param(lambda b: b.update(slice_count=True), id="bool-as-int"),
        pytest.param(lambda b: b.update(format_version=99), id="future-version"),
        pytest.param(lambda b: b.update(format="other"), id="wrong-format"),
        pytest.param(lambda b: b["sha256"].pop(), id="missing-checksum"),
        pytest.param(lambda b: b["sha256"].__setitem__(0, "zz"), id="malformed-checksum"),
        pytest.param(lambda b: b["tensors"][0].update(dtype="complex128"), id="unknown-dtype"),
        pytest.param(lambda b: b["tensors"][0].update(shape=[5, 3]), id="shape-not-per-slice"),
        pytest.param(lambda b: b.update(sample_count=3), id="too-few-samples"),
        pytest.param(lambda b: b.update(name="../escape"), id="unsafe-name"),
        pytest.param(lambda b: b["metadata"].update(n=1), id="non-string-metadata"),
    ],
)
def test_malformed_manifest_is_rejected(dataset: Dataset, edit: object) -> None:
    # Prepare
    body = json.loads(dataset.manifest.to_json())
    edit(body)  # type: ignore[operator]
    (dataset.root / MANIFEST_NAME).write_text(json.dumps(body))

    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        Dataset.open(dataset.root)


def test_open_without_manifest_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError):
        Dataset.open(tmp_path / "empty")
    with pytest.raises(NotFoundError):
        Dataset.open(tmp_path / "absent")


def test_open_notices_missing_and_truncated_slices(dataset: Dataset) -> None:
    # Prepare
    last = dataset.slice_path(2)
    last.write_bytes(last.read_bytes()[:-1])

    # Execute / Assert
    with pytest.raises(DataLossError, match="bytes"):
        Dataset.open(dataset.root)
    last.unlink()
    with pytest.raises(DataLossError, match="missing"):
        Dataset.open(dataset.root)


def test_reading_a_rotted_slice_is_data_loss(dataset: Dataset) -> None:
    # Prepare: same size, different bytes, so only the checksum can tell.
    _flip_one_byte(dataset.slice_path(1))

    # Execute / Assert
    with pytest.raises(DataLossError, match="sha256"):
        dataset.read_slice_bytes(1)
    assert dataset.verify() == [1]
    assert dataset.read_slice_bytes(0) == dataset.slice_path(0).read_bytes()


@pytest.mark.parametrize("index", [-1, 3, 1000])
def test_bad_slice_index_is_out_of_range(dataset: Dataset, index: int) -> None:
    with pytest.raises(OutOfRangeError):
        dataset.read_slice_bytes(index)
    with pytest.raises(OutOfRangeError):
        dataset.slice_path(index)


def test_scan_skips_broken_and_temp_dirs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    good = write_dataset(_tensors(5), tmp_path, "good", samples_per_slice=2)
    broken = write_dataset(_tensors(5), tmp_path, "broken", samples_per_slice=2)
    broken.slice_path(0).unlink()
    write_dataset(_tensors(5), tmp_path, "renamed", samples_per_slice=2).root.rename(tmp_path / "other")
    (tmp_path / ".half.tmp-1234").mkdir()
    (tmp_path / "stray-file.txt").write_text("not a dataset")

    # Execute
    with caplog.at_level(logging.WARNING, logger="hypha.datasets.format"):
        found = scan_data_dir(tmp_path)

    # Assert
    assert list(found) == ["good"]
    assert found["good"].manifest == good.manifest
    assert "broken" in caplog.text and "other" in caplog.text
    assert ".half" not in caplog.text


def test_scan_of_a_missing_data_dir_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        scan_data_dir(tmp_path / "nope")


def test_load_slice_tensors_refuses_garbage() -> None:
    with pytest.raises(DataLossError):
        load_slice_tensors(b"\x00\x01 definitely not safetensors")


def test_manifest_shapes_are_per_slice() -> None:
    with pytest.raises(InvalidArgumentError, match="samples_per_slice"):
        Manifest(
            name="m",
            slice_count=1,
            samples_per_slice=2,
            sample_count=2,
            tensors=(TensorSpec("x", "float32", (3,)),),
            sha256=("0" * 64,),
            slice_bytes=(10,),
        )


def test_slice_files_are_named_by_index(dataset: Dataset) -> None:
    assert dataset.slice_path(2).name == slice_file_name(2) == "slice-000002.safetensors"
