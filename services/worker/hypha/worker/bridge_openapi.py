"""The OpenAPI 3.1 description of the job bridge, served at ``GET /v1/openapi.json``.

Kept beside the handlers (``bridge.py``) and checked by a test against the
routes the bridge really serves, so the document cannot drift from them.
"""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/responses/Error"}
_EMPTY = {"description": "done", "content": {"application/json": {"schema": {"type": "object"}}}}
_ERRORS = {"400": _ERROR, "403": _ERROR, "404": _ERROR, "409": _ERROR, "413": _ERROR, "503": _ERROR}


def _body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object", "properties": properties, "required": required}}
        },
    }


def _json(description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"type": "object", "properties": properties}}},
    }


_INT = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}  # uint32 fields
_U64 = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}  # uint64 fields (samples)
_STR = {"type": "string"}
_NUM = {"type": "number"}
_PATH = {"type": "string", "description": "a path inside the job's work dir (relative or absolute)"}
_REF = {"type": "object", "description": "a reference: {type: huggingface | scheduler | uri | peers, ...}"}
#: The reference answers a body it cannot read as its JSON extractor does: plain text.
_PLAIN = {"text/plain": {"schema": _STR}}
_REFERENCE_ERRORS = {
    "400": {
        "description": "invalid_request as JSON {error, detail}; a body that is not JSON, as plain text",
        "content": {
            "application/json": {"schema": {"type": "object", "properties": {"error": _STR, "detail": _STR}}},
            **_PLAIN,
        },
    },
    "415": {"description": "the body is not application/json", "content": _PLAIN},
    "422": {"description": "the body's JSON has the wrong shape", "content": _PLAIN},
    "500": {"$ref": "#/components/responses/ReferenceError"},
}


def _reference(summary: str, schema: dict[str, Any], responses: dict[str, Any]) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    return {
        "post": {"summary": summary, "requestBody": body, "responses": {**responses, **_REFERENCE_ERRORS}}
    }


def _json_array(description: str, properties: dict[str, Any]) -> dict[str, Any]:
    item = {"type": "object", "properties": properties}
    return {
        "description": description,
        "content": {"application/json": {"schema": {"type": "array", "items": item}}},
    }


