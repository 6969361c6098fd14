"""Turning raw data into a dataset directory (see ``dataset.py``); ``prepare_cli`` is its command line.

Sources are text files (byte-level or a Hugging Face tokenizer), arrays
(``.npz`` or ``.safetensors``) and the built-in synthetic generators. Every
path ends in ``write_dataset``, which writes into ``.<name>.tmp-XXXX`` next
to the target and renames it into place only when the manifest is written,
so a failure or an interrupt leaves no half-written dataset that a data node
could serve.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hypha.datasets import synthetic
from hypha.datasets.format import (
    DTYPES,
    MANIFEST_NAME,
    Dataset,
    Manifest,
    TensorSpec,
    sha256_hex,
    slice_file_name,
    validate_dataset_name,
)
from hypha.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from hypha.fsutil import fsync_dir, replace_dir, write_synced

if TYPE_CHECKING:
    import torch

#: Called with (slices written, slices in all) after each slice.
ProgressFn = Callable[[int, int], None]

DEFAULT_SAMPLES_PER_SLICE = 64
DEFAULT_TEXT_SEQ_LEN = 128
DEFAULT_SYNTHETIC_SAMPLES = 2048


# ---- writing ----------------------------------------------------------------


def write_dataset(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    name: str,
    samples_per_slice: int = DEFAULT_SAMPLES_PER_SLICE,
    metadata: Mapping[str, str] | None = None,
    *,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> Dataset:
    """Cut tensors that share their first dimension into slices and install
    them as ``out_dir/name``; returns the opened dataset."""
    validate_dataset_name(name)
    _check_positive("samples_per_slice", samples_per_slice)
    sample_count = _check_tensors(tensors)
    target = Path(out_dir) / name
    _refuse_existing(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)

    slice_count = math.ceil(sample_count / samples_per_slice)
    specs = tuple(
        TensorSpec(key, _dtype_name(t), (samples_per_slice, *t.shape[1:])) for key, t in tensors.items()
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        digests, sizes = [], []
        for index in range(slice_count):
            data = _slice_bytes(tensors, index * samples_per_slice, samples_per_slice)
            write_synced(tmp / slice_file_name(index), data)
            digests.append(sha256_hex(data))
            sizes.append(len(data))
            if progress is not None:
                progress(index + 1, slice_count)
        manifest = Manifest(
            name=name,
            slice_count=slice_count,
            samples_per_slice=samples_per_slice,
            sample_count=sample_count,
            tensors=specs,
            sha256=tuple(digests),
            slice_bytes=tuple(sizes),
            metadata=dict(metadata or {}),
        )
        write_synced(tmp / MANIFEST_NAME, manifest.to_json().encode())
        os.chmod(tmp, 0o755)  # mkdtemp made it private; a data node may run as another user
        fsync_dir(tmp)
        _install(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Dataset.open(target)


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> int:
    if not tensors:
        raise InvalidArgumentError("empty source: no tensors to write")
    firsts = {}
    for key, tensor in tensors.items():
        if not key:
            raise InvalidArgumentError("tensor names must not be empty")
        if len(tensor.shape) == 0:  # torch tensors and numpy arrays alike
            raise InvalidArgumentError(f"tensor {key!r} is a scalar; every tensor needs a sample dimension")
        _dtype_name(tensor)
        firsts[key] = tensor.shape[0]
    if len(set(firsts.values())) != 1:
        shown = ", ".join(f"{k}: {n}" for k, n in firsts.items())
        raise InvalidArgumentError(f"inconsistent first dimensions (samples) across tensors: {shown}")
    count = next(iter(firsts.values()))
    if count == 0:
        raise InvalidArgumentError("empty source: the tensors hold no samples")
    return int(count)


def _dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgumentError(f"unsupported tensor dtype {name}")
    return name


def _slice_bytes(tensors: Mapping[str, torch.Tensor], start: int, length: int) -> bytes:
    if all(isinstance(t, np.ndarray) for t in tensors.values()):  # synthetic data without torch
        from safetensors.numpy import save as save_numpy

        return save_numpy(
            {key: np.ascontiguousarray(t[start : start + length]) for key, t in tensors.items()}
        )
    from safetensors.torch import save

    # clone(): a slice is a view into the whole source; safetensors wants
    # tensors that own exactly their bytes.
    return save(
        {key: t[start : start + length].detach().cpu().contiguous().clone() for key, t in tensors.items()}
    )


def _refuse_existing(target: Path, overwrite: bool) -> None:
    if target.exists() and not overwrite:
        raise AlreadyExistsError(
            f"dataset {target} already exists (--overwrite / overwrite=True replaces it)"
        )
    if target.exists() and not target.is_dir():
        raise InvalidArgumentError(f"{target} exists and is not a directory")


def _install(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished temp dir into place; with ``overwrite`` the old dataset is replaced
    whole (``replace_dir``), so the target is never a mixture of both."""
    if target.exists():
        _refuse_existing(target, overwrite)  # another prepare may have raced us
    replace_dir(tmp, target)


