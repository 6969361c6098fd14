"""Run the DiLoCo trainer with its bridge calls, train steps and checkpoints timed
(``trainer_overhead.py --timings``): where the trainer's wall time goes besides training.

    python benchmarks/_bridge_timings.py OUT_FILE   (as the job process, in place of
                                                     ``-m hypha.worker.executors.diloco_trainer``)

pyinstrument attributes the trainer's waits to ``epoll`` (its profiler starts outside the
event loop), so this wraps ``BridgeClient._request`` per path, ``train_step`` and the
checkpoint (``checkpoint_writer``: ``snapshot_trainer_state`` on the loop, ``write_trainer_state``
in its thread, off the training path), and appends a table to OUT_FILE when the process exits.
"""

from __future__ import annotations

import atexit
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypha.bridge_client import client
from hypha.worker.executors import checkpoint_writer, diloco_trainer

TOTAL: collections.defaultdict[str, float] = collections.defaultdict(float)
COUNT: collections.Counter[str] = collections.Counter()


def _timed_call(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TOTAL[name] += time.perf_counter() - started
            COUNT[name] += 1

    return call


def _install() -> None:
    request = client.BridgeClient._request

    async def timed_request(
        self: client.BridgeClient, method: str, path: str, *args: Any, **kwargs: Any
    ) -> Any:
        started = time.perf_counter()
        try:
            return await request(self, method, path, *args, **kwargs)
        finally:
            TOTAL[path] += time.perf_counter() - started
            COUNT[path] += 1

    client.BridgeClient._request = timed_request  # type: ignore[method-assign]
    diloco_trainer.train_step = _timed_call("train_step", diloco_trainer.train_step)
    for name in ("snapshot_trainer_state", "write_trainer_state"):  # where the trainer's writer calls them
        setattr(checkpoint_writer, name, _timed_call(name, getattr(checkpoint_writer, name)))


def _dump(out: Path) -> None:
    with out.open("a") as f:
        for name in sorted(TOTAL, key=TOTAL.__getitem__, reverse=True):
            mean = TOTAL[name] / COUNT[name] * 1e3
            f.write(f"{name:24} n={COUNT[name]:4}  total {TOTAL[name] * 1e3:8.1f} ms  mean {mean:7.2f} ms\n")
        f.write("--\n")


if __name__ == "__main__":
    _install()
    atexit.register(_dump, Path(sys.argv.pop(1)))
    diloco_trainer.main()
