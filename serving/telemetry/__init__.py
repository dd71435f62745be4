"""What an operator sees of the server: traces (tracing.py: OpenTelemetry, from the OTEL_* variables), one record per
call with its request id and access line (calls.py), and the log lines' format (logs.py). Protocol-neutral: the gRPC
gate and the HTTP server call the same functions. Imports nothing of serving but its errors."""
