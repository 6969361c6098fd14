"""Executor tests train real (tiny) models: one torch thread each, as the worker gives them."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
