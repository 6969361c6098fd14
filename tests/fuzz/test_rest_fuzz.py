"""The scheduler's REST mirror fuzzed from its own OpenAPI document (schemathesis), over real mTLS.

Schemathesis generates valid and invalid requests for every operation and
runs every one of its checks on each answer: no 5xx, a status, headers and
body the document declares, invalid data refused and valid data accepted,
and (in the stateful run, which chains operations by the links it infers)
a resource created is found and one deleted is gone. Valid data may be
refused only where the document marks a server-side rule
(``x-hypha-server-check``, see ``tests.fuzz.server_checks``). The scheduler
is on the market with no worker offering, so its jobs stay active and can be
cancelled. Examples are derandomized and bounded, so a run is the same run
every time (about 1,150 requests); ``HYPHA_FUZZ_EXAMPLES=N`` runs N random
examples per operation (and N chains) instead.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from hypha.scheduler.openapi import openapi_document
from hypha.worker.bridge_openapi import OPENAPI
from tests.fuzz.cluster import FuzzBridge, FuzzCluster
from tests.fuzz.server_checks import positive_data_acceptance_but_server_checks

DOCUMENT = openapi_document()
schema = schemathesis.openapi.from_dict(DOCUMENT)
#: Every check schemathesis has, its positive-data check excusing only what the document marks.
ALL_CHECKS: dict[str, Any] = {
    "excluded_checks": [schemathesis.checks.positive_data_acceptance],
    "additional_checks": [positive_data_acceptance_but_server_checks(DOCUMENT)],
}


@schemathesis.serializer("application/toml")
def _toml_body(ctx: object, value: object) -> bytes:
    """A job file is sent as its text (the document types it as a string)."""
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else str(value).encode()


RANDOM_EXAMPLES = os.environ.get("HYPHA_FUZZ_EXAMPLES")
FUZZ = settings(
    max_examples=int(RANDOM_EXAMPLES or "15"),
    deadline=None,
    derandomize=RANDOM_EXAMPLES is None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _transport(cluster: FuzzCluster) -> dict[str, Any]:
    paths = cluster.pki.paths("client")
    return {
        "base_url": cluster.rest_url,
        "cert": (str(paths.cert), str(paths.key)),
        "verify": str(paths.trust),
        "timeout": 20,
    }


@pytest.mark.timeout(120)
@schema.parametrize()
@FUZZ
def test_rest_api_answers_every_generated_request_as_documented(
    case: schemathesis.Case, market_cluster: FuzzCluster
) -> None:
    case.call_and_validate(**_transport(market_cluster), **ALL_CHECKS)


@pytest.mark.timeout(120)
def test_rest_api_holds_up_through_chains_of_calls(market_cluster: FuzzCluster) -> None:
    # Submit, read, cancel, scale, list: in sequences, each call fed ids from earlier answers.
    transport = _transport(market_cluster)

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return transport

        def validate_response(
            self, response: schemathesis.Response, case: schemathesis.Case, *args: Any, **kwargs: Any
        ) -> None:
            case.validate_response(response, transport_kwargs=kwargs, recorder=self.recorder, **ALL_CHECKS)

    Workflow.run(settings=settings(FUZZ, max_examples=int(RANDOM_EXAMPLES or "20"), stateful_step_count=8))


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
