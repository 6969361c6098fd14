"""OpenTelemetry for every gRPC call.

Interceptors are always installed (they cost little with the no-op tracer);
spans leave the process only when an OTLP endpoint is configured, in the node
config or through the standard ``OTEL_*`` environment variables.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)
_configured = False


def setup_tracing(service_name: str, otlp_endpoint: str | None = None, sample_ratio: float = 1.0) -> bool:
    """Install an exporting tracer provider once per process; True if exporting."""
    global _configured
    endpoint = (
        otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    if _configured or not endpoint:
        return _configured
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}),
        sampler=ParentBasedTraceIdRatio(sample_ratio),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    trace.set_tracer_provider(provider)
    _configured = True
    log.info("exporting traces to %s", endpoint)
    return True


def shutdown_tracing() -> None:
    """Flush spans; the last step of every shutdown order."""
    if not _configured:
        return
    from opentelemetry import trace

    provider: Any = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def server_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def client_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())
