"""Which GPUs an execution may use: each GPU shared by at most ``max_jobs_per_gpu`` executions.

The job manager takes slots before it starts an executor and hands their
indices over in ``CUDA_VISIBLE_DEVICES``; it gives them back when the
execution has ended. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from hypha.errors import ResourceExhaustedError


class GpuSlots:
    """GPU indices handed to executions, each GPU shared by at most ``per_gpu`` of them."""

    def __init__(self, gpu_count: int, per_gpu: int) -> None:
        self.gpu_count = gpu_count
        self.per_gpu = per_gpu
        self._holders: dict[int, set[object]] = {gpu: set() for gpu in range(gpu_count)}

    def acquire(self, count: int, owner: object) -> list[int]:
        """``count`` distinct GPUs with a free slot, least shared first; ResourceExhaustedError if not."""
        if count <= 0:
            return []
        free = [gpu for gpu, holders in self._holders.items() if len(holders) < self.per_gpu]
        if len(free) < count:
            raise ResourceExhaustedError(
                f"{count} GPU(s) wanted, {len(free)} of {self.gpu_count} have a free slot "
                f"(max_jobs_per_gpu={self.per_gpu})"
            )
        chosen = sorted(sorted(free, key=lambda gpu: (len(self._holders[gpu]), gpu))[:count])
        for gpu in chosen:
            self._holders[gpu].add(owner)
        return chosen

    def release(self, owner: object) -> None:
        for holders in self._holders.values():
            holders.discard(owner)

    def in_use(self) -> dict[int, int]:
        return {gpu: len(holders) for gpu, holders in self._holders.items()}


__all__ = ["GpuSlots"]
