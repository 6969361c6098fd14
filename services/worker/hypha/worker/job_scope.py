"""Jobs are scoped to the scheduler that dispatched them and to their members (issue 16).

A job id is the scheduler's name for a job, not a secret and not unique
across schedulers. The worker keys its tensor exchange, bridge, results and
status by job id, so it holds the id to one owner: while an execution of a
job runs here, a dispatch of the same id by another scheduler is refused
(PERMISSION_DENIED), which makes every job-id key here a (scheduler, job id)
key. The owner's own second dispatches (rewiring, re-attaching, a trainer
beside its parameter server) are unaffected. The id stays its scheduler's
after the job ends (``JobOwners``): the worker keeps the job's result,
status and logs under that id, so a second scheduler taking it up would
replace the first's kept result and read its status. The owners of the most
recently dispatched ids are remembered, a bounded number; one forgotten is
still held while an execution of it runs.

Tensors move only between a job's members: a worker may push to or pull from
a job here only if a live dispatch of that job names it (the parameter
server, a former one, or a trainer). So another job's trainer cannot pull a
job's ``global`` state or slip deltas into its inbox, and a second
scheduler's worker cannot either. The scheduler's own kinds (``ps-state``,
``model``) are checked against the dispatching scheduler instead
(``jobs_servicer``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hypha.errors import PermissionDeniedError
from hypha.worker.execution_state import JobDispatch


def check_owner(dispatches: Sequence[JobDispatch], job_id: str, scheduler: str) -> None:
    """Refuse ``scheduler`` a job id that a live execution here holds for another scheduler."""
    owners = {dispatch.scheduler_id for dispatch in dispatches}
    if owners - {scheduler}:
        raise PermissionDeniedError(
            f"job {job_id!r} runs here for another scheduler; a scheduler cannot dispatch under "
            "another's job id"
        )


#: Job ids whose owner a worker remembers by default (about 200 bytes each).
DEFAULT_REMEMBERED_OWNERS = 10_000


class JobOwners:
    """The scheduler each job id dispatched here belongs to, live or ended; the least recently
    dispatched ids are forgotten beyond ``max_entries``."""

    def __init__(self, max_entries: int = DEFAULT_REMEMBERED_OWNERS) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._owners: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def claim(self, job_id: str, scheduler: str, live: Sequence[JobDispatch]) -> None:
        """Take ``job_id`` for ``scheduler`` (again), or refuse it (PermissionDeniedError) when the
        id's live executions or its remembered owner are another scheduler's.

        Claimed before the dispatch runs (no await in between), so two schedulers
        dispatching one new id at once cannot both pass.
        """
        check_owner(live, job_id, scheduler)
        owner = self._owners.get(job_id)
        if owner is not None and owner != scheduler:
            raise PermissionDeniedError(
                f"job {job_id!r} ran here for another scheduler; a scheduler cannot dispatch under "
                "another's job id"
            )
        self._owners[job_id] = scheduler
        self._owners.move_to_end(job_id)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)


def members(dispatches: Sequence[JobDispatch]) -> frozenset[str]:
    """Every worker the live dispatches of a job name: its parameter servers and trainers."""
    named: set[str] = set()
    for dispatch in dispatches:
        named.update(dispatch.trainer_ids, dispatch.former_parameter_servers)
        named.add(dispatch.parameter_server_id)
    named.discard("")
    return frozenset(named)


def check_member(dispatches: Sequence[JobDispatch], job_id: str, peer: str) -> None:
    """Refuse a worker that is not one of the job's members its tensors.

    No live dispatch: the exchange answers (NOT_FOUND). The job manager opens a
    job's exchange only while its execution is live, so a job open there always
    has the dispatch this checks against; only tests open jobs by hand.
    """
    if not dispatches:
        return
    if peer not in members(dispatches):
        raise PermissionDeniedError(f"{peer} is not a member of job {job_id!r} on this worker")


__all__ = ["DEFAULT_REMEMBERED_OWNERS", "JobOwners", "check_member", "check_owner", "members"]
