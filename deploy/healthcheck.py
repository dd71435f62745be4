"""The image's HEALTHCHECK: exit 0 when the server answers grpc.health.v1 Check with SERVING, 1 otherwise.

    python /opt/app/healthcheck.py [HOST:PORT] [--service NAME] [--timeout S]

Runs in the image with the server's own Python and grpcio, so the image needs no probe binary. Kubernetes does
not use it: its native gRPC probes call the same service (deploy/deployment.yaml). Plaintext only, like those.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 2.0) -> str:
    """The status the server at `target` reports for `service` (SERVING, NOT_SERVING, ...), or the name of the gRPC
    error the call got (UNAVAILABLE, DEADLINE_EXCEEDED, ...)."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", nargs="?", default="127.0.0.1:50051", help="server host:port")
    p.add_argument("--service", default="", help="service to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds for the one call")
    args = p.parse_args(argv)
    status = check(args.target, args.service, args.timeout)
    print(f"healthcheck: {args.target}: {status}", file=sys.stdout if status == "SERVING" else sys.stderr)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
