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

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from serving.errors import ServerConfigError

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")


class ServerSpan:
    """A call's SERVER span. Its context is fixed at the start (its children, the batch's links and the logs' trace id
    need it); it is recorded once, when it ends, with the attributes gathered meanwhile."""

    __slots__ = ("context", "parent", "name", "start_ns", "attributes", "recording")

    def __init__(self, context: Any, parent: Any, name: str, start_ns: int, attributes: dict[str, Any],
                 recording: bool) -> None:
        self.context, self.parent, self.name, self.start_ns = context, parent, name, start_ns
        self.attributes = attributes
        self.recording = recording  # sampled: it and its children are exported


class Tracing:
    """The process' sampler, ids, resource, span processors and propagator; made by `configure`.

    Spans are recorded as finished `ReadableSpan`s handed to the span processors, with their start and end times,
    rather than opened and closed through the SDK's Tracer: every span here is timed by the code around it anyway,
    so none needs the Tracer's per-span machinery (a lock per attribute set, the sampler asked again for every
    child), which is CPU taken from the calls (docs/BENCHMARKS.md, "Tracing"). The sampler decides once per call;
    the children of a sampled call are sampled, as a parent-based sampler would decide.
    """

    def __init__(self, provider: Any, processors: Sequence[Any], propagator: Any, version: str) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, sampling
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.trace, self.ReadableSpan, self.RECORD_AND_SAMPLE = trace, ReadableSpan, sampling.Decision.RECORD_AND_SAMPLE
        self.provider, self.processors, self.propagator = provider, tuple(processors), propagator
        self.sampler, self.ids, self.resource = provider.sampler, provider.id_generator, provider.resource
        self.scope = InstrumentationScope("serving", version)
        self.max_links = SpanLimits().max_links or 128  # OTEL_SPAN_LINK_COUNT_LIMIT
        self.fields = frozenset(propagator.fields)  # the headers it reads: traceparent, tracestate, baggage
        self.unset = trace.Status(trace.StatusCode.UNSET)

    def start(self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> ServerSpan:
        """A call's server span, the child of the client's span when the headers carry one, sampled as the sampler
        says."""
        t = self.trace
        context = self.propagator.extract(headers) if headers else None
        parent = t.get_current_span(context).get_span_context() if context is not None else t.INVALID_SPAN_CONTEXT
        trace_id = parent.trace_id if parent.is_valid else self.ids.generate_trace_id()
        decision = self.sampler.should_sample(context, trace_id, name, t.SpanKind.SERVER, attributes)
        sampled = decision.decision == self.RECORD_AND_SAMPLE
        flags = t.TraceFlags(t.TraceFlags.SAMPLED if sampled else t.TraceFlags.DEFAULT)
        own = t.SpanContext(trace_id, self.ids.generate_span_id(), False, flags, decision.trace_state)
        return ServerSpan(own, parent if parent.is_valid else None, name, time.time_ns(),
                          {**attributes, **(decision.attributes or {})}, sampled)

    def record(self, name: str, parent: Any, start_ns: int, end_ns: int, *, kind: Any = None,
               attributes: Mapping[str, Any] | None = None, links: Sequence[Any] = (), status: Any = None,
               events: Sequence[Any] = (), context: Any = None) -> Any:
        """Export a finished span under `parent` (a span context); its own context (made unless given)."""
        t = self.trace
        if context is None:
            context = t.SpanContext(parent.trace_id, self.ids.generate_span_id(), False, parent.trace_flags,
                                    parent.trace_state)
        span = self.ReadableSpan(name, context, parent, self.resource, dict(attributes or {}), tuple(events),
                                 [t.Link(c) for c in links[:self.max_links]], kind or t.SpanKind.INTERNAL, None,
                                 status or self.unset, start_ns, end_ns, instrumentation_scope=self.scope)
        for processor in self.processors:
            processor.on_end(span)
        return context

    def end(self, span: ServerSpan, error: str | None = None) -> None:
        """Export a call's span, ended now; `error`: the description of a failure the server owns."""
        t = self.trace
        status = t.Status(t.StatusCode.ERROR, error) if error is not None else None
        self.record(span.name, span.parent, span.start_ns, time.time_ns(), kind=t.SpanKind.SERVER,
                    attributes=span.attributes, status=status, context=span.context)

    def batch(self, served: Sequence[tuple[Any, int]], start_ns: int, end_ns: int, attributes: Mapping[str, Any],
              error: BaseException | None) -> None:
        """One batch's onnxruntime run: a span under the first traced call it served, linked to every one of them
        (links hold span contexts, never the calls), and each call's queue wait up to the run, linked to it.
        served: (span context, time queued in ns) of each traced call, oldest first."""
        t, status, events = self.trace, None, ()
        if error is not None:
            from opentelemetry.sdk.trace import Event

            status = t.Status(t.StatusCode.ERROR, type(error).__name__)
            events = (Event("exception", {"exception.type": type(error).__name__, "exception.message": str(error)},
                            end_ns),)
        run = self.record("onnxruntime run", served[0][0], start_ns, end_ns, attributes=attributes,
                          links=[c for c, _ in served], status=status, events=events)
        for context, queued_ns in served:
            self.record("queue wait", context, queued_ns, start_ns, links=[run])

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued and stop, waiting at most `timeout_s`: a collector that is down (its exporter retries
        for up to OTEL_EXPORTER_OTLP_TIMEOUT) must not hold a draining server past its grace. The export threads are
        daemons: what they still hold is lost when the process exits."""
        stopping = threading.Thread(target=self.provider.shutdown, name="tracing-shutdown", daemon=True)
        stopping.start()
        stopping.join(timeout_s)
        if stopping.is_alive():
            log.warning("spans not exported within %.0f s of stopping (is the collector reachable?): dropped",
                        timeout_s)


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


def configure(service_version: str, worker: int | None = None) -> Tracing | None:
    """Tracing for this process from its environment (see the module docstring; the SDK's exporters read their own
    variables there too); None when off. Once per process: a server process and each worker call it at start."""
    global _tracing
    environ = os.environ
    exporters = check(environ)
    if not exporters:
        _tracing = None
        return None
    from opentelemetry.propagate import get_global_textmap
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # shutdown_on_exit=False: `shutdown` below bounds the wait; the SDK's own exit hook would wait without bound.
    provider = TracerProvider(resource=_resource(service_version, worker, environ), sampler=_sampler(environ),
                              shutdown_on_exit=False)
    processors = [BatchSpanProcessor(_otlp_exporter(environ) if name == "otlp" else ConsoleSpanExporter())
                  for name in exporters]
    for processor in processors:
        provider.add_span_processor(processor)  # shut down (and flushed) with the provider
    _tracing = Tracing(provider, processors, get_global_textmap(), service_version)
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

    class HashedOnce(Resource):
        """The OTLP encoder hashes each span's resource to group the spans of an export, and Resource's hash is a
        JSON dump of its attributes: a quarter of the encoding's time. A resource never changes: hashed once."""

        def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
            super().__init__(attributes, schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    made = Resource.create({**ours, **given})
    return HashedOnce(made.attributes, made.schema_url)
