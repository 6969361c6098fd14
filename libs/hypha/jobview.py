"""A job as JSON: the one view the REST API serves and ``hypha ... --output json`` prints.

Both start from the ``hypha.v1.Job`` message (the REST mirror converts its
record with ``to_proto()``, which redacts secrets), so the two outputs have
the same keys and values by construction. Times are UTC ISO 8601 text,
states and kinds lower-case words, the spec the proto's JSON mapping with
field names as in the proto.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from hypha.timestamps import timestamp_iso8601
from hypha.v1 import common_pb2, scheduler_pb2


def state_name(value: int) -> str:
    """A ``JobState`` value as its lower-case word (``JOB_STATE_RUNNING`` → ``running``)."""
    return common_pb2.JobState.Name(value).removeprefix("JOB_STATE_").lower()


def job_json(job: scheduler_pb2.Job) -> dict[str, Any]:
    """The JSON object of one job."""
    return {
        "job_id": job.job_id,
        "name": job.spec.name,
        "kind": job.spec.WhichOneof("kind") or "",
        "state": state_name(job.state),
        "reason": job.reason,
        "created_at": timestamp_iso8601(job.created_at),
        "updated_at": timestamp_iso8601(job.updated_at),
        "round": job.round,
        "rounds": job.rounds,
        "loss": job.loss,
        "workers": list(job.workers),
        "attempt": job.attempt,
        "exit_code": job.exit_code,
        "submitted_by": job.submitted_by,
        "spec": json_format.MessageToDict(job.spec, preserving_proto_field_name=True),
    }


__all__ = ["job_json", "state_name"]
