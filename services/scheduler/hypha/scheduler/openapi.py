"""The OpenAPI 3.1 description of the scheduler's REST mirror (served at ``/api/v1/openapi.json``).

Kept apart from the server (``hypha.scheduler.rest``) because it is data:
one document that names every route, its parameters, bodies and errors,
checked against the routes the server really has by the REST tests, and
against what the server accepts by the schemathesis fuzz (all checks).
Job tables' schemas live in ``hypha.scheduler.openapi_jobs``.
"""

from __future__ import annotations

from typing import Any

from hypha.scheduler.diloco.elastic import MAX_WORKERS
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.openapi_jobs import SERVER_CHECK, job_table_schemas

#: Prefix of every REST route.
API = "/api/v1"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _one(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A body of exactly one key (one form of a submission)."""
    return {"type": "object", "required": [key], "properties": {key: schema}, "additionalProperties": False}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of the REST mirror."""
    errors = {
        code: _json(_ref("Error"), text)
        for code, text in (
            ("400", "malformed request (the message names the key)"),
            ("403", "the certificate's role may not call this"),
            ("404", "no such job (at submit: no data node announces the job's dataset)"),
            ("409", "the job is not in a state that allows this"),
        )
    }
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
    state_filter = {
        "name": "state",
        "in": "query",
        "required": False,
        "schema": {"type": "array", "items": _ref("JobState")},
        "style": "form",
        "explode": True,
    }
    job = _json(_ref("Job"), "the job")
    jobs = _json({"type": "object", "properties": {"jobs": {"type": "array", "items": _ref("Job")}}}, "jobs")
    cancelled = _json(
        {
            "type": "object",
            "required": ["cancelled"],
            "properties": {"cancelled": {"type": "array", "items": {"type": "string"}}},
        },
        "ids of the jobs cancelled; they stay readable, in state cancelled",
    )
    submitted = _json(_ref("Job"), "accepted: the job, PENDING")
    toml_check = (
        "a job file's text, checked as hypha submit checks the file; errors name its keys (job.dataset)"
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Hypha scheduler REST API",
            "version": "1",
            "description": "REST mirror of the hypha.v1.Scheduler gRPC client API. Mutual TLS is required: "
            "a client or admin certificate of the network. Cancelling is an action (POST .../cancel), "
            "not DELETE: a cancelled job stays readable, and DELETE on a job answers 405. "
            f"`{SERVER_CHECK}` marks what the server checks beyond this document's schemas (a rule "
            "across fields, a value the server parses): a request valid by the schemas can still get "
            "a 400 there, and only there; the error names the key.",
        },
        "security": [{"mtls": []}],
        "paths": {
            f"{API}/tasks": {
                "post": {
                    "summary": "Submit a task job",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("TaskJob")}},
                    },
                    "responses": {"201": submitted, **errors},
                },
                "get": {
                    "summary": "List task jobs",
                    "parameters": [state_filter],
                    "responses": {"200": jobs, "400": errors["400"], "403": errors["403"]},
                },
            },
            f"{API}/tasks/{{job_id}}": {
                "parameters": [job_id],
                "get": {"summary": "Get a task job", "responses": {"200": job, **errors}},
            },
            f"{API}/tasks/{{job_id}}/cancel": {
                "parameters": [job_id],
                "post": {"summary": "Cancel a task job", "responses": {"200": cancelled, **errors}},
            },
            f"{API}/jobs": {
                "post": {
                    "summary": "Submit a job (TOML job file, job table, or JobSpec)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/toml": {
                                "schema": {
                                    "type": "string",
                                    "contentMediaType": "application/toml",
                                    SERVER_CHECK: toml_check,
                                }
                            },
                            "application/json": {"schema": _ref("JobSubmission")},
                        },
                    },
                    "responses": {"201": submitted, **errors},
                },
                "get": {
                    "summary": "List jobs",
                    "parameters": [
                        state_filter,
                        {
                            "name": "kind",
                            "in": "query",
                            "schema": {"type": "string", "enum": ["diloco", "task", "inference"]},
                        },
                    ],
                    "responses": {"200": jobs, "400": errors["400"], "403": errors["403"]},
                },
            },
            f"{API}/jobs:cancel": {
                "post": {
                    "summary": "Cancel every active job of the caller (every job, for an admin)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["all"],
                                    "properties": {"all": {"const": True}},
                                    "additionalProperties": False,
                                }
                            }
                        },
                    },
                    "responses": {"200": cancelled, "400": errors["400"], "403": errors["403"]},
                },
            },
            f"{API}/jobs/{{job_id}}": {
                "parameters": [job_id],
                "get": {"summary": "Get a job", "responses": {"200": job, **errors}},
            },
            f"{API}/jobs/{{job_id}}/cancel": {
                "parameters": [job_id],
                "post": {"summary": "Cancel a job", "responses": {"200": cancelled, **errors}},
            },
            f"{API}/jobs/{{job_id}}/scale": {
                "parameters": [job_id],
                "post": {
                    "summary": "Grow or shrink a running DiLoCo job (shrinking waits for a round boundary)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["workers"],
                                    "properties": {
                                        "workers": {"type": "integer", "minimum": 1, "maximum": MAX_WORKERS}
                                    },
                                    "additionalProperties": False,
                                }
                            }
                        },
                    },
                    "responses": {"200": job, **errors},
                },
            },
            f"{API}/jobs/{{job_id}}/logs": {
                "parameters": [job_id],
                "get": {
                    "summary": "The job's kept log lines",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {"lines": {"type": "array", "items": _ref("LogLine")}},
                            },
                            "log lines, oldest first",
                        ),
                        **errors,
                    },
                },
            },
            f"{API}/workers": {
                "get": {
                    "summary": "Workers this scheduler holds leases on",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {"workers": {"type": "array", "items": {"type": "object"}}},
                            },
                            "hypha.v1.WorkerView objects in proto JSON",
                        )
                    },
                }
            },
            f"{API}/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI"}}}
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (any certificate of the network)",
                    "responses": {"200": {"description": "text/plain; version=0.0.4"}},
                }
            },
        },
        "components": {
            "securitySchemes": {"mtls": {"type": "mutualTLS", "description": "client or admin certificate"}},
            "schemas": {
                "JobState": {"type": "string", "enum": [s.value for s in JobState]},
                "Job": {
                    "type": "object",
                    "required": ["job_id", "kind", "state"],
                    "properties": {
                        "job_id": {"type": "string"},
                        "name": {"type": "string"},
                        "kind": {"type": "string", "enum": ["diloco", "task", "inference"]},
                        "state": _ref("JobState"),
                        "reason": {"type": "string"},
                        "created_at": {"type": "string", "format": "date-time"},
                        "updated_at": {"type": "string", "format": "date-time"},
                        "round": {"type": "integer"},
                        "rounds": {"type": "integer"},
                        "loss": {"type": "number"},
                        "workers": {"type": "array", "items": {"type": "string"}},
                        "attempt": {"type": "integer"},
                        "exit_code": {"type": "integer"},
                        "submitted_by": {"type": "string", "description": "peer id of the submitting client"},
                        "spec": {
                            "type": "object",
                            "description": "hypha.v1.JobSpec in proto JSON (secrets redacted)",
                        },
                    },
                },
                **job_table_schemas(),
                "JobSubmission": {
                    "description": "Exactly one of toml, job, spec.",
                    "oneOf": [
                        _one(
                            "toml",
                            {
                                "type": "string",
                                "contentMediaType": "application/toml",
                                SERVER_CHECK: toml_check,
                            },
                        ),
                        _one("job", _ref("JobTable")),
                        _one(
                            "spec",
                            {
                                "type": "object",
                                "description": "hypha.v1.JobSpec in proto JSON",
                                SERVER_CHECK: "checked field by field as a JobSpec; errors name the field "
                                "(spec.task.command)",
                            },
                        ),
                    ],
                },
                "LogLine": {
                    "type": "object",
                    "properties": {
                        k: {"type": "string"} for k in ("job_id", "stream", "line", "at", "worker_id")
                    },
                },
                "Error": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                        }
                    },
                },
            },
        },
    }


__all__ = ["API", "openapi_document"]
