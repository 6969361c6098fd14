"""What an executor process uses to talk to its worker: the job bridge client.

A training script started by a Hypha worker does::

    from hypha.bridge_client import BridgeClient

    async with BridgeClient.from_env() as bridge:
        job = await bridge.job()
        model_dir = await bridge.fetch_resource("model")
        ...
        directive = await bridge.progress(round, batches, samples, loss, seconds, batch_size)

or, without asyncio, the same calls on ``SyncBridgeClient.from_env()``.
The contract is ``docs/job-bridge.md``.
"""

from hypha.bridge_client.client import (
    ENV_EXECUTOR,
    ENV_JOB_ID,
    ENV_SOCKET,
    ENV_TORCH_THREADS,
    ENV_WORK_DIR,
    BridgeClient,
    BridgeConflictError,
    BridgeError,
    BridgeForbiddenError,
    BridgeInvalidError,
    BridgeNotFoundError,
    BridgeUnavailableError,
    Directive,
    DirectiveKind,
    JobInfo,
    Received,
    SliceInfo,
    apply_torch_threads,
    torch_threads,
)
from hypha.bridge_client.sync_client import SyncBridgeClient

__all__ = [
    "ENV_EXECUTOR",
    "ENV_JOB_ID",
    "ENV_SOCKET",
    "ENV_TORCH_THREADS",
    "ENV_WORK_DIR",
    "BridgeClient",
    "BridgeConflictError",
    "BridgeError",
    "BridgeForbiddenError",
    "BridgeInvalidError",
    "BridgeNotFoundError",
    "BridgeUnavailableError",
    "Directive",
    "DirectiveKind",
    "JobInfo",
    "Received",
    "SliceInfo",
    "SyncBridgeClient",
    "apply_torch_threads",
    "torch_threads",
]
