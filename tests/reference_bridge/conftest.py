"""Fixtures of the reference bridge tests: a tiny GPT-2 and arithmetic slices of 12 samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from hypha import models
from hypha.datasets import synthetic
from hypha.models import ModelKind
from hypha.testing.executors import write_slices


@pytest.fixture(scope="package")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save_tiny_model(ModelKind.CAUSAL_LM, tmp_path_factory.mktemp("model") / "gpt2")


@pytest.fixture(scope="package")
def slice_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_slices(synthetic.arithmetic(96, seed=0), tmp_path_factory.mktemp("data"), "arith", 12)
