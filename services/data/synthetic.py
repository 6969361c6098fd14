"""Built-in synthetic datasets for demos, tests and benchmarks.

Two kinds, both deterministic for a given seed:

``arithmetic``
    Lines such as ``12+35=47\\n`` packed, whole lines only, into fixed-length
    byte-level sequences (``input_ids``/``attention_mask``/``labels``). A small
    causal LM learns it in minutes on a CPU, and exact-match accuracy on
    held-out sums shows whether training did anything.
``shapes``
    Small greyscale (or RGB) images of a square, circle, triangle or cross
    with a class label (``pixel_values``/``labels``), for vision
    classification jobs.

Byte-level vocabulary, shared with ``prepare_text(tokenizer="byte")``: ids
0-255 are the bytes themselves, 256 is end-of-sequence (appended after each
text document), 257 is padding, so the vocabulary has 258 entries. Padding
positions have ``attention_mask`` 0 and ``labels`` -100 (ignored by the usual
cross-entropy); everywhere else ``labels`` equals ``input_ids`` and the trainer
shifts them.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hypha.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

BYTE_EOS_ID = 256
BYTE_PAD_ID = 257
BYTE_VOCAB_SIZE = 258
#: Short names for the byte-level vocabulary (the arithmetic corpus uses it).
EOS_ID, PAD_ID, VOCAB_SIZE = BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE
#: Label value that losses ignore (PyTorch's and Hugging Face's default).
IGNORE_INDEX = -100

#: About one in HELDOUT_MODULUS operand pairs is held out of training.
HELDOUT_MODULUS = 10
DEFAULT_MAX_OPERAND = 99
DEFAULT_ARITHMETIC_SEQ_LEN = 64

SHAPE_NAMES = ("square", "circle", "triangle", "cross")
DEFAULT_IMAGE_SIZE = 16


@dataclass(frozen=True)
class SyntheticData:
    """Tensors sharing their first (sample) dimension, plus manifest metadata."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def encode_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(ids: Sequence[int]) -> str:
    """Text for byte-level ids; special ids (EOS, PAD) are dropped."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def pack_sequences(tokens: Sequence[int] | np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Cut a token stream into rows of ``seq_len``; the last row is padded."""
    if seq_len < 2:
        raise InvalidArgumentError(f"seq_len must be >= 2, got {seq_len}")
    flat = np.asarray(tokens, dtype=np.int64)
    rows = -(-len(flat) // seq_len)
    input_ids = np.full(rows * seq_len, BYTE_PAD_ID, dtype=np.int64)
    input_ids[: len(flat)] = flat
    mask = np.zeros(rows * seq_len, dtype=np.int64)
    mask[: len(flat)] = 1
    return _with_labels(input_ids.reshape(rows, seq_len), mask.reshape(rows, seq_len))


def _with_labels(input_ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    labels = np.where(mask == 1, input_ids, IGNORE_INDEX).astype(np.int64)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


# ---- arithmetic -----------------------------------------------------------


def is_heldout(a: int, b: int) -> bool:
    """Whether ``a+b`` is kept out of training. A hash of the pair, not the
    seed, decides, so training sets of any seed avoid every held-out pair."""
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_MODULUS == 0


def arithmetic(
    samples: int,
    seed: int = 0,
    seq_len: int = DEFAULT_ARITHMETIC_SEQ_LEN,
    max_operand: int = DEFAULT_MAX_OPERAND,
) -> SyntheticData:
    """``samples`` sequences of whole ``a+b=c\\n`` lines with 0 <= a, b <= max_operand."""
    _check_samples(samples)
    if max_operand < 1:
        raise InvalidArgumentError(f"max_operand must be >= 1, got {max_operand}")
    longest = len(f"{max_operand}+{max_operand}={2 * max_operand}\n")
    if seq_len < longest:
        raise InvalidArgumentError(f"seq_len {seq_len} cannot hold one problem ({longest} bytes)")
    rng = np.random.default_rng(seed)
    input_ids = np.full((samples, seq_len), BYTE_PAD_ID, dtype=np.int64)
    mask = np.zeros((samples, seq_len), dtype=np.int64)
    pairs = _training_pairs(rng, max_operand)
    pending: bytes | None = None
    for row in range(samples):
        used = 0
        while True:
            line = pending if pending is not None else next(pairs)
            pending = None
            if used + len(line) > seq_len:
                pending = line
                break
            input_ids[row, used : used + len(line)] = np.frombuffer(line, dtype=np.uint8)
            used += len(line)
        mask[row, :used] = 1
    metadata = {
        "source": "synthetic",
        "kind": "arithmetic",
        "tokenizer": "byte",
        "vocab_size": str(BYTE_VOCAB_SIZE),
        "eos_id": str(BYTE_EOS_ID),
        "pad_id": str(BYTE_PAD_ID),
        "seq_len": str(seq_len),
        "max_operand": str(max_operand),
        "heldout_modulus": str(HELDOUT_MODULUS),
        "seed": str(seed),
    }
    return SyntheticData(_to_torch(_with_labels(input_ids, mask)), metadata)


def _training_pairs(rng: np.random.Generator, max_operand: int) -> Iterator[bytes]:
    """Endless ``a+b=c\\n`` lines, drawn in blocks (one numpy call per pair is slow)."""
    while True:
        block = rng.integers(0, max_operand + 1, size=(4096, 2))
        for a, b in block.tolist():
            if not is_heldout(a, b):
                yield f"{a}+{b}={a + b}\n".encode()


def heldout_sums(n: int, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND) -> list[tuple[str, str]]:
    """``n`` distinct held-out problems as (prompt ``"12+35="``, answer ``"47"``)."""
    pool = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if is_heldout(a, b)]
    if not 0 <= n <= len(pool):
        raise InvalidArgumentError(f"n must be in 0..{len(pool)} for max_operand {max_operand}, got {n}")
    order = np.random.default_rng(seed).permutation(len(pool))[:n]
    return [(f"{pool[i][0]}+{pool[i][1]}=", str(pool[i][0] + pool[i][1])) for i in order.tolist()]


def exact_match_accuracy(generate_fn: Callable[[str], str], pairs: Sequence[tuple[str, str]]) -> float:
    """Fraction of prompts whose completion's first line is exactly the answer
    (surrounding whitespace ignored). ``generate_fn`` gets the prompt and
    returns only the generated continuation."""
    if not pairs:
        raise InvalidArgumentError("exact_match_accuracy needs at least one pair")
    hits = 0
    for prompt, answer in pairs:
        completion = generate_fn(prompt)
        if completion.split("\n", 1)[0].strip() == answer:
            hits += 1
    return hits / len(pairs)


# ---- shapes ---------------------------------------------------------------


def shapes(
    samples: int, seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE, channels: int = 1
) -> SyntheticData:
    """Images of one shape each, float32 in [0, 1], shape (channels, size, size).
    Labels cycle through the classes before shuffling, so counts differ by at
    most one."""
    _check_samples(samples)
    if image_size < 8:
        raise InvalidArgumentError(f"image_size must be >= 8, got {image_size}")
    if channels not in (1, 3):
        raise InvalidArgumentError(f"channels must be 1 or 3, got {channels}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(samples) % len(SHAPE_NAMES)).astype(np.int64)
    yy, xx = np.mgrid[0:image_size, 0:image_size].astype(np.float32) + 0.5
    pixels = np.empty((samples, channels, image_size, image_size), dtype=np.float32)
    for i, label in enumerate(labels.tolist()):
        radius = rng.uniform(0.22, 0.38) * image_size
        cx, cy = rng.uniform(radius, image_size - radius, size=2)
        mask = _shape_mask(SHAPE_NAMES[label], xx - cx, yy - cy, radius)
        color = rng.uniform(0.6, 1.0, size=(channels, 1, 1)).astype(np.float32)
        noise = rng.normal(0.0, 0.05, size=(channels, image_size, image_size)).astype(np.float32)
        pixels[i] = np.clip(mask[None] * color + noise, 0.0, 1.0)
    metadata = {
        "source": "synthetic",
        "kind": "shapes",
        "num_labels": str(len(SHAPE_NAMES)),
        "label_names": ",".join(SHAPE_NAMES),
        "image_size": str(image_size),
        "channels": str(channels),
        "seed": str(seed),
    }
    return SyntheticData(_to_torch({"pixel_values": pixels, "labels": labels}), metadata)


def _shape_mask(kind: str, dx: np.ndarray, dy: np.ndarray, r: float) -> np.ndarray:
    if kind == "square":
        inside = (np.abs(dx) <= 0.8 * r) & (np.abs(dy) <= 0.8 * r)
    elif kind == "circle":
        inside = dx * dx + dy * dy <= r * r
    elif kind == "triangle":
        # Apex at the top; the half-width grows linearly to r at the base.
        depth = dy + r
        inside = (depth >= 0) & (dy <= r) & (np.abs(dx) <= depth / 2)
    else:  # cross
        bar = r / 3
        inside = ((np.abs(dx) <= bar) & (np.abs(dy) <= r)) | ((np.abs(dy) <= bar) & (np.abs(dx) <= r))
    return inside.astype(np.float32)


# ---- registry -------------------------------------------------------------

KINDS: dict[str, Callable[..., SyntheticData]] = {"arithmetic": arithmetic, "shapes": shapes}


def generate(kind: str, samples: int, seed: int = 0, **options: int) -> SyntheticData:
    """Dispatch by kind name, rejecting options the kind does not take."""
    fn = KINDS.get(kind)
    if fn is None:
        raise InvalidArgumentError(f"unknown synthetic kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    accepted = set(inspect.signature(fn).parameters) - {"samples", "seed"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise InvalidArgumentError(
            f"synthetic kind {kind!r} does not take {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(accepted))}"
        )
    return fn(samples, seed, **options)


def _check_samples(samples: int) -> None:
    if samples < 1:
        raise InvalidArgumentError(f"samples must be >= 1, got {samples}")


def _to_torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    import torch

    return {name: torch.from_numpy(np.require(array, requirements="C")) for name, array in arrays.items()}
