"""The scheduler's REST mirror fuzzed from its own OpenAPI document (schemathesis), over real mTLS.

Schemathesis generates valid and invalid requests for every operation and
checks each answer: no 5xx, a status and body the document declares.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from hypha.scheduler.openapi import openapi_document
from hypha.worker.bridge_openapi import OPENAPI
from tests.fuzz.cluster import FuzzBridge, FuzzCluster

schema = schemathesis.openapi.from_dict(openapi_document())


@schemathesis.serializer("application/toml")
def _toml_body(ctx: object, value: object) -> bytes:
    """A job file is sent as its text (the document types it as a string)."""
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else str(value).encode()


FUZZ = settings(
    max_examples=int(os.environ.get("HYPHA_FUZZ_EXAMPLES", "15")),
    deadline=None,
    derandomize=os.environ.get("HYPHA_FUZZ_EXAMPLES") is None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.timeout(120)
@schema.parametrize()
@FUZZ
def test_rest_api_answers_every_generated_request_as_documented(
    case: schemathesis.Case, cluster: FuzzCluster
) -> None:
    paths = cluster.pki.paths("client")
    case.call_and_validate(
        base_url=cluster.rest_url,
        cert=(str(paths.cert), str(paths.key)),
        verify=str(paths.trust),
        timeout=20,
        # A body can be valid JSON of the right shape and still not be a job
        # (a TOML string, a command no worker offers): those get a documented
        # 400, which the positive-data check would count as a failure.
        excluded_checks=[schemathesis.checks.positive_data_acceptance],
    )


bridge_schema = schemathesis.openapi.from_dict(OPENAPI)


@pytest.mark.timeout(120)
@bridge_schema.parametrize()
@FUZZ
def test_job_bridge_answers_every_generated_request_as_documented(
    case: schemathesis.Case, bridge: FuzzBridge
) -> None:
    case.call_and_validate(
        base_url=bridge.url, timeout=20, excluded_checks=[schemathesis.checks.positive_data_acceptance]
    )
