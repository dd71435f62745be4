"""What an operator sees of the server: traces (tracing.py: OpenTelemetry, from the OTEL_* variables; export.py: the
process that exports them; otlp.py: the SDK's pieces both build), one record per call with its request id and access
line (call_log.py), the log lines' format (logs.py) and the Prometheus metrics (prometheus.py). Protocol-neutral: the
gRPC gate and the HTTP server call the same functions. Imports nothing of serving but its errors."""
