"""OpenTelemetry for every gRPC call.

Interceptors are always installed (they cost little with the no-op tracer);
spans leave the process only when an OTLP endpoint is configured, in the node
config or through the standard ``OTEL_*`` environment variables.

NOTE (response streams): the library's aio server interceptor keeps the
call's span context attached across each ``yield`` of the handler's stream.
When a client goes away mid-stream, gRPC abandons the generator suspended at
a ``yield``; the event loop's async-generator finalizer closes it later in
another task, where the context tokens cannot be reset ("Failed to detach
context" tracebacks at ERROR, in every normal run of the data node). Here
every step of the traced stream, and its closing, runs in the one context
the stream began in (``_OneContextStream``, stepping it as a Task steps a
coroutine), so attach and detach always meet.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Generator
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


#: Traced streams not yet closed. The strong reference matters: a stream abandoned by gRPC
#: is garbage together with the generator gRPC holds, and the loop's finalizer would close
#: both, the traced one in the wrong context; held here, only gRPC's is finalized, and its
#: ``finally`` closes the traced one through ``_OneContextStream.close``.
_LIVE: set[AsyncGenerator[Any, None]] = set()


class _InContext:
    """Awaits ``awaitable`` with every step of it run in ``context`` (as a Task runs its
    coroutine), whichever task awaits it: the same stepping, no extra task or hop."""

    def __init__(self, awaitable: Awaitable[Any], context: contextvars.Context) -> None:
        self._awaitable = awaitable
        self._context = context

    def __await__(self) -> Generator[Any, Any, Any]:
        steps = self._awaitable.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                if error is not None:
                    yielded = self._context.run(steps.throw, error)
                else:
                    yielded = self._context.run(steps.send, value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield yielded
            except GeneratorExit:
                self._context.run(steps.close)
                raise
            except BaseException as err:  # a cancellation thrown in by the awaiting task
                error = err


class _OneContextStream:
    """Drives an async generator so that every step and its ``aclose`` run in one ``Context``.

    Whoever iterates (gRPC's call task) or drops the stream (abandoned at a
    ``yield``), the generator inside only ever runs, and is closed, there.
    """

    def __init__(self, stream: AsyncGenerator[Any, None]) -> None:
        self._stream = stream
        self._context = contextvars.copy_context()
        self._loop = asyncio.get_running_loop()
        self._finished = False
        _LIVE.add(stream)

    def __aiter__(self) -> _OneContextStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await _InContext(self._stream.__anext__(), self._context)
        except BaseException:
            # Exhausted, raised, or a cancellation went through it: it ran its cleanup, there.
            self._finish()
            raise

    def _finish(self) -> None:
        self._finished = True
        _LIVE.discard(self._stream)

    def close(self) -> None:
        """Close the generator in its own context unless it already ran its cleanup."""
        if self._finished:
            return
        self._finished = True
        stream = self._stream
        if self._loop.is_closed():
            _LIVE.discard(stream)
            return
        task = self._loop.create_task(_close(stream, self._context))
        task.add_done_callback(lambda _: _LIVE.discard(stream))


async def _close(stream: AsyncGenerator[Any, None], context: contextvars.Context) -> None:
    await _InContext(stream.aclose(), context)


def server_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc._aio_server import OpenTelemetryAioServerInterceptor
    from opentelemetry.instrumentation.grpc.version import __version__
    from opentelemetry.trace import get_tracer

    class StreamSafeInterceptor(OpenTelemetryAioServerInterceptor):
        """The library's interceptor; response streams run in one context (module NOTE)."""

        def _intercept_aio_server_stream(self, behavior: Any, handler_call_details: Any) -> Any:
            traced = super()._intercept_aio_server_stream(behavior, handler_call_details)

            async def stream(request_or_iterator: Any, context: Any) -> AsyncIterator[Any]:
                # gRPC wants an async generator; this one holds no context of its own, so the
                # loop may finalize it anywhere once gRPC abandons it.
                steps = _OneContextStream(traced(request_or_iterator, context))
                try:
                    async for item in steps:
                        yield item
                finally:
                    steps.close()

            return stream

    # As the library's ``aio_server_interceptor`` makes its tracer.
    tracer = get_tracer(
        "opentelemetry.instrumentation.grpc",
        __version__,
        schema_url="https://opentelemetry.io/schemas/1.11.0",
    )
    return [StreamSafeInterceptor(tracer)]


def client_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())
