"""The market over real gateways, workers and a scheduler, for every test here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conftest import Pki
from tests.gateway.conftest import Mesh
from tests.market_net.test_market_net import Market


@pytest.fixture
async def market(pki: Pki) -> AsyncIterator[Market]:
    """Two federated gateways; nodes join through ``Market``, which stops them all at the end."""
    mesh = Mesh(pki)
    world = Market(mesh)
    try:
        await mesh.full_mesh(2)
        yield world
    finally:
        await world.close()
        await mesh.close()
