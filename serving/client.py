"""Client library and CLI for sentiment.v1.SentimentService.

    python -m serving.client "Un livre magnifique." "Ennuyeux." [--target 127.0.0.1:50051]
    python -m serving.client --file reviews.txt [--json]      # one text per line; '-' reads stdin
    python -m serving.client --metadata

Every call has a deadline (`timeout`, the whole call including retries). UNAVAILABLE (server starting,
draining, restarting) is retried with exponential backoff and jitter; every other error is raised at once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

T = TypeVar("T")


@dataclass(frozen=True)
class Result:
    """The server's answer for one text."""

    label: str
    label_index: int
    probabilities: list[float]  # in the order of the model's labels (metadata()["labels"])
    token_count: int
    truncated: bool


class SentimentClient:
    """A channel to one server. Thread-safe; reuse it (a channel is expensive to set up)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.05,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        server_name: str | None = None,
    ) -> None:
        """timeout: seconds per call, retries included. retries: extra attempts after UNAVAILABLE, waiting
        backoff * 2^k (x0.5-1.5 jitter). token: bearer token. tls_ca: CA of the server certificate (turns TLS
        on); tls_cert/tls_key: client certificate for mutual TLS. server_name: override the TLS host name."""
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.metadata_headers = [("authorization", f"Bearer {token}")] if token else []
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=Path(tls_ca).read_bytes(),
                private_key=Path(tls_key).read_bytes() if tls_key else None,
                certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
            )
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.SentimentServiceStub(self.channel)

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            try:
                return method(request, timeout=max(left, 0.0), metadata=self.metadata_headers)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
                    raise
                pause = self.backoff * 2**attempt * random.uniform(0.5, 1.5)
                if time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
                attempt += 1

    def classify(self, texts: Sequence[str], timeout: float | None = None) -> list[Result]:
        response = self._call(self.stub.Classify, pb.ClassifyRequest(texts=list(texts)), timeout)
        return [
            Result(r.label, r.label_index, list(r.probabilities), r.token_count, r.truncated)
            for r in response.results
        ]

    def metadata(self, timeout: float | None = None) -> dict[str, Any]:
        m = self._call(self.stub.GetModelMetadata, pb.GetModelMetadataRequest(), timeout)
        return {
            "model_name": m.model_name,
            "labels": list(m.labels),
            "max_tokens": m.max_tokens,
            "bundle_sha256": m.bundle_sha256,
            "execution_provider": m.execution_provider,
            "precision": m.precision,
            "max_texts": m.max_texts,
            "max_chars": m.max_chars,
            "long_text_policy": pb.LongTextPolicy.Name(m.long_text_policy),
        }

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SentimentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunks(items: list[T], size: int) -> Iterable[list[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sentiment-client", description="Classify texts with a sentiment server.")
    p.add_argument("texts", nargs="*", help="texts to classify")
    p.add_argument("--file", help="read texts from this file, one per line ('-' = stdin)")
    p.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request, retries included")
    p.add_argument("--retries", type=int, default=3, help="extra attempts when the server is UNAVAILABLE")
    p.add_argument("--batch", type=int, default=32, help="texts per request")
    p.add_argument("--json", action="store_true", help="one JSON object per text")
    p.add_argument("--metadata", action="store_true", help="print the model's metadata and exit")
    p.add_argument("--token-file", help="bearer token file (also: SENTIMENT_AUTH_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate of the server (turns TLS on)")
    p.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="client private key (mutual TLS)")
    args = p.parse_args(argv)

    texts = list(args.texts)
    if args.file:
        stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
        with stream:
            texts += [line.rstrip("\n") for line in stream if line.strip()]
    if not texts and not args.metadata:
        p.error("give texts as arguments or --file")
    token = os.environ.get("SENTIMENT_AUTH_TOKEN")
    if args.token_file:
        token = Path(args.token_file).read_text(encoding="utf-8").strip()
    client = SentimentClient(args.target, timeout=args.timeout, retries=args.retries, token=token,
                             tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    try:
        if args.metadata:
            print(json.dumps(client.metadata(), indent=2))
            return 0
        labels = client.metadata()["labels"]
        for chunk in _chunks(texts, max(1, args.batch)):
            for text, r in zip(chunk, client.classify(chunk), strict=True):
                if args.json:
                    print(json.dumps({"text": text, **asdict(r)}, ensure_ascii=False))
                else:
                    probs = " ".join(f"{name}={p:.3f}" for name, p in zip(labels, r.probabilities, strict=True))
                    cut = " (truncated)" if r.truncated else ""
                    print(f"{r.label}\t{probs}\t{r.token_count} tokens{cut}\t{text[:70]}")
    except grpc.RpcError as e:
        print(f"sentiment-client: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
