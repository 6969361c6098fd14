"""The REST mirror's OpenAPI document says what the server accepts, and what each method means.

The cases are the disagreements a schemathesis run found (tests/fuzz/test_rest_fuzz.py
fuzzes the rest): a body the document calls valid is accepted, one it calls
invalid is refused, and a valid one refused only with an error naming a key
the document marks ``x-hypha-server-check``.
"""

from __future__ import annotations

from typing import Any

import pytest

from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.openapi import API, openapi_document
from hypha.scheduler.rest import RestServer
from tests.conftest import Pki
from tests.fuzz.server_checks import documented_refusal, request_schema, valid
from tests.scheduler.test_rest import _json, http, rest
from tests.scheduler.test_servicer import DILOCO_TOML, Served

__all__ = ["rest"]  # the fixture, shared with test_rest.py

DOCUMENT = openapi_document()

#: (route, body, valid by the document, the server's status).
SUBMISSIONS: list[tuple[str, dict[str, Any], bool, int]] = [
    # kind is the discriminator of a job table: required in JSON (a job file may leave it out).
    ("/jobs", {"job": {}}, False, 400),
    ("/jobs", {"job": {"command": "true"}}, False, 400),
    ("/jobs", {"job": {"kind": "task", "command": "true"}}, True, 201),
    ("/jobs", {"toml": '[job]\nkind = "task"\ncommand = "true"\n', "name": "x"}, False, 400),
    ("/tasks", {"command": "true", "kind": ""}, False, 400),
    # An integer field takes a whole float, as JSON Schema's integer does.
    ("/tasks", {"command": "true", "gpus": 1.0, "retry": {"max_attempts": 2.0}}, True, 201),
    ("/tasks", {"command": "true", "gpus": 1.5}, False, 400),
    # Every executor kind given is checked, not only the last one read.
    ("/tasks", {"command": "true", "resources": {"executor": "inference", "kind": "task"}}, False, 400),
    ("/tasks", {"command": "   "}, False, 400),
    # A rule across fields: valid by the schema, refused, and marked in the document.
    ("/tasks", {"command": "true", "retry": {"backoff_cap_s": 1}}, True, 400),
    ("/tasks", {"command": "true", "price": {"bid": 2, "max": 1}}, True, 400),
]


async def _post(session: Any, url: str, body: Any) -> tuple[int, bytes]:
    async with session.post(url, json=body) as response:
        return response.status, await response.read()


def _agrees(route: str, body: Any, status: int, content: bytes) -> bool:
    schema = request_schema(DOCUMENT, f"{API}{route}", "post", "application/json")
    if not valid(schema, body, DOCUMENT):
        return 400 <= status < 500
    return status < 400 or documented_refusal(DOCUMENT, schema, body, status, content)


@pytest.mark.timeout(60)
async def test_the_document_and_the_server_agree_on_every_body_the_fuzz_caught(
    rest: tuple[Served, RestServer], pki: Pki
) -> None:
    served, server = rest
    async with http(pki.tls("client"), pki.tls("client")) as session:
        for route, body, is_valid, expected in SUBMISSIONS:
            schema = request_schema(DOCUMENT, f"{API}{route}", "post", "application/json")
            status, content = await _post(session, f"{server.url}{API}{route}", body)
            assert (valid(schema, body, DOCUMENT), status) == (is_valid, expected), (route, body, content)
            assert _agrees(route, body, status, content), (route, body, content)

        # Scaling: a whole float is an integer; a fraction, an unknown key or too many trainers are not.
        job = await _json(await session.post(f"{server.url}{API}/jobs", json={"toml": DILOCO_TOML}), 201)
        await served.store.transition(job["job_id"], JobState.ALLOCATING)
        route = "/jobs/{job_id}/scale"
        for body, is_valid, expected in (
            ({"workers": 2.0}, True, 200),
            ({"workers": 1.5}, False, 400),
            ({"workers": 2, "min": 1}, False, 400),
            ({"workers": 1025}, False, 400),
        ):
            url = f"{server.url}{API}/jobs/{job['job_id']}/scale"
            status, content = await _post(session, url, body)
            schema = request_schema(DOCUMENT, f"{API}{route}", "post", "application/json")
            assert (valid(schema, body, DOCUMENT), status) == (is_valid, expected), (body, content)
    assert served.orchestrator.scaled == [(job["job_id"], 2)]


@pytest.mark.timeout(60)
async def test_cancel_is_an_action_and_delete_is_refused_with_the_methods_allowed(
    rest: tuple[Served, RestServer], pki: Pki
) -> None:
    _, server = rest
    api = f"{server.url}{API}"
    async with http(pki.tls("client"), pki.tls("client")) as session:
        job_id = (await _json(await session.post(f"{api}/tasks", json={"command": "true"}), 201))["job_id"]
        for url in (f"{api}/jobs/{job_id}", f"{api}/tasks/{job_id}"):
            async with session.delete(url) as response:
                assert response.status == 405
                assert {m.strip() for m in response.headers["Allow"].split(",")} == {"GET", "HEAD"}
                assert f"POST {API}/jobs/{{job_id}}/cancel" in await response.text()
        # DELETE changed nothing; cancelling does, and the job stays readable.
        assert (await _json(await session.get(f"{api}/jobs/{job_id}"), 200))["state"] == "pending"
        cancelled = await _json(await session.post(f"{api}/jobs/{job_id}/cancel"), 200)
        assert cancelled == {"cancelled": [job_id]}
        assert (await _json(await session.get(f"{api}/tasks/{job_id}"), 200))["state"] == "cancelled"
        await _json(await session.post(f"{api}/jobs/{job_id}/cancel"), 409)
    doc = DOCUMENT["paths"]
    assert "delete" not in doc[f"{API}/jobs/{{job_id}}"] and "post" in doc[f"{API}/jobs/{{job_id}}/cancel"]


async def test_the_document_names_every_route_the_server_has_and_no_other(
    rest: tuple[Served, RestServer],
) -> None:
    _, server = rest
    served = {(route.method.lower(), route.path) for route in server.routes()}
    documented = {
        (method, path)
        for path, item in DOCUMENT["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }
    assert served == documented
