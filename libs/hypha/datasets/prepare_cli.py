"""``hypha-data prepare``: the command line over ``prepare`` (flags, checks, progress, summary).

Split from ``prepare`` so that the library a test or the demo calls carries no
argparse; a usage error or a refused source exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hypha.datasets import synthetic
from hypha.datasets.format import Dataset
from hypha.datasets.prepare import (
    DEFAULT_SAMPLES_PER_SLICE,
    DEFAULT_SYNTHETIC_SAMPLES,
    DEFAULT_TEXT_SEQ_LEN,
    prepare_arrays,
    prepare_synthetic,
    prepare_text,
)
from hypha.errors import HyphaError, InvalidArgumentError


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's NoReturn, typed loosely on purpose
        raise _UsageError(message)


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``prepare`` flags, for a CLI that mounts them as a subcommand."""
    parser.add_argument("--data-dir", required=True, type=Path, help="data dir that holds datasets")
    parser.add_argument("--name", required=True, help="dataset name (becomes DATA_DIR/NAME)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", metavar="FILE", help="text files or directories")
    source.add_argument("--arrays", metavar="FILE", help=".npz or .safetensors file")
    source.add_argument("--synthetic", choices=sorted(synthetic.KINDS), help="built-in generator")
    parser.add_argument("--tokenizer", help="'byte' (default) or a local dir / Hugging Face repo id (--text)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (--text, --synthetic arithmetic)")
    parser.add_argument(
        "--samples", type=int, help=f"samples to generate (default {DEFAULT_SYNTHETIC_SAMPLES})"
    )
    parser.add_argument("--seed", type=int, help="generator seed (default 0)")
    parser.add_argument("--max-operand", type=int, help="largest operand (--synthetic arithmetic)")
    parser.add_argument("--image-size", type=int, help="image side in pixels (--synthetic shapes)")
    parser.add_argument("--channels", type=int, choices=(1, 3), help="image channels (--synthetic shapes)")
    parser.add_argument(
        "--samples-per-slice",
        type=int,
        default=DEFAULT_SAMPLES_PER_SLICE,
        help=f"samples in each slice file (default {DEFAULT_SAMPLES_PER_SLICE})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset of that name")


def run_prepare(args: argparse.Namespace) -> int:
    """Run a parsed ``prepare`` command; HyphaErrors propagate to the caller."""
    _reject_misplaced(args)
    progress = _StderrProgress(args.name)
    common: dict[str, Any] = {"overwrite": args.overwrite, "progress": progress}
    if args.text is not None:
        seq_len = args.seq_len if args.seq_len is not None else DEFAULT_TEXT_SEQ_LEN
        dataset = prepare_text(
            args.text, args.data_dir, args.name, seq_len, args.samples_per_slice, args.tokenizer, **common
        )
    elif args.arrays is not None:
        dataset = prepare_arrays(args.arrays, args.data_dir, args.name, args.samples_per_slice, **common)
    else:
        options = {
            key: value
            for key, value in (
                ("seq_len", args.seq_len),
                ("max_operand", args.max_operand),
                ("image_size", args.image_size),
                ("channels", args.channels),
            )
            if value is not None
        }
        samples = args.samples if args.samples is not None else DEFAULT_SYNTHETIC_SAMPLES
        seed = args.seed if args.seed is not None else 0
        dataset = prepare_synthetic(
            args.synthetic,
            args.data_dir,
            args.name,
            samples,
            args.samples_per_slice,
            seed,
            **common,
            **options,
        )
    print(summary_line(dataset))
    return 0


def _reject_misplaced(args: argparse.Namespace) -> None:
    rules: Iterable[tuple[str, str, bool]] = (
        ("--tokenizer", "--text", args.text is not None),
        (
            "--seq-len",
            "--text or --synthetic arithmetic",
            args.text is not None or args.synthetic is not None,
        ),
        ("--samples", "--synthetic", args.synthetic is not None),
        ("--seed", "--synthetic", args.synthetic is not None),
        ("--max-operand", "--synthetic", args.synthetic is not None),
        ("--image-size", "--synthetic", args.synthetic is not None),
        ("--channels", "--synthetic", args.synthetic is not None),
    )
    for flag, needs, ok in rules:
        if getattr(args, flag[2:].replace("-", "_")) is not None and not ok:
            raise InvalidArgumentError(f"{flag} only applies with {needs}")


def summary_line(dataset: Dataset) -> str:
    m = dataset.manifest
    tensors = ", ".join(f"{t.name} {t.dtype}[{'x'.join(str(d) for d in t.shape)}]" for t in m.tensors)
    return (
        f"prepared dataset {m.name}: {m.sample_count} samples in {m.slice_count} slices "
        f"of {m.samples_per_slice} ({tensors}) at {dataset.root}"
    )


class _StderrProgress:
    """Prints a line at every tenth of the way, so logs stay short."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._last_decile = -1

    def __call__(self, done: int, total: int) -> None:
        decile = done * 10 // max(total, 1)
        if decile != self._last_decile or done == total:
            self._last_decile = decile
            print(f"hypha-data: {self._name}: {done}/{total} slices written", file=sys.stderr, flush=True)


def main_prepare(argv: Sequence[str] | None = None) -> int:
    """``hypha-data prepare ...`` (``argv`` excludes ``prepare`` itself)."""
    parser = _Parser(
        prog="hypha-data prepare", description="Turn raw data into a servable dataset directory."
    )
    add_prepare_arguments(parser)
    try:
        args = parser.parse_args(argv)
        return run_prepare(args)
    except _UsageError as exc:
        print(f"hypha-data: error: {exc}", file=sys.stderr)
        return 2
    except HyphaError as exc:
        print(f"hypha-data: error: {exc.message}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        with contextlib.suppress(TypeError, ValueError):
            return int(exc.code or 0)
        return 2
