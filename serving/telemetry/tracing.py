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
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from serving.errors import ServerConfigError
from serving.telemetry import otlp
from serving.telemetry.logs import ClientCausedLines

if TYPE_CHECKING:
    from serving.telemetry.export import SpanPipe

log = logging.getLogger(__name__)

# Where OpenTelemetry's propagators warn of a malformed traceparent, tracestate or baggage a client sent: a warning
# per bad list member (up to 180 a baggage header), some of them with the whole header in the line.
PROPAGATION_LOGGERS = ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span",
                       "opentelemetry.baggage.propagation", "opentelemetry.baggage")
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
    """The process' sampler, ids and propagator, and the pipe its spans leave by; made by `configure`.

    Spans are recorded finished, with their start and end times, rather than opened and closed through the SDK's
    Tracer: every span here is timed by the code around it anyway, so none needs the Tracer's per-span machinery (a
    lock per attribute set, the sampler asked again for every child). They leave as plain tuples for the span export
    process (serving/telemetry/export.py), where the SDK's processors and exporters turn them into OTLP: that encoding
    would otherwise take the calls' GIL (docs/BENCHMARKS.md, "Tracing"). The sampler decides once per call; the
    children of a sampled call are sampled, as a parent-based sampler would decide.
    """

    def __init__(self, sampler: Any, pipe: SpanPipe, propagator: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import SpanLimits, sampling
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self.trace, self.RECORD_AND_SAMPLE = trace, sampling.Decision.RECORD_AND_SAMPLE
        self.sampler, self.ids = sampler, RandomIdGenerator()
        self.pipe, self.propagator = pipe, propagator
        self.max_links = SpanLimits().max_links or 128  # OTEL_SPAN_LINK_COUNT_LIMIT
        self.fields = frozenset(propagator.fields)  # the headers it reads: traceparent, tracestate, baggage
        self.internal, self.server = trace.SpanKind.INTERNAL.value, trace.SpanKind.SERVER.value

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

    def record(self, name: str, parent: Any, start_ns: int, end_ns: int, *, kind: int | None = None,
               attributes: Mapping[str, Any] | None = None, links: Sequence[Any] = (),
               status: tuple[int, str | None] | None = None, events: Sequence[tuple[str, dict[str, Any], int]] = (),
               context: Any = None) -> Any:
        """Export a finished span under `parent` (a span context; None: a root); its own context (made unless
        given). kind: a SpanKind's value (INTERNAL unless given); status: (StatusCode's value, description)."""
        if context is None:
            context = self.trace.SpanContext(parent.trace_id, self.ids.generate_span_id(), False, parent.trace_flags,
                                             parent.trace_state)
        state = tuple(context.trace_state.items()) if context.trace_state else None
        self.pipe.put((name, context.trace_id, context.span_id, int(context.trace_flags), state,
                       parent.span_id if parent is not None else 0, parent is not None and parent.is_remote,
                       self.internal if kind is None else kind, start_ns, end_ns, attributes or None,
                       tuple((c.trace_id, c.span_id, int(c.trace_flags), c.is_remote) for c in links[:self.max_links]),
                       status, tuple(events)))
        return context

    def end(self, span: ServerSpan, error: str | None = None) -> None:
        """Export a call's span, ended now; `error`: the description of a failure the server owns."""
        status = (self.trace.StatusCode.ERROR.value, error) if error is not None else None
        self.record(span.name, span.parent, span.start_ns, time.time_ns(), kind=self.server,
                    attributes=span.attributes, status=status, context=span.context)

    def batch(self, served: Sequence[tuple[Any, int]], start_ns: int, end_ns: int, attributes: Mapping[str, Any],
              error: BaseException | None) -> None:
        """One batch's onnxruntime run: a span under the first traced call it served, linked to every one of them
        (links hold span contexts, never the calls), and each call's queue wait up to the run, linked to it.
        served: (span context, time queued in ns) of each traced call, oldest first."""
        status, events = None, ()
        if error is not None:
            status = (self.trace.StatusCode.ERROR.value, type(error).__name__)
            events = (("exception", {"exception.type": type(error).__name__, "exception.message": str(error)},
                       end_ns),)
        run = self.record("onnxruntime run", served[0][0], start_ns, end_ns, attributes=attributes,
                          links=[c for c, _ in served], status=status, events=events)
        for context, queued_ns in served:
            self.record("queue wait", context, queued_ns, start_ns, links=[run])

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued and stop, waiting at most `timeout_s`: a collector that is down (its exporter retries
        for up to OTEL_EXPORTER_OTLP_TIMEOUT) must not hold a draining server past its grace. The export process is
        then stopped: what it still holds is lost."""
        if not self.pipe.close(timeout_s):
            log.warning("spans not exported within %.0f s of stopping (is the collector reachable?): dropped",
                        timeout_s)


# The propagators' warnings are per-call lines: rate-limited and cut like the server's own (docs/RELIABILITY.md).
_header_warnings = ClientCausedLines("a client's trace header: ")
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
            otlp.protocol(environ)
        _sampler_choice(environ)
        _queue(environ)
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

    from serving.telemetry.export import SpanPipe

    _header_warnings.attach(*PROPAGATION_LOGGERS)
    resource = _resource(service_version, worker, environ)
    sampler = _sampler(environ)
    max_queue, batch = _queue(environ)
    pipe = SpanPipe({"resource": dict(resource.attributes), "schema_url": resource.schema_url,
                     "scope": ("serving", service_version), "exporters": exporters}, max_queue, batch)
    _tracing = Tracing(sampler, pipe, get_global_textmap())
    return _tracing


def shutdown() -> None:
    """Flush and stop this process' tracing (at exit, after the server stopped)."""
    global _tracing
    if _tracing is not None:
        _tracing.shutdown()
        _tracing = None


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


def _queue(environ: Mapping[str, str]) -> tuple[int, int]:
    """(spans that may wait in the server, spans that wake its writer) from OTEL_BSP_MAX_QUEUE_SIZE and
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE, the SDK's own defaults otherwise (the export process' processors read them too)."""
    return _int(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048), _int(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    """A positive whole number from variable `name`, else `default` when unset; ServerConfigError naming it."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ServerConfigError(f"{name}={raw!r}: a positive whole number")
    return value
