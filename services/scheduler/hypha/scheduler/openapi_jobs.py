"""JSON Schemas of the job tables a REST body carries, as exact as the job file parser.

``hypha.jobfile`` is the one judge of a job; these schemas say the same
thing in JSON Schema so that a request the document calls valid is one the
server accepts. What JSON Schema cannot say (a rule across fields, a path
that must stay inside the work dir, a value the server parses itself) is
marked with ``x-hypha-server-check`` (``SERVER_CHECK``) where it applies: a
request valid by the schema can still get a 400 there, and only there, and
the error names the key. On an object, the mark is either a map from its
properties to their rules or, as a string, the rule for the whole object.
"""

from __future__ import annotations

from typing import Any

from hypha.jobfile import MAX_INTEGER, RESOURCE_FIELDS, RESOURCE_TYPES, Defaults
from hypha.market.policies import POLICY_NAMES

#: The vendor extension marking what the server checks beyond the schema.
SERVER_CHECK = "x-hypha-server-check"

#: Holds a character ``str.isspace`` does not count as whitespace (``command`` must not be blank):
#: spelled out, since regex engines disagree on ``\\S`` (U+001C..U+001F are whitespace to Python).
NOT_BLANK = (
    "[^\\u0009-\\u000d\\u001c-\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"
)


def _any_case(word: str) -> str:
    """A regex matching ``word`` in any letter case (the list form's types are read lower-cased)."""
    return "".join(f"[{c.upper()}{c}]" if c.isalpha() else c for c in word)


def task_resources() -> dict[str, Any]:
    """A task's ``resources``: a table of minimums, or the reference system's requirement list."""
    task_kind = {"const": "task", "description": "the executor kind (a task's can only be task)"}
    table = {
        "type": "object",
        "properties": {
            **{f: {"type": "number", "minimum": 0} for f in RESOURCE_FIELDS},
            "executor": task_kind,
            "kind": task_kind,
        },
        "additionalProperties": False,
    }
    by_type = {
        "type": "object",
        "required": ["type", "min"],
        "properties": {
            "type": {
                "type": "string",
                "pattern": "^(" + "|".join(_any_case(t) for t in RESOURCE_TYPES) + ")$",
                "description": "GPU (memory, GB), GPUs (count), CPU, Memory, Storage; any letter case",
            },
            "min": {"type": "number", "minimum": 0},
        },
        "additionalProperties": False,
    }
    by_kind = {
        "type": "object",
        "required": ["kind"],
        "properties": {"kind": task_kind},
        "additionalProperties": False,
    }
    return {
        "description": "what a task needs of a worker: {cpu, memory_gb, ...} or a list of {type, min}/{kind}",
        "oneOf": [table, {"type": "array", "items": {"oneOf": [by_type, by_kind]}}],
    }


def task_table(*, kind_required: bool) -> dict[str, Any]:
    """A task's ``[job]`` table as JSON; a ``job`` body names its kind, the task route need not."""
    count = {"type": "integer", "minimum": 0, "maximum": MAX_INTEGER}
    relative = "a relative path inside the task's work dir (not absolute, no ..)"
    return {
        "type": "object",
        "description": "A job file's [job] table for a task, as JSON.",
        "required": ["kind", "command"] if kind_required else ["command"],
        "properties": {
            "kind": {"const": "task"},
            "name": {"type": "string", "maxLength": 128},
            "command": {"type": "string", "pattern": NOT_BLANK, "description": "not blank"},
            "args": {"type": "array", "items": {"type": "string"}},
            "env": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}},
            "gpus": count,
            "timeout_s": {"type": "number", "minimum": 0, "description": "0: no timeout"},
            "completion_marker": {"type": "string", SERVER_CHECK: relative},
            "selection_policy": {"type": "string", "enum": ["", *POLICY_NAMES], "description": "'': default"},
            "files": {
                "type": "array",
                "maxItems": 0,
                "description": "files to ship: only `hypha submit` (gRPC) carries them, REST cannot",
            },
            "outputs": {"type": "array", "items": {"type": "string"}, SERVER_CHECK: f"each {relative}"},
            "resources": task_resources(),
            "price": {
                "type": "object",
                "description": "one of bid and max stands for both when the other is left out",
                "properties": {
                    "bid": {"type": "number", "minimum": 0},
                    "max": {"type": "number", "minimum": 0},
                },
                "additionalProperties": False,
                SERVER_CHECK: {"max": "at least bid"},
            },
            "retry": {
                "type": "object",
                "properties": {
                    "max_attempts": {"type": "integer", "minimum": 1, "maximum": MAX_INTEGER},
                    "backoff_base_s": {"type": "number", "minimum": 0},
                    "backoff_cap_s": {"type": "number", "minimum": 0},
                    "retry_on_timeout": {"type": "boolean"},
                    "retry_on_worker_loss": {"type": "boolean"},
                },
                "additionalProperties": False,
                SERVER_CHECK: {
                    "backoff_cap_s": f"at least backoff_base_s (defaults: base {Defaults.BACKOFF_BASE_S} s, "
                    f"cap {Defaults.BACKOFF_CAP_S} s)"
                },
            },
        },
        "additionalProperties": False,
        SERVER_CHECK: {"gpus": "equal to the GPU count in resources when both are given"},
    }


def _checked_table(kind: str, what: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["kind"],
        "properties": {"kind": {"const": kind}},
        "description": f"A job file's [job] table for {what}, as JSON (keys: docs/jobfile).",
        SERVER_CHECK: f"the table is checked as a job file's {kind} [job] table; errors name its keys",
    }


def job_table_schemas() -> dict[str, dict[str, Any]]:
    """Component schemas of a ``job`` body, one per kind, and the union picked by ``kind``."""
    names = {"task": "TaskJobTable", "diloco": "DilocoJobTable", "inference": "InferenceJobTable"}
    return {
        "TaskJob": task_table(kind_required=False),
        "TaskJobTable": task_table(kind_required=True),
        "DilocoJobTable": _checked_table("diloco", "a DiLoCo job"),
        "InferenceJobTable": _checked_table("inference", "an inference job"),
        "JobTable": {
            "description": "A job file's [job] table as JSON; kind picks its keys.",
            "oneOf": [{"$ref": f"#/components/schemas/{name}"} for name in names.values()],
            "discriminator": {
                "propertyName": "kind",
                "mapping": {kind: f"#/components/schemas/{name}" for kind, name in names.items()},
            },
        },
    }


__all__ = ["NOT_BLANK", "SERVER_CHECK", "job_table_schemas", "task_resources", "task_table"]