def _check_positive(what: str, value: int) -> None:
    if value < 1:
        raise InvalidArgumentError(f"{what} must be >= 1, got {value}")


# ---- text -------------------------------------------------------------------


def prepare_text(
    files: Sequence[str | Path],
    out_dir: str | Path,
    name: str,
    seq_len: int = DEFAULT_TEXT_SEQ_LEN,
    samples_per_slice: int = DEFAULT_SAMPLES_PER_SLICE,
    tokenizer: str | None = None,
    *,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> Dataset:
    """Tokenize text files and pack them into ``seq_len`` sequences.

    Each file is one document: its tokens, then EOS, appended to one stream
    that is cut into rows; only the last row is padded. ``tokenizer`` None or
    ``"byte"`` means byte-level ids (see ``synthetic``); anything else is a
    local tokenizer directory or a Hugging Face repo id for ``AutoTokenizer``
    (which honours ``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN``).
    A directory in ``files`` stands for its regular files, recursively, in
    name order.
    """
    validate_dataset_name(name)
    _check_positive("samples_per_slice", samples_per_slice)
    if seq_len < 2:
        raise InvalidArgumentError(f"seq_len must be >= 2, got {seq_len}")
    _refuse_existing(Path(out_dir) / name, overwrite)
    paths = _expand_files(files)
    if tokenizer is None or tokenizer == "byte":
        encode: Callable[[Path], list[int] | bytes] = _read_bytes
        eos: int | None = synthetic.BYTE_EOS_ID
        pad = synthetic.BYTE_PAD_ID
        vocab_size = synthetic.BYTE_VOCAB_SIZE
        tokenizer_name = "byte"
    else:
        tok = _load_tokenizer(tokenizer)
        encode = lambda path: _hf_encode(tok, path)  # noqa: E731
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
        vocab_size = len(tok)
        tokenizer_name = tokenizer

    pieces: list[np.ndarray] = []
    documents = 0
    for path in paths:
        ids = encode(path)
        if len(ids) == 0:
            continue
        documents += 1
        pieces.append(np.frombuffer(ids, dtype=np.uint8) if isinstance(ids, bytes) else np.asarray(ids))
        if eos is not None:
            pieces.append(np.array([eos]))
    if documents == 0:
        raise InvalidArgumentError(f"empty source: no text in {', '.join(str(p) for p in paths)}")
    stream = np.concatenate([p.astype(np.int64) for p in pieces])
    packed = synthetic.pack_sequences(stream, seq_len)
    packed["input_ids"][packed["attention_mask"] == 0] = pad
    metadata = {
        "source": "text",
        "tokenizer": tokenizer_name,
        "vocab_size": str(vocab_size),
        "seq_len": str(seq_len),
        "pad_id": str(pad),
        "documents": str(documents),
        "token_count": str(len(stream)),
    }
    if eos is not None:
        metadata["eos_id"] = str(eos)
    return write_dataset(
        _to_torch(packed), out_dir, name, samples_per_slice, metadata, overwrite=overwrite, progress=progress
    )


def _expand_files(files: Sequence[str | Path]) -> list[Path]:
    if not files:
        raise InvalidArgumentError("empty source: no input files given")
    paths: list[Path] = []
    for item in files:
        path = Path(item)
        if path.is_dir():
            paths.extend(sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")))
        elif path.is_file():
            paths.append(path)
        else:
            raise NotFoundError(f"input file {path} does not exist")
    if not paths:
        raise InvalidArgumentError(f"empty source: no files in {', '.join(str(f) for f in files)}")
    return paths


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read {path}: {exc}") from None


def _load_tokenizer(spec: str) -> Any:
    local = Path(spec).expanduser()
    if not local.exists() and spec.startswith((".", "/", "~")):
        raise NotFoundError(f"tokenizer directory {spec} does not exist")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(local) if local.exists() else spec)
    except Exception as exc:  # transformers raises OSError, ValueError and its own types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidArgumentError(f"unknown tokenizer {spec!r}: {first_line}") from None


def _hf_encode(tok: Any, path: Path) -> list[int]:
    try:
        text = _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"{path} is not UTF-8 text ({exc}); use the byte tokenizer") from None
    ids: list[int] = tok(text, add_special_tokens=False, return_attention_mask=False, verbose=False)[
        "input_ids"
    ]
    return ids


