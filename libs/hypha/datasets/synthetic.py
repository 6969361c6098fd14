"""Built-in synthetic datasets for demos, tests and benchmarks.

Two kinds, both deterministic for a given seed:

``arithmetic``
    One sum per fixed-length byte-level row (``input_ids``/``attention_mask``/
    ``labels``), written ``012+035=74\\n``: operands zero-padded, the answer's
    digits reversed (least significant first), labels on the answer only. Fresh
    random pairs fill every row, so a model cannot memorise its way through;
    about one pair in ten is never trained on, and exact-match accuracy on
    those held-out sums shows whether the model learnt to add.
``shapes``
    Small greyscale (or RGB) images of a square, circle, triangle or cross
    with a class label (``pixel_values``/``labels``), for vision
    classification jobs.

Byte-level vocabulary, shared with ``prepare_text(tokenizer="byte")``: ids
0-255 are the bytes themselves, 256 is end-of-sequence (appended after each
text document), 257 is padding, so the vocabulary has 258 entries. Padding
positions have ``attention_mask`` 0 and ``labels`` -100 (ignored by the usual
cross-entropy); in packed text everywhere else ``labels`` equals ``input_ids``
(arithmetic keeps them on the answer only), and the trainer shifts them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
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
DEFAULT_MAX_OPERAND = 999
#: The arithmetic rows' layout, kept in the manifest so a reader can tell an older dataset apart.
ARITHMETIC_FORMAT = "zero-padded operands, reversed answer, labels on the answer only"

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
    return bool(heldout_mask(np.array([a]), np.array([b]))[0])


def heldout_mask(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``is_heldout`` for arrays of operands at once: MurmurHash3's 64-bit finaliser of the
    pair, modulo ``HELDOUT_MODULUS`` (a well-mixed hash, so the held-out pairs follow no
    pattern a model could exploit, and vectorised: a million pairs in milliseconds)."""
    with np.errstate(over="ignore"):
        h = (a.astype(np.uint64) << np.uint64(32)) | b.astype(np.uint64)
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xC4CEB9FE1A85EC53)
        h ^= h >> np.uint64(33)
    return np.asarray(h % np.uint64(HELDOUT_MODULUS) == 0)


def arithmetic_prompt(a: int, b: int, max_operand: int = DEFAULT_MAX_OPERAND) -> str:
    """``"007+045="``: operands zero-padded to the width of ``max_operand``.

    NOTE: fixed-width operands put digit k of each operand at the same
    position in every problem, so the model can find the digits it adds by
    position alone; unpadded operands shift with their length.
    """
    width = len(str(max_operand))
    return f"{a:0{width}d}+{b:0{width}d}="


def arithmetic_answer(total: int) -> str:
    """The sum as the model writes it: digits reversed, least significant first (52 -> ``"25"``).

    NOTE: written this way each answer digit depends only on the digits
    already read and the carry from the digit just written, which a small
    causal LM learns; most-significant-first needs the carry of digits it
    has not written yet, and the same model stays far below 50 % held out.
    """
    return str(total)[::-1]


def read_answer(text: str) -> int | None:
    """The number a reversed answer stands for (``"25"`` -> 52); None if it is not one."""
    text = text.strip()
    return int(text[::-1]) if text.isdigit() else None


def arithmetic_line_length(max_operand: int) -> int:
    """Bytes of the longest problem: prompt, answer and the closing newline."""
    return len(arithmetic_prompt(max_operand, max_operand, max_operand) + str(2 * max_operand)) + 1


def arithmetic(
    samples: int,
    seed: int = 0,
    seq_len: int | None = None,
    max_operand: int = DEFAULT_MAX_OPERAND,
) -> SyntheticData:
    """``samples`` rows of one problem each, ``007+045=25\\n``, with 0 <= a, b <= max_operand
    drawn at random (held-out pairs excluded) and the answer reversed; rows
    are ``seq_len`` long (None: the longest problem's length).

    ``labels`` cover only the answer and its newline (-100 on the prompt and
    the padding): the operands are random, so a loss over them measures
    nothing the model could learn, and the answer is what exact match checks.
    """
    _check_samples(samples)
    seq_len = _arithmetic_seq_len(seq_len, max_operand)
    tensors = arithmetic_rows(
        _training_pairs(np.random.default_rng(seed), samples, max_operand), seq_len, max_operand
    )
    metadata = {
        "source": "synthetic",
        "kind": "arithmetic",
        "format": ARITHMETIC_FORMAT,
        "tokenizer": "byte",
        "vocab_size": str(BYTE_VOCAB_SIZE),
        "eos_id": str(BYTE_EOS_ID),
        "pad_id": str(BYTE_PAD_ID),
        "seq_len": str(seq_len),
        "max_operand": str(max_operand),
        "heldout_modulus": str(HELDOUT_MODULUS),
        "seed": str(seed),
    }
    return SyntheticData(_to_torch(tensors), metadata)


