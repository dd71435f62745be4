"""The OpenTelemetry SDK's pieces that the span export process builds (serving/telemetry/export.py) and that the
server checks before it starts one (serving/telemetry/tracing.py): the OTLP exporter for the protocol the OTEL_*
variables ask for, and the resource hashed once. Imported by both; imports neither."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serving.errors import ServerConfigError

PROTOCOLS = ("grpc", "http/protobuf")


def protocol(environ: Mapping[str, str]) -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else the specification's default;
    ServerConfigError naming the variable when it is neither of PROTOCOLS."""
    variable = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") \
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    chosen = (environ.get(variable) or "http/protobuf").strip()
    if chosen not in PROTOCOLS:
        raise ServerConfigError(f"{variable}={chosen!r}: the trace exporter speaks {' or '.join(PROTOCOLS)}")
    return chosen


def exporter(environ: Mapping[str, str]) -> Any:
    """The SDK's OTLP span exporter for the protocol asked for; it reads its own OTEL_EXPORTER_OTLP_* variables."""
    if protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    try:
        return OTLPSpanExporter()
    except Exception as e:  # a malformed timeout (ValueError), compression (the exporter's own exception), ...
        raise ServerConfigError(f"OTLP exporter, from the OTEL_EXPORTER_OTLP_* variables: {e}") from None


def hashed_once(resource: Any) -> Any:
    """`resource`, hashed once. The OTLP encoder hashes each span's resource to group the spans of an export, and
    Resource's hash is a JSON dump of its attributes: a quarter of the encoding's time. A resource never changes."""
    from opentelemetry.sdk.resources import Resource

    class HashedOnce(Resource):
        def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
            super().__init__(attributes, schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    return HashedOnce(resource.attributes, resource.schema_url)
