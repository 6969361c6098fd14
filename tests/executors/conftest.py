"""Executor tests train real (tiny) models: one torch thread each, as the worker gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hypha import models
from hypha.datasets import synthetic
from hypha.models import ModelKind
from hypha.testing.executors import write_slices


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save_tiny_model(ModelKind.CAUSAL_LM, tmp_path_factory.mktemp("model") / "gpt2")


@pytest.fixture(scope="module")
def slices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Per-trainer arithmetic data; 12 samples per slice so that batches of 8 span slices."""
    root = tmp_path_factory.mktemp("data")
    return {
        peer: write_slices(synthetic.arithmetic(96, seed=seed), root, f"arith-{peer}", 12)
        for seed, peer in enumerate(("t0", "t1", "t2"))
    }