def _arithmetic_seq_len(seq_len: int | None, max_operand: int) -> int:
    if max_operand < 1:
        raise InvalidArgumentError(f"max_operand must be >= 1, got {max_operand}")
    longest = arithmetic_line_length(max_operand)
    if seq_len is None:
        return longest
    if seq_len < longest:
        raise InvalidArgumentError(f"seq_len {seq_len} cannot hold one problem ({longest} bytes)")
    return seq_len


def arithmetic_rows(
    pairs: np.ndarray | Sequence[tuple[int, int]], seq_len: int, max_operand: int = DEFAULT_MAX_OPERAND
) -> dict[str, np.ndarray]:
    """One row per operand pair ((n, 2) array or pairs), built with array operations:
    ``input_ids``/``attention_mask``, and ``labels`` on the answer only."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    n, width = len(pairs), len(str(max_operand))
    a, b = pairs[:, 0], pairs[:, 1]
    total = a + b
    input_ids = np.full((n, seq_len), BYTE_PAD_ID, dtype=np.int64)
    for k in range(width):  # zero-padded operands, most significant digit first
        scale = 10 ** (width - 1 - k)
        input_ids[:, k] = a // scale % 10 + ord("0")
        input_ids[:, width + 1 + k] = b // scale % 10 + ord("0")
    input_ids[:, width] = ord("+")
    start = 2 * width + 2
    input_ids[:, start - 1] = ord("=")
    digits = np.ones(n, dtype=np.int64)  # digits of the sum (0 has one)
    for k in range(1, len(str(2 * max_operand))):
        digits += total >= 10**k
    for k in range(len(str(2 * max_operand))):  # reversed: least significant digit first
        input_ids[:, start + k] = np.where(
            k < digits, total // 10**k % 10 + ord("0"), input_ids[:, start + k]
        )
    rows = np.arange(n)
    input_ids[rows, start + digits] = ord("\n")
    column = np.arange(seq_len)[None, :]
    end = (start + digits + 1)[:, None]
    mask = (column < end).astype(np.int64)
    labels = np.where((column >= start) & (column < end), input_ids, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _training_pairs(rng: np.random.Generator, n: int, max_operand: int) -> np.ndarray:
    """``n`` random operand pairs, none held out: drawn in blocks, held-out ones dropped."""
    kept: list[np.ndarray] = []
    have = 0
    while have < n:
        block = rng.integers(0, max_operand + 1, size=(max(1024, (n - have) * 5 // 4), 2))
        block = block[~heldout_mask(block[:, 0], block[:, 1])]
        kept.append(block)
        have += len(block)
    return np.concatenate(kept)[:n]


def heldout_pairs(n: int, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND) -> list[tuple[int, int]]:
    """``n`` distinct operand pairs that training never sees, in a seeded random order."""
    grid = np.stack(np.meshgrid(np.arange(max_operand + 1), np.arange(max_operand + 1), indexing="ij"), -1)
    pool = grid.reshape(-1, 2)
    pool = pool[heldout_mask(pool[:, 0], pool[:, 1])]
    if not 0 <= n <= len(pool):
        raise InvalidArgumentError(f"n must be in 0..{len(pool)} for max_operand {max_operand}, got {n}")
    order = np.random.default_rng(seed).permutation(len(pool))[:n]
    return [(int(a), int(b)) for a, b in pool[order].tolist()]


def heldout_sums(n: int, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND) -> list[tuple[str, str]]:
    """``n`` distinct held-out problems as (prompt ``"012+035="``, answer as written ``"74"``)."""
    return [
        (arithmetic_prompt(a, b, max_operand), arithmetic_answer(a + b))
        for a, b in heldout_pairs(n, seed, max_operand)
    ]


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
    try:
        import torch
    except ImportError:  # a torch-free install (the slim data node image) writes numpy arrays
        return arrays  # type: ignore[return-value]

    return {name: torch.from_numpy(np.require(array, requirements="C")) for name, array in arrays.items()}
