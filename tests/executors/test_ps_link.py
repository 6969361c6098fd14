"""The final round's update when the parameter server is lost and restored in that round.

Found by the container chaos run: a server killed after both trainers had sent
their last Δ was restored 6 s later, but each trainer had tried the final update
only ``FINAL_UPDATE_TRIES`` times and ended, so the restored server waited for
their Δ until the round's deadline (60 s) and the round's work was lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hypha.errors import UnavailableError
from hypha.worker.executors.diloco_trainer import TrainerOptions
from hypha.worker.executors.ps_link import FINAL_UPDATE_TRIES, ParameterServerLink, SentDelta

pytestmark = pytest.mark.timeout(30)


class _RestoringServer:
    """A bridge to a server that is unreachable for ``down`` fetches, then serves the update
    only once it has this trainer's Δ again (as a restored server does)."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.fetches = 0
        self.deltas_after_restore = 0

    async def send_tensors(
        self, peer: str, kind: str, round: int, samples: int, path: Path
    ) -> tuple[bool, str]:
        if self.fetches > self.down:
            self.deltas_after_restore += 1
        return True, ""

    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None:
        self.fetches += 1
        if self.fetches <= self.down:
            raise UnavailableError("parameter server's worker unreachable")
        return b"update" if self.deltas_after_restore else None


def _link(server: _RestoringServer, goes_on: list[bool]) -> ParameterServerLink:
    async def job_goes_on() -> bool:
        return goes_on.pop(0) if goes_on else True

    options = TrainerOptions(fetch_timeout_s=0.01, update_patience_s=20, idle_min_s=0.001, idle_max_s=0.01)
    return ParameterServerLink(server, "ps", options, job_goes_on=job_goes_on)  # type: ignore[arg-type]


async def test_a_final_round_update_is_waited_for_while_the_job_goes_on_and_the_delta_sent_again(
    tmp_path: Path,
) -> None:
    server = _RestoringServer(down=2 * FINAL_UPDATE_TRIES + 1)  # lost, then restored
    delta = tmp_path / "delta.safetensors"
    delta.write_bytes(b"delta")

    update = await _link(server, goes_on=[]).fetch_update(9, resend=[SentDelta(delta, 9, 64)], final=True)

    assert update == b"update"
    assert server.deltas_after_restore >= 1  # the restored server got this trainer's Δ


async def test_a_final_round_update_not_served_once_the_job_is_over_is_given_up_at_once(
    tmp_path: Path,
) -> None:
    server = _RestoringServer(down=1000)  # the server ended with the job
    delta = tmp_path / "delta.safetensors"
    delta.write_bytes(b"delta")

    update = await _link(server, goes_on=[False]).fetch_update(
        9, resend=[SentDelta(delta, 9, 64)], final=True
    )

    assert update is None
    assert server.fetches == FINAL_UPDATE_TRIES
