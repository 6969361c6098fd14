"""A DiLoCo execution taken back by its restarted scheduler keeps the routes to its former servers.

Before the restart the scheduler restored the job's parameter server on
another worker, so this trainer's tensor calls naming the first server are
routed to the new one (``JobDispatch.route``). The restarted scheduler
dispatches the trainer again knowing only the current server; reattaching
under that dispatch must not forget the former one, or the executor's next
call naming it goes to a dead peer.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hypha.worker.execution import Execution
from tests.worker.test_bridge import diloco_dispatch


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, stream: str, text: str) -> None:
        self.lines.append(text)


@pytest.mark.timeout(30)
def test_reattach_keeps_the_routes_to_former_parameter_servers(tmp_path: Path) -> None:
    restored = replace(diloco_dispatch(), parameter_server_id="ps-new", former_parameter_servers=("ps-old",))
    logs = _Lines()
    execution = Execution(
        dispatch=restored,
        record=None,  # type: ignore[arg-type]
        work_dir=tmp_path,
        plan=None,  # type: ignore[arg-type]
        gpus=[],
        threads=1,
        link=None,  # type: ignore[arg-type]
        logs=logs,  # type: ignore[arg-type]
        orphaned="lease-1",
    )
    again = replace(restored, lease_id="lease-2", attempt=restored.attempt + 1, former_parameter_servers=())

    execution.reattach(again)

    assert execution.dispatch.lease_id == "lease-2"
    assert execution.dispatch.route("ps-old") == "ps-new"
    assert execution.orphaned == ""
    assert any("taken back" in line for line in logs.lines)
