"""Slice files cut into batches of exactly the worker's batch size (rows carry over between slices)."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping

import torch

from hypha.errors import DataLossError, InvalidArgumentError

Batch = dict[str, torch.Tensor]


def to_device(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def batch_rows(batch: Mapping[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])


class BatchStream:
    """Cuts slices into batches of exactly ``batch_size`` samples.

    Rows left over at the end of a slice wait for the next slice, so a batch
    may span two slices and the batch size (the scheduler's per-worker
    figure) holds. A slice counts as consumed once its last row has gone into
    a batch; ``take_consumed`` hands those indices out once.
    """

    def __init__(self, batch_size: int, keys: Collection[str] | None = None) -> None:
        if batch_size < 1:
            raise InvalidArgumentError(f"batch size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._keys = None if keys is None else tuple(keys)
        self._pending: deque[tuple[int, dict[str, torch.Tensor], int]] = deque()
        self._consumed: list[int] = []

    @property
    def pending_rows(self) -> int:
        return sum(batch_rows(tensors) - offset for _, tensors, offset in self._pending)

    @property
    def held_slices(self) -> int:
        """Slices this stream holds that the scheduler still counts as assigned: those with rows
        left, and those used up but not yet handed out by ``take_consumed``."""
        return len(self._pending) + len(self._consumed)

    def add_slice(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        selected = {k: v for k, v in tensors.items() if self._keys is None or k in self._keys}
        if not selected:
            raise DataLossError(f"slice {index} holds none of the tensors {list(self._keys or ())}")
        rows = {k: int(v.shape[0]) if v.dim() else -1 for k, v in selected.items()}
        if len(set(rows.values())) != 1 or min(rows.values()) < 0:
            raise DataLossError(f"slice {index}: tensors do not share their first dimension: {rows}")
        if next(iter(rows.values())) == 0:
            self._consumed.append(index)
            return
        self._pending.append((index, selected, 0))

    def next_batch(self) -> Batch | None:
        """A full batch, or None while fewer than ``batch_size`` rows are pending."""
        if self.pending_rows < self.batch_size:
            return None
        return self._take(self.batch_size)

    def flush(self) -> Batch | None:
        """Whatever rows are pending, as one short batch (None when there are none)."""
        rows = self.pending_rows
        return self._take(rows) if rows else None

    def take_consumed(self) -> list[int]:
        consumed, self._consumed = self._consumed, []
        return consumed

    def _take(self, rows: int) -> Batch:
        pieces: list[dict[str, torch.Tensor]] = []
        while rows > 0:
            index, tensors, offset = self._pending[0]
            available = batch_rows(tensors) - offset
            n = min(rows, available)
            pieces.append({k: v[offset : offset + n] for k, v in tensors.items()})
            rows -= n
            if n == available:
                self._pending.popleft()
                self._consumed.append(index)
            else:
                self._pending[0] = (index, tensors, offset + n)
        if len(pieces) == 1:
            return pieces[0]
        return {k: torch.cat([piece[k] for piece in pieces]) for k in pieces[0]}
