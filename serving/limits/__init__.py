"""What bounds a call inside the server: the gRPC gate (authentication, admission, body timeout, answers' budget),
its bounds, and memory given back after bursts. Per-address limits are the front proxy's (deploy/proxy/)."""
