"""Executor tests' stand-ins for the job bridge: the shared harness in ``hypha.testing.executors``
and ``hypha.testing.real_bridge``."""

from hypha.testing.executors import (
    FakeBridge,
    FakeDirective,
    FakeJob,
    FakeNetwork,
    FakeReceived,
    FakeSendResult,
    FakeSlice,
    Policy,
    Sent,
    diloco_spec,
    sync_after_first,
    sync_every,
    write_slices,
)
from hypha.testing.real_bridge import executor_env, start_real_bridge

__all__ = [
    "FakeBridge",
    "FakeDirective",
    "FakeJob",
    "FakeNetwork",
    "FakeReceived",
    "FakeSendResult",
    "FakeSlice",
    "Policy",
    "Sent",
    "diloco_spec",
    "executor_env",
    "start_real_bridge",
    "sync_after_first",
    "sync_every",
    "write_slices",
]