_TENSOR_HEADERS = {
    "X-Hypha-From": {"schema": _STR, "description": "peer id of the sender (from its TLS session)"},
    "X-Hypha-Kind": {"schema": _STR},
    "X-Hypha-Round": {"schema": _INT},
    "X-Hypha-Samples": {"schema": _U64},
}
_SAFETENSORS = {
    "description": "a complete, checksum-verified SafeTensors payload",
    "headers": _TENSOR_HEADERS,
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "Hypha job bridge",
        "version": "1",
        "description": "HTTP over the Unix socket in a job's private work dir; see docs/job-bridge.md.",
    },
    "paths": {
        "/v1/openapi.json": {"get": {"summary": "this document", "responses": {"200": _EMPTY}}},
        "/v1/job": {
            "get": {
                "summary": "the job this executor runs",
                "responses": {
                    "200": _json(
                        "the job",
                        {
                            "job_id": _STR,
                            "executor": _STR,
                            "spec": {"type": "object", "description": "JobSpec, protobuf JSON"},
                            "work_dir": _STR,
                            "batch_size": _INT,
                            "parameter_server_id": _STR,
                            "trainer_ids": {"type": "array", "items": _STR},
                            "start_round": _INT,
                            "attempt": _INT,
                        },
                    )
                },
            }
        },
        "/v1/resources/fetch": {
            "post": {
                "summary": "download or link a resource of the spec into the work dir",
                "requestBody": _body({"resource": {"enum": ["model", "preprocessor"]}}, ["resource"]),
                "responses": {"200": _json("where its files are", {"path": _STR}), **_ERRORS},
            }
        },
        "/v1/slices/next": {
            "get": {
                "summary": "the next data slice assigned to this worker, verified, in the work dir",
                "responses": {
                    "200": _json("a slice", {"index": _INT, "epoch": _INT, "path": _STR}),
                    "204": {"description": "nothing for now"},
                    **_ERRORS,
                },
            }
        },
        "/v1/slices/used": {
            "post": {
                "summary": "slices consumed (reported as USED with the next slice request)",
                "requestBody": _body({"indices": {"type": "array", "items": _INT}}, ["indices"]),
                "responses": {"200": _EMPTY, **_ERRORS},
            }
        },
        "/v1/progress": {
            "post": {
                "summary": "report progress; the answer is the scheduler's directive",
                "requestBody": _body(
                    {
                        "round": _INT,
                        "batches": _INT,
                        "samples": _U64,
                        "loss": _NUM,
                        "batch_seconds": _NUM,
                        "batch_size": _INT,
                    },
                    ["round", "batches", "samples"],
                ),
                "responses": {
                    "200": _json(
                        "directive",
                        {
                            "kind": {"enum": ["continue", "sync_after", "sync_now", "done"]},
                            "batches": _INT,
                            "round": _INT,
                        },
                    ),
                    **_ERRORS,
                },
            }
        },
        "/v1/metrics": {
            "post": {
                "summary": "report named figures of a round",
                "requestBody": _body(
                    {"round": _INT, "values": {"type": "object", "additionalProperties": _NUM}},
                    ["values"],
                ),
                "responses": {"200": _EMPTY, **_ERRORS},
            }
        },
        "/v1/log": {
            "post": {
                "summary": "append a line to the job's log at the scheduler",
                "requestBody": _body(
                    {"stream": {"enum": ["stdout", "stderr", "system"]}, "line": _STR}, ["line"]
                ),
                "responses": {"200": _EMPTY, **_ERRORS},
            }
        },
        "/v1/tensors/send": {
            "post": {
                "summary": "stream a SafeTensors file to a peer's Worker.PushTensors (retried if broken)",
                "requestBody": _body(
                    {"peer": _STR, "kind": _STR, "round": _INT, "samples": _U64, "path": _PATH},
                    ["peer", "kind", "path"],
                ),
                "responses": {
                    "200": _json("the peer's answer", {"accepted": {"type": "boolean"}, "message": _STR}),
                    **_ERRORS,
                },
            }
        },
        "/v1/tensors/inbox": {
            "get": {
                "summary": "the next payload peers pushed to this job",
                "parameters": [
                    {"name": "kind", "in": "query", "required": True, "schema": _STR},
                    {"name": "timeout_s", "in": "query", "schema": _NUM},
                ],
                "responses": {"200": _SAFETENSORS, "204": {"description": "timed out"}, **_ERRORS},
            }
        },
        "/v1/tensors/publish": {
            "post": {
                "summary": "serve a SafeTensors file to peers pulling (job, kind, round)",
                "requestBody": _body(
                    {"kind": _STR, "round": _INT, "path": _PATH, "samples": _U64}, ["kind", "path"]
                ),
                "responses": {"200": _EMPTY, **_ERRORS},
            }
        },
        "/v1/tensors/fetch": {
            "get": {
                "summary": "pull a payload a peer's job published (waits for the round)",
                "parameters": [
                    {"name": "peer", "in": "query", "required": True, "schema": _STR},
                    {"name": "kind", "in": "query", "required": True, "schema": _STR},
                    {"name": "round", "in": "query", "schema": _INT},
                    {"name": "timeout_s", "in": "query", "schema": _NUM},
                ],
                "responses": {"200": _SAFETENSORS, "204": {"description": "timed out"}, **_ERRORS},
            }
        },
        "/v1/result": {
            "post": {
                "summary": "name the dir holding the job's final artefacts",
                "requestBody": _body({"path": _PATH}, ["path"]),
                "responses": {"200": _EMPTY, **_ERRORS},
            }
        },
        "/v1/status": {
            "post": {
                "summary": "say how the executor is doing (the exit code still decides the end)",
                "requestBody": _body(
                    {"state": {"enum": ["running", "succeeded", "failed"]}, "message": _STR}, ["state"]
                ),
                "responses": {"200": _EMPTY, **_ERRORS},
            }
        },
        # The reference system's API on the same socket (hypha.worker.reference_bridge).
        "/resources/fetch": _reference(
            "the job's model, preprocessor or next data slice, into artifacts/ (reference API)",
            _REF,
            {"200": _json_array("the files fetched", {"path": _STR, "size": _INT})},
        ),
        "/resources/send": _reference(
            "send a file (the trainer's update) to peers, in the background (reference API)",
            {
                "type": "object",
                "properties": {"resource": _REF, "path": _STR},
                "required": ["resource", "path"],
            },
            {"200": {"description": "accepted; the file travels in the background"}},
        ),
        "/resources/receive": _reference(
            "an event stream of the files (updates) received for this execution (reference API)",
            {"type": "object", "properties": {"resource": _REF, "path": _STR}, "required": ["resource"]},
            {
                "200": {
                    "description": "text/event-stream of {path, size, from_peer}",
                    "content": {"text/event-stream": {}},
                }
            },
        ),
        "/status/send": _reference(
            "report progress; the scheduler's answer (reference API)",
            {"oneOf": [{"enum": ["update", "updated", "update-received"]}, {"type": "object"}]},
            {"200": _json("Continue, ScheduleUpdate {counter}, Done or Ok", {"type": _STR, "counter": _INT})},
        ),
    },
    "components": {
        "responses": {
            "ReferenceError": _json(
                "400 invalid_request; 500 network_error, connector_error, io_error (reference API)",
                {"error": _STR, "detail": _STR},
            ),
            "Error": _json(
                "400 malformed, 403 outside the work dir, 404 unknown, 409 wrong state, "
                "413 too large, 503 upstream unavailable",
                {"error": _STR},
            ),
        }
    },
}
