"""In-process gateway meshes for gateway tests: ``hypha.testing.mesh`` as a fixture."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from hypha.testing.mesh import Mesh, gateway_settings
from hypha.testing.pki import Pki
from hypha.testing.polling import until

__all__ = ["Mesh", "gateway_settings", "mesh", "until"]


@pytest.fixture
async def mesh(pki: Pki) -> AsyncIterator[Mesh]:
    m = Mesh(pki)
    yield m
    await m.close()
