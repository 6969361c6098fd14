"""Slice tracker: which trainer works on which dataset slice, epoch by epoch.

Each slice of a job's dataset moves AVAILABLE -> ASSIGNED(worker) -> USED
within an epoch. When every slice is USED the epoch ends and all become
AVAILABLE again, so every slice is trained on exactly once per epoch. A lost
worker's ASSIGNED slices go back to AVAILABLE at once; nothing waits on a
worker that is gone.

Decisions (``NOTE``):

- Affinity: a slice belongs to the worker that last used it (one owner per
  slice, not a growing history, so ownership stays a partition as workers
  come and go). ``next_slice`` hands a worker its own AVAILABLE slices first,
  since it probably has them cached; then slices no *live* worker owns, so
  it does not take another worker's cached data while there is other work;
  then any AVAILABLE slice. Within each tier the lowest index goes first,
  which keeps the order stable and the tests deterministic.
- Prefetch: a worker holds at most ``prefetch`` (default 2) ASSIGNED slices:
  one it trains on and one it downloads meanwhile. Asking for more is a
  ``FailedPreconditionError``: it must report used slices first.
- Stealing (``steal=True``, off by default): at the end of an epoch an idle
  worker (holding nothing) may take the most recently assigned slice of the
  worker that holds the most, if that worker holds at least two, i.e. has
  one queued behind the one it is presumably training on. The victim learns
  of it through ``take_revoked``; until the wire protocol carries that (it
  does not yet: ``NextSliceResponse`` has no revoked list) the victim would
  train on the slice anyway, so stealing stays off unless the caller can
  deliver revocations. With ``prefetch=1`` nothing is ever stolen.
- Only the holder may mark a slice USED; a worker reporting a slice it lost
  (by ``worker_lost`` or a steal) gets an error and its report is ignored.

The tracker is a pure synchronous state holder: the caller serialises calls
(one lock or one task per job) and persists ``take_changes()`` if it wants to
survive restarts.

Persistence is incremental: a hand-out changes only the holders (the
``header``: epoch, each live worker's held slices in order, revocations, so
O(workers)); a USED report changes one slice's row ``[owner, used_epoch]``.
A slice is USED when its row names the current epoch, so an epoch's end
rewrites no row. A job of n slices thus writes O(n) bytes per epoch, not the
O(n²) of saving every slice at each hand-out (``docs/performance.md``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from hypha.errors import (
    FailedPreconditionError,
    IllegalTransitionError,
    InvalidArgumentError,
    OutOfRangeError,
)


class SliceState(StrEnum):
    #: Nobody holds it this epoch yet.
    AVAILABLE = "available"
    #: Handed to one worker, which has not reported it done.
    ASSIGNED = "assigned"
    #: Trained on this epoch.
    USED = "used"


_A, _S, _U = SliceState.AVAILABLE, SliceState.ASSIGNED, SliceState.USED

#: Every move a slice may make.
TRANSITIONS: frozenset[tuple[SliceState, SliceState]] = frozenset(
    {
        (_A, _S),  # next_slice hands it out
        (_S, _U),  # its holder reports it done
        (_S, _A),  # its holder is lost or gives it back
        (_S, _S),  # an idle worker steals it (steal=True)
        (_U, _A),  # the epoch ends
    }
)


@dataclass
class _Slice:
    state: SliceState = SliceState.AVAILABLE
    holder: str | None = None
    #: Last worker that used it: the one likely to have it cached.
    owner: str | None = None


#: A slice's saved row: its owner and the epoch it was USED in (``NOT_USED``: not this epoch).
SliceRow = tuple[str | None, int]
NOT_USED = -1


@dataclass(frozen=True)
class SliceSnapshot:
    """Everything needed to rebuild a tracker: a small ``header`` and a row per slice that was
    ever used (``rows``), the form it is saved in."""

    #: slice_count, prefetch, steal, epoch, held (live workers and the slices they hold, in
    #: the order they got them) and revoked; JSON-able.
    header: Mapping[str, Any]
    rows: Mapping[int, SliceRow]


@dataclass(frozen=True)
class SliceChanges:
    """What changed since the last save: the header and the rows of the slices that changed
    (``full``: every row there is, the saved rows replaced)."""

    full: bool
    header: Mapping[str, Any]
    rows: Mapping[int, SliceRow]


class SliceTracker:
    def __init__(self, slice_count: int, prefetch: int = 2, steal: bool = False) -> None:
        if slice_count < 1:
            raise InvalidArgumentError(f"slice_count must be >= 1, got {slice_count}")
        if prefetch < 1:
            raise InvalidArgumentError(f"prefetch must be >= 1, got {prefetch}")
        self.slice_count = slice_count
        self.prefetch = prefetch
        self.steal = steal
        self._epoch = 0
        self._slices = [_Slice() for _ in range(slice_count)]
        self._used = 0
        #: Live workers -> slices they hold, insertion-ordered (oldest first).
        self._held: dict[str, dict[int, None]] = {}
        self._owned: dict[str, set[int]] = {}
        self._revoked: dict[str, list[int]] = {}
        # Candidate heaps with lazy deletion: an entry is checked when it
        # reaches the top and dropped if it no longer qualifies. Every slice
        # that qualifies is in its heap (pushed when it starts to qualify).
        self._avail_heap: list[int] = list(range(slice_count))
        self._free_heap: list[int] = list(range(slice_count))
        self._own_heap: dict[str, list[int]] = {}
        #: Slices whose row changed since the last ``take_changes`` (None: all of them).
        self._dirty: set[int] | None = None

    # ---- queries --------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def workers(self) -> frozenset[str]:
        """Live workers: those that asked for work and were not lost since."""
        return frozenset(self._held)

    def state(self, index: int) -> SliceState:
        return self._slice(index).state

    def holder(self, index: int) -> str | None:
        return self._slice(index).holder

    def owner(self, index: int) -> str | None:
        return self._slice(index).owner

    def assigned(self, worker: str) -> tuple[int, ...]:
        return tuple(self._held.get(worker, ()))

    def affinity(self, worker: str) -> frozenset[int]:
        return frozenset(self._owned.get(worker, ()))

    def counts(self) -> dict[SliceState, int]:
        assigned = sum(len(h) for h in self._held.values())
        return {_A: self.slice_count - assigned - self._used, _S: assigned, _U: self._used}

    def take_revoked(self, worker: str) -> list[int]:
        """Slices stolen from ``worker`` since the last call: it should drop
        them if it has not started on them."""
        return self._revoked.pop(worker, [])

    # ---- commands -------------------------------------------------------

    def next_slice(self, worker: str) -> int | None:
        """The next slice for ``worker`` (joining it if new), or None when
        nothing is AVAILABLE this epoch for now (ask again later)."""
        if worker not in self._held:
            self._join(worker)
        held = self._held[worker]
        if len(held) >= self.prefetch:
            raise FailedPreconditionError(
                f"worker {worker} already holds {len(held)} slices (prefetch limit {self.prefetch}); "
                "report used slices first"
            )
        index = self._pop_own(worker)
        if index is None:
            index = self._pop(self._free_heap, self._is_free)
        if index is None:
            index = self._pop(self._avail_heap, self._is_available)
        if index is not None:
            self._transition(index, _S, worker)
            return index
        if self.steal and not held:
            return self._steal_for(worker)
        return None

    def mark_used(self, worker: str, index: int) -> None:
        """``worker`` finished ``index``. The last slice of an epoch starts the next one."""
        entry = self._slice(index)
        if entry.state is _S and entry.holder != worker:
            raise FailedPreconditionError(f"slice {index} is assigned to {entry.holder}, not {worker}")
        self._transition(index, _U)
        self._changed(index)
        if entry.owner is not None:
            self._owned[entry.owner].discard(index)
        entry.owner = worker
        self._owned.setdefault(worker, set()).add(index)
        if self._used == self.slice_count:
            self._new_epoch()

    def release(self, worker: str, index: int) -> None:
        """``worker`` gives back a slice it cannot use (e.g. the download failed)."""
        entry = self._slice(index)
        if entry.state is _S and entry.holder != worker:
            raise FailedPreconditionError(f"slice {index} is assigned to {entry.holder}, not {worker}")
        self._transition(index, _A)
        self._changed(index)

    def worker_lost(self, worker: str) -> list[int]:
        """Forget a worker: its ASSIGNED slices become AVAILABLE (returned), and
        the slices it owns become free for others. It keeps ownership, so if
        it comes back it still gets its cached slices first."""
        if worker not in self._held:
            return []
        returned = list(self._held[worker])
        self._own_heap.pop(worker, None)
        self._revoked.pop(worker, None)
        for index in returned:
            self._transition(index, _A)
        del self._held[worker]
        for index in self._owned.get(worker, ()):
            if self._is_free(index):
                heapq.heappush(self._free_heap, index)
        return sorted(returned)

    # ---- persistence ----------------------------------------------------

    def snapshot(self) -> SliceSnapshot:
        rows = {i: self._row(i) for i, entry in enumerate(self._slices) if entry.owner is not None}
        return SliceSnapshot(self._header(), rows)

    def take_changes(self) -> SliceChanges:
        """What changed since the last call (everything at the first): the caller saves it, or
        hands it back to ``changes_lost`` when the save failed."""
        if self._dirty is None:
            changes = SliceChanges(True, self._header(), self.snapshot().rows)
        else:
            changes = SliceChanges(False, self._header(), {i: self._row(i) for i in sorted(self._dirty)})
        self._dirty = set()
        return changes

    def changes_lost(self, changes: SliceChanges) -> None:
        """``changes`` were not saved: the next ``take_changes`` holds them again."""
        if changes.full:
            self._dirty = None
        elif self._dirty is not None:
            self._dirty.update(changes.rows)

    @classmethod
    def from_snapshot(cls, snap: SliceSnapshot) -> SliceTracker:
        """The tracker ``snap`` was taken of; its changes are counted from there."""
        try:
            head = snap.header
            tracker = cls(int(head["slice_count"]), int(head["prefetch"]), bool(head["steal"]))
            epoch = int(head["epoch"])
            held = {str(w): tuple(int(i) for i in v) for w, v in head["held"].items()}
            revoked = {str(w): [int(i) for i in v] for w, v in head.get("revoked", {}).items()}
            rows = {int(i): (None if o is None else str(o), int(e)) for i, (o, e) in snap.rows.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgumentError(f"malformed slice snapshot: {exc!r}") from None
        if epoch < 0:
            raise InvalidArgumentError("slice snapshot: negative epoch")
        tracker._epoch = epoch
        holders: dict[int, str] = {}
        for worker, indices in held.items():
            if len(indices) > tracker.prefetch:
                raise InvalidArgumentError(f"slice snapshot: {worker} holds more than prefetch allows")
            for index in indices:
                if not 0 <= index < tracker.slice_count or index in holders:
                    raise InvalidArgumentError(f"slice snapshot: slice {index} held twice or out of range")
                holders[index] = worker
            tracker._held[worker] = dict.fromkeys(indices)
        for index, (owner, used_in) in rows.items():
            if not 0 <= index < tracker.slice_count:
                raise InvalidArgumentError(f"slice snapshot: row {index} out of range")
            entry = tracker._slices[index]
            if used_in == epoch:
                if index in holders:
                    raise InvalidArgumentError(f"slice snapshot: slice {index} is used but held")
                entry.state = _U
            entry.owner = owner
            if owner is not None:
                tracker._owned.setdefault(owner, set()).add(index)
        for index, worker in holders.items():
            tracker._slices[index].state, tracker._slices[index].holder = _S, worker
        tracker._used = sum(1 for s in tracker._slices if s.state is _U)
        if tracker._used == tracker.slice_count:
            raise InvalidArgumentError("slice snapshot: every slice USED but the epoch did not end")
        tracker._revoked = revoked
        tracker._rebuild_heaps()
        tracker._dirty = set()
        return tracker

    def _header(self) -> dict[str, Any]:
        return {
            "slice_count": self.slice_count,
            "prefetch": self.prefetch,
            "steal": self.steal,
            "epoch": self._epoch,
            "held": {w: list(h) for w, h in self._held.items()},
            "revoked": {w: list(r) for w, r in self._revoked.items() if r},
        }

    def _row(self, index: int) -> SliceRow:
        entry = self._slices[index]
        return entry.owner, self._epoch if entry.state is _U else NOT_USED

    def _changed(self, index: int) -> None:
        if self._dirty is not None:
            self._dirty.add(index)

    # ---- internals ------------------------------------------------------

    def _transition(self, index: int, target: SliceState, holder: str | None = None) -> None:
        """The one place a slice changes state; keeps the holder index, the
        USED count and the candidate heaps in step with it."""
        entry = self._slices[index]
        if (entry.state, target) not in TRANSITIONS:
            raise IllegalTransitionError(f"slice {index}", entry.state, target)
        if entry.state is _S:
            assert entry.holder is not None
            del self._held[entry.holder][index]
        elif entry.state is _U:
            self._used -= 1
        if target is _S:
            assert holder is not None
            self._held[holder][index] = None
        elif target is _U:
            self._used += 1
        entry.state = target
        entry.holder = holder if target is _S else None
        if target is _A:
            self._push_available(index)

    def _push_available(self, index: int) -> None:
        heapq.heappush(self._avail_heap, index)
        owner = self._slices[index].owner
        if owner is None or owner not in self._held:
            heapq.heappush(self._free_heap, index)
        elif owner in self._own_heap:
            heapq.heappush(self._own_heap[owner], index)

    def _join(self, worker: str) -> None:
        self._held[worker] = {}
        self._own_heap[worker] = sorted(i for i in self._owned.get(worker, ()) if self._is_available(i))

    def _new_epoch(self) -> None:
        self._epoch += 1
        self._avail_heap.clear()
        self._free_heap.clear()
        for heap in self._own_heap.values():
            heap.clear()
        for index in range(self.slice_count):
            self._transition(index, _A)

    def _rebuild_heaps(self) -> None:
        self._avail_heap = [i for i in range(self.slice_count) if self._is_available(i)]
        self._free_heap = [i for i in self._avail_heap if self._is_free(i)]
        self._own_heap = {
            w: sorted(i for i in self._owned.get(w, ()) if self._is_available(i)) for w in self._held
        }

    def _is_available(self, index: int) -> bool:
        return self._slices[index].state is _A

    def _is_free(self, index: int) -> bool:
        entry = self._slices[index]
        return entry.state is _A and (entry.owner is None or entry.owner not in self._held)

    def _pop_own(self, worker: str) -> int | None:
        return self._pop(
            self._own_heap[worker], lambda i: self._is_available(i) and self._slices[i].owner == worker
        )

    @staticmethod
    def _pop(heap: list[int], valid: Callable[[int], bool]) -> int | None:
        while heap:
            index = heapq.heappop(heap)
            if valid(index):
                return index
        return None

    def _steal_for(self, worker: str) -> int | None:
        loaded = [(len(h), w) for w, h in self._held.items() if w != worker and len(h) >= 2]
        if not loaded:
            return None
        # Most slices held first; ties go to the smallest worker id.
        _, victim = min(loaded, key=lambda pair: (-pair[0], pair[1]))
        index = next(reversed(self._held[victim]))
        self._transition(index, _S, worker)
        self._revoked.setdefault(victim, []).append(index)
        return index

    def _slice(self, index: int) -> _Slice:
        if not 0 <= index < self.slice_count:
            raise OutOfRangeError(f"slice {index} out of range 0..{self.slice_count - 1}")
        return self._slices[index]
