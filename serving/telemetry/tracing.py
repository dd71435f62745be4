"""OpenTelemetry traces of one server process, set up from the standard OTEL_* variables alone (no flag of ours).

On when OTEL_TRACES_EXPORTER names `otlp` (or `console`) and OTEL_SDK_DISABLED is not true; off otherwise, the
specification's default exporter included: tracing is what an operator turns on. Off, no OpenTelemetry module is even
imported and every hook in the request path is one test of `None`.
  - protocol: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL: `grpc` or `http/protobuf` (the
    specification's default); endpoint, headers, timeout, compression and certificates: the exporters read their own
    OTEL_EXPORTER_OTLP_* variables (endpoint default: localhost, port 4317 for gRPC, 4318 for HTTP);
  - sampling: OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on: a client's sampled
    traceparent is followed; `traceidratio` decides here alone);
  - propagation: OTEL_PROPAGATORS (default W3C tracecontext and baggage);
  - batching of the export: OTEL_BSP_* (a bounded queue: spans past it are dropped, never waited for);
  - resource: service.name `sentiment-server` unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one; the
    process id, host and, under --workers, the worker's index say which process exported a span.
A bad value of any of these is a ServerConfigError naming the variable (the server exits 2 before serving).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from serving.errors import ServerConfigError

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")


class Tracing:
    """The process' tracer provider, its tracer and its propagator; made by `configure`."""

    def __init__(self, provider: Any, propagator: Any) -> None:
        from opentelemetry import trace

        self.provider = provider
        self.tracer = provider.get_tracer("serving")
        self.propagator = propagator
        self.fields = frozenset(propagator.fields)  # the headers it reads: traceparent, tracestate, baggage
        self.trace = trace

    def start(self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> Any:
        """A server span, the child of the caller's span when the headers carry one."""
        parent = self.propagator.extract(headers) if headers else None
        return self.tracer.start_span(name, context=parent, kind=self.trace.SpanKind.SERVER, attributes=attributes)

    def parent(self, span_or_context: Any) -> Any:
        """The context that makes a span's children (from the span itself or from its span context alone)."""
        if isinstance(span_or_context, self.trace.SpanContext):
            span_or_context = self.trace.NonRecordingSpan(span_or_context)
        return self.trace.set_span_in_context(span_or_context)

    def child(self, parent: Any, name: str, start_ns: int, end_ns: int | None = None,
              attributes: Mapping[str, Any] | None = None, links: Sequence[Any] = ()) -> Any:
        """A span under `parent` (a context from `parent()`) from `start_ns`; ended at `end_ns` when given."""
        links = [self.trace.Link(c) for c in links]
        span = self.tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes, links=links)
        if end_ns is not None:
            span.end(end_ns)
        return span

    def batch(self, served: Sequence[tuple[Any, int]], start_ns: int, end_ns: int, attributes: Mapping[str, Any],
              error: BaseException | None) -> None:
        """One batch's onnxruntime run: a span under the first traced call it served, linked to every one of them
        (links hold span contexts, never the calls), and each call's queue wait up to the run, linked to it.
        served: (span context, time queued in ns) of each traced call, oldest first."""
        run = self.child(self.parent(served[0][0]), "onnxruntime run", start_ns, attributes=attributes,
                         links=[c for c, _ in served])
        if error is not None:
            run.record_exception(error)
            run.set_status(self.trace.Status(self.trace.StatusCode.ERROR, type(error).__name__))
        run.end(end_ns)
        for context, queued_ns in served:
            self.child(self.parent(context), "queue wait", queued_ns, start_ns, links=[run.get_span_context()])

    def error(self, span: Any, description: str) -> None:
        span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, description))

    def shutdown(self) -> None:
        """Export what is queued (bounded by OTEL_BSP_EXPORT_TIMEOUT) and stop."""
        self.provider.shutdown()


_tracing: Tracing | None = None


def active() -> Tracing | None:
    """The process' tracing, None when off."""
    return _tracing


def check(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters the variables ask for ([] = tracing off); ServerConfigError naming a variable whose value is not
    understood. Imports nothing: a --workers parent checks here what its workers will configure."""
    exporters = [e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "none").lower().split(",") if e.strip()]
    unknown = sorted(set(exporters) - {"otlp", "console", "none"})
    if unknown:
        raise ServerConfigError(f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: {', '.join(unknown)} "
                                "is not available here; use otlp, console or none")
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    exporters = [e for e in dict.fromkeys(exporters) if e != "none"]
    if exporters:
        if "otlp" in exporters:
            _protocol(environ)
        _sampler_choice(environ)
    return exporters


def configure(service_version: str, worker: int | None = None, environ: Mapping[str, str] = os.environ
              ) -> Tracing | None:
    """Tracing for this process from `environ` (see the module docstring); None when off. Once per process: a
    server process and each worker call it at start."""
    global _tracing
    exporters = check(environ)
    if not exporters:
        _tracing = None
        return None
    from opentelemetry.propagate import get_global_textmap
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=_resource(service_version, worker, environ), sampler=_sampler(environ))
    for name in exporters:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(environ)))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    _tracing = Tracing(provider, get_global_textmap())
    return _tracing


def shutdown() -> None:
    """Flush and stop this process' tracing (at exit, after the server stopped)."""
    global _tracing
    if _tracing is not None:
        _tracing.shutdown()
        _tracing = None


def _protocol(environ: Mapping[str, str]) -> str:
    variable = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") \
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = (environ.get(variable) or "http/protobuf").strip()
    if protocol not in PROTOCOLS:
        raise ServerConfigError(f"{variable}={protocol!r}: the trace exporter speaks {' or '.join(PROTOCOLS)}")
    return protocol


def _otlp_exporter(environ: Mapping[str, str]) -> Any:
    if _protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    try:
        return OTLPSpanExporter()
    except ValueError as e:  # a malformed endpoint, header or timeout
        raise ServerConfigError(f"OTLP exporter: {e}") from None


def _sampler_choice(environ: Mapping[str, str]) -> tuple[str, float]:
    """(sampler name, ratio) from OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG."""
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if name not in SAMPLERS:
        raise ServerConfigError(f"OTEL_TRACES_SAMPLER={name!r}: one of {', '.join(SAMPLERS)}")
    ratio = 1.0
    if name.endswith("traceidratio"):
        arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise ServerConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: a ratio in [0, 1] for {name}")
    return name, ratio


def _sampler(environ: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.trace import sampling

    name, ratio = _sampler_choice(environ)
    root = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF}.get(
        name.removeprefix("parentbased_")) or sampling.TraceIdRatioBased(ratio)
    return sampling.ParentBased(root) if name.startswith("parentbased_") else root


def _resource(service_version: str, worker: int | None, environ: Mapping[str, str]) -> Any:
    """Ours, under what OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES say (theirs win)."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    ours: dict[str, Any] = {"service.name": "sentiment-server", "service.version": service_version,
                            "service.instance.id": f"{socket.gethostname()}/{os.getpid()}",
                            "host.name": socket.gethostname(), "process.pid": os.getpid()}
    if worker is not None:
        ours["sentiment.worker"] = worker
    given = OTELResourceDetector().detect().attributes
    if environ.get("OTEL_SERVICE_NAME"):
        given = {**given, "service.name": environ["OTEL_SERVICE_NAME"]}
    return Resource.create({**ours, **given})
