"""A task's declared outputs: moved into one result folder, or the task fails naming what is wrong."""

from __future__ import annotations

from pathlib import Path

from hypha.v1 import common_pb2
from hypha.worker.task_files import OUTPUTS_DIR, keep_outputs


def test_declared_outputs_move_into_the_result_folder_under_their_names(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(b"w")
    (tmp_path / "metrics.json").write_text("{}")
    (tmp_path / "scratch").write_text("not declared")

    kept, problem = keep_outputs(common_pb2.TaskJobSpec(outputs=["model/", "metrics.json"]), tmp_path)

    assert problem == "" and kept == tmp_path / OUTPUTS_DIR
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file()) == [
        "metrics.json",
        "model/w.bin",
    ]


def test_a_missing_output_is_named(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a")

    kept, problem = keep_outputs(common_pb2.TaskJobSpec(outputs=["a", "b/"]), tmp_path)

    assert kept is None and problem == "declared output(s) missing: b/"


def test_an_output_holding_a_link_out_of_the_work_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "secret").symlink_to("/etc/hostname")
    (tmp_path / "escape").symlink_to("/etc")

    kept, problem = keep_outputs(common_pb2.TaskJobSpec(outputs=["out"]), tmp_path)
    assert kept is None and "symbolic link (out/secret)" in problem

    kept, problem = keep_outputs(common_pb2.TaskJobSpec(outputs=["escape"]), tmp_path)
    assert kept is None and problem == "declared output(s) missing: escape"  # resolves outside: not ours