# ---- arrays -----------------------------------------------------------------


def prepare_arrays(
    file: str | Path,
    out_dir: str | Path,
    name: str,
    samples_per_slice: int = DEFAULT_SAMPLES_PER_SLICE,
    *,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> Dataset:
    """Slice the named arrays of an ``.npz`` or ``.safetensors`` file, which
    must share their first dimension; names and dtypes are kept."""
    validate_dataset_name(name)
    _check_positive("samples_per_slice", samples_per_slice)
    _refuse_existing(Path(out_dir) / name, overwrite)
    path = Path(file)
    if not path.is_file():
        raise NotFoundError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        tensors = _load_npz(path)
    elif suffix == ".safetensors":
        tensors = _load_safetensors(path)
    else:
        raise InvalidArgumentError(f"unsupported array file {path}: use .npz or .safetensors")
    if not tensors:
        raise InvalidArgumentError(f"empty source: {path} contains no arrays")
    metadata = {"source": "arrays", "file": path.name}
    return write_dataset(
        tensors, out_dir, name, samples_per_slice, metadata, overwrite=overwrite, progress=progress
    )


def _load_npz(path: Path) -> dict[str, torch.Tensor]:
    import torch

    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except Exception as exc:  # zipfile, pickle refusal and format errors
        raise InvalidArgumentError(f"cannot read {path} as .npz: {exc}") from None
    out = {}
    for key, array in arrays.items():
        try:
            out[key] = torch.from_numpy(np.require(array, requirements="C"))
        except TypeError as exc:
            raise InvalidArgumentError(
                f"{path}: array {key!r} has unsupported dtype {array.dtype}: {exc}"
            ) from None
    return out


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # the library's own error types
        raise InvalidArgumentError(f"cannot read {path} as safetensors: {exc}") from None


# ---- synthetic --------------------------------------------------------------


def prepare_synthetic(
    kind: str,
    out_dir: str | Path,
    name: str,
    samples: int = DEFAULT_SYNTHETIC_SAMPLES,
    samples_per_slice: int = DEFAULT_SAMPLES_PER_SLICE,
    seed: int = 0,
    *,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    **options: int,
) -> Dataset:
    """A built-in generator's output as a dataset; ``options`` go to the kind
    (``seq_len``/``max_operand`` for arithmetic, ``image_size``/``channels``
    for shapes)."""
    validate_dataset_name(name)
    _check_positive("samples_per_slice", samples_per_slice)
    _refuse_existing(Path(out_dir) / name, overwrite)
    data = synthetic.generate(kind, samples, seed, **options)
    return write_dataset(
        data.tensors, out_dir, name, samples_per_slice, data.metadata, overwrite=overwrite, progress=progress
    )


def _to_torch(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    import torch

    return {key: torch.from_numpy(np.require(a, requirements="C")) for key, a in arrays.items()}
