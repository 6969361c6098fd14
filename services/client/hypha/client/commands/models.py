"""``hypha tiny-model``: write the demo's tiny model into a directory, for a first job by hand.

The by-hand walkthrough needs an initial model under the workers'
``local_model_roots`` before it can submit anything; this writes the very model
``hypha demo`` trains (``hypha.models.save_arithmetic_model``: a seeded 0.6M-parameter
GPT-2 over the byte vocabulary of the built-in datasets), or the tiny ViT for the
synthetic shapes. No scheduler, no certificate: it only writes files.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hypha.cli.paths import absolute_path
from hypha.client.output import json_out, print_json
from hypha.client.registry import EXIT_OK, Command, UsageError

#: ``--type`` values: the job file's ``[job.model] type`` each model is trained as.
TYPES = ("causal-lm", "vision-classification")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir", type=absolute_path, help="directory to write config.json and model.safetensors into"
    )
    p.add_argument("--type", choices=TYPES, default="causal-lm", help="model type (default causal-lm)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    p.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")


def _tiny_model(args: argparse.Namespace) -> int:
    out: Path = args.dir
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        # Never replace someone's model by accident: its weights would be gone.
        raise UsageError(f"{out}: not empty (give --force to write into it)")
    # NOTE: torch and transformers load only when this command runs, never to build the parser.
    from transformers.utils import logging as hf_logging

    from hypha.models import ModelKind, save_arithmetic_model, save_tiny_model

    hf_logging.disable_progress_bar()  # one line of output, not a progress bar for one small file
    if args.type == "causal-lm":
        save_arithmetic_model(out, seed=args.seed)
    else:
        save_tiny_model(ModelKind.VISION_CLASSIFICATION, out, seed=args.seed)
    parameters = _parameters(out / "model.safetensors")
    if json_out(args):
        print_json({"path": str(out), "type": args.type, "seed": args.seed, "parameters": parameters})
    else:
        print(f"wrote a {parameters / 1e6:.2f}M-parameter {args.type} model to {out}")
    return EXIT_OK


def _parameters(weights: Path) -> int:
    """How many values the saved weights hold (read from the safetensors header, not loaded)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


TINY_MODEL = Command(
    "write the demo's tiny model into DIR (no scheduler needed)", _add_arguments, _tiny_model
)
