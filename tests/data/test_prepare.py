"""``hypha-data prepare``: round trips, atomic writes, clear errors, and the synthetic generators."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hypha.datasets import synthetic
from hypha.datasets.format import Dataset
from hypha.datasets.prepare import (
    prepare_arrays,
    prepare_synthetic,
    prepare_text,
    write_dataset,
)
from hypha.datasets.prepare_cli import main_prepare
from hypha.errors import AlreadyExistsError, HyphaError, InvalidArgumentError, NotFoundError

BYTE_EOS, BYTE_PAD = synthetic.BYTE_EOS_ID, synthetic.BYTE_PAD_ID


def _all_tensors(dataset: Dataset) -> dict[str, torch.Tensor]:
    slices = [dataset.load_slice(i) for i in range(dataset.manifest.slice_count)]
    return {name: torch.cat([s[name] for s in slices]) for name in slices[0]}


def _assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert got[name].numpy().tobytes() == tensor.numpy().tobytes(), name


# ---- round trips ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "options"),
    [("arithmetic", {"seq_len": 32}), ("shapes", {"image_size": 12, "channels": 3})],
)
def test_synthetic_dataset_round_trips_bit_identical(
    tmp_path: Path, kind: str, options: dict[str, int]
) -> None:
    # Prepare
    want = synthetic.generate(kind, 150, seed=7, **options)

    # Execute
    dataset = prepare_synthetic(kind, tmp_path, "syn", 150, 32, 7, **cast(dict[str, Any], options))

    # Assert
    _assert_bit_identical(_all_tensors(Dataset.open(tmp_path / "syn")), want.tensors)
    assert dataset.manifest.slice_count == 5
    assert dict(dataset.manifest.metadata) == want.metadata


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_array_file_round_trips_bit_identical(tmp_path: Path, suffix: str) -> None:
    # Prepare
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {
        "features": rng.normal(size=(23, 2, 3)).astype(np.float32),
        "ids": rng.integers(-5, 5, size=(23,)).astype(np.int16),
        "flags": rng.integers(0, 2, size=(23, 4)).astype(bool),
        "bytes": rng.integers(0, 255, size=(23, 5)).astype(np.uint8),
        "wide": rng.normal(size=(23,)).astype(np.float64),
    }
    source = tmp_path / f"in{suffix}"
    if suffix == ".npz":
        np.savez(source, **cast(dict[str, Any], arrays))
    else:
        save_file({k: torch.from_numpy(v) for k, v in arrays.items()}, str(source))

    # Execute
    dataset = prepare_arrays(source, tmp_path / "data", "arr", samples_per_slice=5)

    # Assert
    _assert_bit_identical(_all_tensors(dataset), {k: torch.from_numpy(v) for k, v in arrays.items()})
    assert dataset.manifest.slice_count == 5
    assert dataset.manifest.samples_in_slice(4) == 3
    specs = {t.name: (t.dtype, t.shape) for t in dataset.manifest.tensors}
    assert specs["features"] == ("float32", (5, 2, 3))
    assert specs["flags"] == ("bool", (5, 4))


def test_manifest_checksums_and_sizes_match_the_files(tmp_path: Path) -> None:
    dataset = prepare_synthetic("shapes", tmp_path, "shp", samples=40, samples_per_slice=16)
    for index in range(dataset.manifest.slice_count):
        data = dataset.slice_path(index).read_bytes()
        assert hashlib.sha256(data).hexdigest() == dataset.manifest.sha256[index]
        assert len(data) == dataset.manifest.slice_bytes[index]


def test_progress_reports_every_slice(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    prepare_synthetic(
        "arithmetic",
        tmp_path,
        "a",
        samples=10,
        samples_per_slice=3,
        progress=lambda d, t: seen.append((d, t)),
    )
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


# ---- text -------------------------------------------------------------------


def test_byte_level_text_is_packed_exactly(tmp_path: Path) -> None:
    # Prepare: two documents; the second is not ASCII, to show bytes, not characters.
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes(b"hello")
    second.write_bytes("wö\n".encode())
    stream = [*b"hello", BYTE_EOS, *"wö\n".encode(), BYTE_EOS]  # 11 tokens

    # Execute
    dataset = prepare_text([first, second], tmp_path / "data", "txt", seq_len=4, samples_per_slice=2)

    # Assert
    got = _all_tensors(dataset)
    padded = [*stream, BYTE_PAD]
    assert got["input_ids"].tolist() == [padded[0:4], padded[4:8], padded[8:12]]
    assert got["attention_mask"].tolist() == [[1] * 4, [1] * 4, [1, 1, 1, 0]]
    assert got["labels"].tolist() == [stream[0:4], stream[4:8], [*stream[8:11], synthetic.IGNORE_INDEX]]
    meta = dataset.manifest.metadata
    assert (meta["tokenizer"], meta["vocab_size"], meta["eos_id"], meta["pad_id"]) == (
        "byte",
        "258",
        "256",
        "257",
    )
    assert (meta["seq_len"], meta["token_count"], meta["documents"]) == ("4", "11", "2")


def test_text_directory_stands_for_its_files_in_name_order(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_bytes(b"B")
    (corpus / "sub" / "c.txt").write_bytes(b"C")
    (corpus / "a.txt").write_bytes(b"A")
    dataset = prepare_text([corpus], tmp_path / "data", "dir", seq_len=8)
    assert _all_tensors(dataset)["input_ids"][0, :6].tolist() == [65, BYTE_EOS, 66, BYTE_EOS, 67, BYTE_EOS]


def test_hugging_face_tokenizer_from_a_local_dir(tmp_path: Path) -> None:
    # Prepare: a tiny word-level tokenizer saved the way the hub stores them.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, "[PAD]": 2, "hello": 3, "world": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    ).save_pretrained(tmp_path / "tok")
    text = tmp_path / "t.txt"
    text.write_text("hello world hello other")

    # Execute
    dataset = prepare_text([text], tmp_path / "data", "hf", seq_len=4, tokenizer=str(tmp_path / "tok"))

    # Assert
    got = _all_tensors(dataset)
    assert got["input_ids"].tolist() == [[3, 4, 3, 0], [1, 2, 2, 2]]
    assert got["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert dataset.manifest.metadata["vocab_size"] == "5"
    assert (dataset.manifest.metadata["eos_id"], dataset.manifest.metadata["pad_id"]) == ("1", "2")


# ---- failures leave nothing behind -------------------------------------------


def _write_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


FAILURES: list[tuple[str, type[HyphaError], Callable[[Path, Path], object]]] = [
    ("missing text file", NotFoundError, lambda src, out: prepare_text([src / "nope.txt"], out, "d")),
    ("empty text", InvalidArgumentError, lambda src, out: prepare_text([_touch(src / "e.txt")], out, "d")),
    ("no text files", InvalidArgumentError, lambda src, out: prepare_text([], out, "d")),
    (
        "missing tokenizer dir",
        NotFoundError,
        lambda src, out: prepare_text([_text(src)], out, "d", tokenizer="./no/tok"),
    ),
    (
        "unknown tokenizer",
        InvalidArgumentError,
        lambda src, out: prepare_text([_text(src)], out, "d", tokenizer="bad name!!"),
    ),
    (
        "seq_len too short",
        InvalidArgumentError,
        lambda src, out: prepare_text([_text(src)], out, "d", seq_len=1),
    ),
    ("missing array file", NotFoundError, lambda src, out: prepare_arrays(src / "nope.npz", out, "d")),
    ("unsupported array file", InvalidArgumentError, lambda src, out: prepare_arrays(_text(src), out, "d")),
    (
        "inconsistent first dimensions",
        InvalidArgumentError,
        lambda src, out: prepare_arrays(
            _write_npz(src / "x.npz", a=np.zeros((3, 2)), b=np.zeros(4)), out, "d"
        ),
    ),
    ("no arrays", InvalidArgumentError, lambda src, out: prepare_arrays(_write_npz(src / "x.npz"), out, "d")),
    (
        "no samples",
        InvalidArgumentError,
        lambda src, out: prepare_arrays(_write_npz(src / "x.npz", a=np.zeros((0, 2))), out, "d"),
    ),
    (
        "scalar array",
        InvalidArgumentError,
        lambda src, out: prepare_arrays(
            _write_npz(src / "x.npz", a=np.array(1.0, dtype=np.float32)), out, "d"
        ),
    ),
    (
        "pickled objects",
        InvalidArgumentError,
        lambda src, out: prepare_arrays(
            _write_npz(src / "x.npz", a=np.array([{}, {}], dtype=object)), out, "d"
        ),
    ),
    ("garbage npz", InvalidArgumentError, lambda src, out: prepare_arrays(_garbage(src / "x.npz"), out, "d")),
    ("unknown synthetic kind", InvalidArgumentError, lambda src, out: prepare_synthetic("mnist", out, "d")),
    (
        "option of another kind",
        InvalidArgumentError,
        lambda src, out: prepare_synthetic("shapes", out, "d", seq_len=5),
    ),
    ("zero samples", InvalidArgumentError, lambda src, out: prepare_synthetic("shapes", out, "d", samples=0)),
    (
        "bad samples_per_slice",
        InvalidArgumentError,
        lambda src, out: prepare_synthetic("shapes", out, "d", samples_per_slice=0),
    ),
    ("bad name", InvalidArgumentError, lambda src, out: prepare_synthetic("shapes", out, "../d")),
]


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _text(src: Path) -> Path:
    path = src / "t.txt"
    path.write_text("some text")
    return path


def _garbage(path: Path) -> Path:
    path.write_bytes(b"PK\x03\x04 not really a zip")
    return path


@pytest.mark.parametrize(("case", "error", "run"), FAILURES, ids=[f[0] for f in FAILURES])
def test_bad_input_fails_clearly_and_leaves_nothing(
    tmp_path: Path, case: str, error: type[HyphaError], run: Callable[[Path, Path], object]
) -> None:
    # Prepare
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()

    # Execute
    with pytest.raises(error) as caught:
        run(src, out)

    # Assert
    assert caught.value.message
    assert list(out.iterdir()) == []


def test_failure_while_writing_removes_the_temp_dir(tmp_path: Path) -> None:
    def explode(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_synthetic("shapes", tmp_path, "d", samples=64, samples_per_slice=8, progress=explode)
    assert list(tmp_path.iterdir()) == []


def test_existing_dataset_is_kept_unless_overwrite(tmp_path: Path) -> None:
    # Prepare
    first = prepare_synthetic("arithmetic", tmp_path, "d", samples=8, samples_per_slice=4, seed=1)

    # Execute / Assert: refused, untouched
    with pytest.raises(AlreadyExistsError):
        prepare_synthetic("arithmetic", tmp_path, "d", samples=8, samples_per_slice=4, seed=2)
    assert Dataset.open(tmp_path / "d").manifest == first.manifest

    # Execute / Assert: replaced, with nothing left over
    second = prepare_synthetic(
        "arithmetic", tmp_path, "d", samples=8, samples_per_slice=4, seed=2, overwrite=True
    )
    assert Dataset.open(tmp_path / "d").manifest == second.manifest != first.manifest
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_write_dataset_keeps_tensor_names_and_order(tmp_path: Path) -> None:
    tensors = {"b": torch.ones(3, 2), "a": torch.zeros(3, dtype=torch.int32)}
    dataset = write_dataset(tensors, tmp_path, "w", samples_per_slice=2)
    assert [t.name for t in dataset.manifest.tensors] == ["b", "a"]


# ---- synthetic generators ---------------------------------------------------

_PROBLEM = re.compile(r"(\d{3})\+(\d{3})=(\d+)\n")


def _problem(row: torch.Tensor) -> tuple[int, int, str]:
    """(a, b, answer as written) of one row, which holds exactly one problem and padding."""
    found = _PROBLEM.fullmatch(synthetic.decode_bytes(row.tolist()))
    assert found is not None, synthetic.decode_bytes(row.tolist())
    return int(found[1]), int(found[2]), found[3]


def test_arithmetic_rows_hold_one_problem_with_the_answer_reversed_and_labelled_alone() -> None:
    # Execute
    data = synthetic.arithmetic(500, seed=3)
    ids, mask, labels = (data.tensors[k] for k in ("input_ids", "attention_mask", "labels"))

    # Assert
    assert ids.shape == (500, len("999+999=8991\n"))
    for row in range(500):
        a, b, answer = _problem(ids[row])
        assert answer == str(a + b)[::-1] and synthetic.read_answer(answer) == a + b
        line = f"{a:03d}+{b:03d}={answer}\n"
        assert mask[row].tolist() == [1] * len(line) + [0] * (ids.shape[1] - len(line))
        # Loss only on the answer and its newline: the prompt's digits are random.
        want = [synthetic.IGNORE_INDEX] * 8 + list(f"{answer}\n".encode())
        want += [synthetic.IGNORE_INDEX] * (ids.shape[1] - len(want))
        assert labels[row].tolist() == want
    assert (ids[mask == 0] == BYTE_PAD).all()
    assert data.metadata["max_operand"] == "999"
    assert synthetic.read_answer("x1") is None


def test_arithmetic_corpus_is_deterministic_fresh_and_never_holds_a_heldout_pair() -> None:
    # Execute
    one = synthetic.arithmetic(20_000, seed=3)
    two = synthetic.arithmetic(20_000, seed=3)
    other = synthetic.arithmetic(200, seed=4)

    # Assert
    _assert_bit_identical(one.tensors, two.tensors)
    assert not torch.equal(one.tensors["input_ids"][:200], other.tensors["input_ids"])
    pairs = [_problem(row)[:2] for row in one.tensors["input_ids"]]
    assert not any(synthetic.is_heldout(a, b) for a, b in pairs)
    heldout = {prompt for prompt, _ in synthetic.heldout_sums(5000, seed=0)}
    assert not {synthetic.arithmetic_prompt(a, b) for a, b in pairs} & heldout
    # Fresh problems: drawn from ~900,000 training pairs, 20,000 rows barely repeat.
    assert len(set(pairs)) > 19_500


def test_heldout_is_a_tenth_of_the_pairs_by_hash_alone() -> None:
    everything = np.arange(1000)
    a, b = np.repeat(everything, 1000), np.tile(everything, 1000)
    held = synthetic.heldout_mask(a, b)
    assert 0.095 < held.mean() < 0.105
    # Not a pattern a model could learn: every operand value has held-out partners.
    assert (held.reshape(1000, 1000).sum(axis=1) > 50).all()
    assert [synthetic.is_heldout(int(x), int(y)) for x, y in zip(a[:3000], b[:3000], strict=True)] == (
        held[:3000].tolist()
    )


def test_small_operands_keep_the_format() -> None:
    data = synthetic.arithmetic(50, seed=1, max_operand=99, seq_len=12)
    for row in data.tensors["input_ids"]:
        text = synthetic.decode_bytes(row.tolist())
        prompt, answer = text.rstrip("\n").split("=")
        a, b = (int(x) for x in prompt.split("+"))
        assert len(prompt) == 5 and 0 <= a <= 99 and 0 <= b <= 99 and answer == str(a + b)[::-1]
    with pytest.raises(InvalidArgumentError):
        synthetic.arithmetic(5, seq_len=12)  # 13 bytes for 3-digit problems


def _all_heldout() -> list[tuple[int, int]]:
    return [(a, b) for a in range(100) for b in range(100) if synthetic.is_heldout(a, b)]


def test_heldout_sums_are_distinct_deterministic_and_correct() -> None:
    pairs = synthetic.heldout_sums(50, seed=1, max_operand=99)
    assert pairs == synthetic.heldout_sums(50, seed=1, max_operand=99)
    assert pairs != synthetic.heldout_sums(50, seed=2, max_operand=99)
    assert len(set(pairs)) == 50
    for prompt, answer in pairs:
        a, b = (int(x) for x in prompt.removesuffix("=").split("+"))
        assert prompt == f"{a:02d}+{b:02d}="
        assert synthetic.is_heldout(a, b) and synthetic.read_answer(answer) == a + b
    assert 500 < len(_all_heldout()) < 1500  # about a tenth of the 10,000 pairs
    with pytest.raises(InvalidArgumentError):
        synthetic.heldout_sums(len(_all_heldout()) + 1, max_operand=99)


def test_exact_match_accuracy_reads_the_first_line_of_the_completion() -> None:
    pairs = [("1+2=", "3"), ("10+5=", "15"), ("4+4=", "8"), ("7+0=", "7")]

    def model(prompt: str) -> str:
        a, b = (int(x) for x in prompt.removesuffix("=").split("+"))
        return f"{a + b}\n99+1=100\n" if a != 4 else "9\n"

    assert synthetic.exact_match_accuracy(model, pairs) == 0.75
    assert synthetic.exact_match_accuracy(lambda p: " 3 ", pairs[:1]) == 1.0
    with pytest.raises(InvalidArgumentError):
        synthetic.exact_match_accuracy(model, [])


def test_shapes_are_balanced_deterministic_and_learnable() -> None:
    # Execute
    data = synthetic.shapes(402, seed=5)
    again = synthetic.shapes(402, seed=5)

    # Assert
    _assert_bit_identical(data.tensors, again.tensors)
    pixels, labels = data.tensors["pixel_values"], data.tensors["labels"]
    assert pixels.shape == (402, 1, 16, 16) and pixels.dtype == torch.float32
    assert 0.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0
    counts = torch.bincount(labels, minlength=4).tolist()
    assert max(counts) - min(counts) <= 1
    assert data.metadata["num_labels"] == "4"
    assert data.metadata["label_names"].split(",") == list(synthetic.SHAPE_NAMES)
    # Each class has the geometry its name says: a rule on the bounding box of the
    # bright pixels (fill ratio, top vs bottom row) tells them apart.
    guesses = [_classify_by_geometry(image[0]) for image in pixels]
    accuracy = sum(g == k for g, k in zip(guesses, labels.tolist(), strict=True)) / len(guesses)
    assert accuracy > 0.95


def _classify_by_geometry(image: torch.Tensor) -> int:
    ys, xs = torch.nonzero(image > 0.3, as_tuple=True)
    box = (image > 0.3)[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].float()
    fill, top, bottom = box.mean().item(), box[0].sum().item(), box[-1].sum().item()
    if fill > 0.95:
        return synthetic.SHAPE_NAMES.index("square")
    if fill < 0.7 and abs(top - bottom) <= 1:
        return synthetic.SHAPE_NAMES.index("cross")
    if fill < 0.7 and bottom >= top + 3:
        return synthetic.SHAPE_NAMES.index("triangle")
    return synthetic.SHAPE_NAMES.index("circle")


# ---- CLI --------------------------------------------------------------------


def test_cli_prepares_and_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main_prepare(
        [
            "--data-dir",
            str(tmp_path),
            "--name",
            "arith",
            "--synthetic",
            "arithmetic",
            "--samples",
            "20",
            "--samples-per-slice",
            "8",
            "--seq-len",
            "24",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert out.count("\n") == 1 and "arith" in out and "20 samples in 3 slices" in out
    assert "3/3 slices" in err
    assert Dataset.open(tmp_path / "arith").manifest.metadata["seq_len"] == "24"


@pytest.mark.parametrize(
    "argv",
    [
        ["--name", "x", "--synthetic", "shapes"],  # no --data-dir
        ["--data-dir", "D", "--name", "x"],  # no source
        ["--data-dir", "D", "--name", "x", "--synthetic", "shapes", "--tokenizer", "byte"],
        ["--data-dir", "D", "--name", "x", "--arrays", "missing.npz"],
        ["--data-dir", "D", "--name", "x", "--synthetic", "shapes", "--samples", "0"],
    ],
)
def test_cli_errors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code = main_prepare([str(tmp_path / "D") if a == "D" else a for a in argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("hypha-data: error: ") and err.count("\n") == 1
