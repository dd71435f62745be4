"""Client library and CLI for sentiment.v1.SentimentService.

    python -m serving.client "Un livre magnifique." "Ennuyeux." [--target 127.0.0.1:50051]
    python -m serving.client --file reviews.txt [--json]      # one text per line; '-' reads stdin
    python -m serving.client --metadata

Every call has a deadline (`timeout`, the whole call including retries). UNAVAILABLE (server starting,
draining, restarting) is retried with exponential backoff and jitter; every other error is raised at once, as a
ClientError subclass naming the target and the server's reason (a grpc.RpcError too: `.code()`, `.details()`).
`classify` takes any number of texts: more than the server's max_texts (its metadata, read once) are sent as
several requests, in order. A caller inside an OpenTelemetry span sends it as W3C `traceparent` with every call, so
that the server's spans continue the caller's trace.
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

from contract.extras import missing_extra
from contract.version import version_line

try:
    import grpc

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
except ModuleNotFoundError as e:  # grpcio, protobuf: the command says which extra it needs, an import raises
    if __name__ != "__main__" and Path(sys.argv[0]).stem != "sentiment-client":
        raise
    sys.exit(missing_extra("sentiment-client", "client", e))

T = TypeVar("T")

EXAMPLES = """examples:
  python -m serving.client "Un livre magnifique." "Ennuyeux."
  python -m serving.client --target 10.0.0.5:50051 --file reviews.txt --json > answers.jsonl
  cut -f2 reviews.tsv | python -m serving.client --file -
  python -m serving.client --metadata                 # labels (with their data values), limits, bundle digest
  SENTIMENT_AUTH_TOKEN=... python -m serving.client --tls-ca ca.pem --target host:50051 "Super."

exit status: 0 done, 1 the server could not be reached or refused a request, 2 bad arguments or files
"""


class ClientError(grpc.RpcError):
    """A call failed: `code` (grpc.StatusCode), the `target` tried and the server's `details`. Subclasses name the
    common cases; a grpc.RpcError too, so code written against raw gRPC errors keeps working."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str) -> None:
        self.target, self.status, self.reason = target, code, details
        hint = HINTS.get(code, "")
        super().__init__(f"{target}: {code.name}: {details}{hint}")

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.reason


class Unavailable(ClientError):
    """No server answered at the target (not running, wrong address, TLS mismatch, draining), even after retries."""


class InvalidArgument(ClientError):
    """The server refused the request (an empty or too long text...); the details name the field and the limit."""


class Unauthenticated(ClientError):
    """The server wants a bearer token (token= / --token-file / SENTIMENT_AUTH_TOKEN) and got none or another."""


class ResourceExhausted(ClientError):
    """The server is overloaded (its queue is full) or the request is larger than it accepts."""


class DeadlineExceeded(ClientError):
    """No answer within the call's timeout (retries included)."""


ERRORS: dict[grpc.StatusCode, type[ClientError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable, grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated, grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded}
HINTS = {grpc.StatusCode.UNAVAILABLE: " (is a server running there, and is TLS on for both or neither?)",
         grpc.StatusCode.UNAUTHENTICATED: " (give the server's token: --token-file or SENTIMENT_AUTH_TOKEN)"}


@dataclass(frozen=True)
class Result:
    """The server's answer for one text."""

    label: str
    label_index: int
    probabilities: list[float]  # in the order of the model's labels (metadata()["label_names"])
    token_count: int
    truncated: bool
    model_name: str = ""  # the model that answered
    model_version: str = ""  # its version that answered


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
        model: str = "",
        model_version: str = "",
    ) -> None:
        """timeout: seconds per call, retries included. retries: extra attempts after UNAVAILABLE, waiting
        backoff * 2^k (x0.5-1.5 jitter). token: bearer token. tls_ca: CA of the server certificate (turns TLS
        on); tls_cert/tls_key: client certificate for mutual TLS. server_name: override the TLS host name. model,
        model_version: the model and version to call ("": the server's one model, its newest version)."""
        self.target, self.timeout, self.retries, self.backoff = target, timeout, retries, backoff
        self.model, self.model_version = model, model_version
        self._max_texts: int | None = None  # the server's, read from its metadata when a call needs it
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
                return method(request, timeout=max(left, 0.0), metadata=self.metadata_headers + _trace_context())
            except grpc.RpcError as e:
                pause = self.backoff * 2**attempt * random.uniform(0.5, 1.5)
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries \
                        or time.monotonic() + pause >= deadline:
                    code = e.code() if isinstance(e.code(), grpc.StatusCode) else grpc.StatusCode.UNKNOWN
                    raise ERRORS.get(code, ClientError)(self.target, code, e.details() or "") from None
                time.sleep(pause)
                attempt += 1

    def classify(self, texts: Sequence[str], timeout: float | None = None) -> list[Result]:
        """One Result per text, in order. More texts than the server's max_texts go as several requests, each with
        the whole `timeout`."""
        texts = list(texts)
        if not texts:
            return []
        if len(texts) > 1 and self._max_texts is None:
            self._max_texts = int(self.metadata(timeout)["max_texts"]) or len(texts)
        out: list[Result] = []
        for chunk in _chunks(texts, self._max_texts or len(texts)):
            request = pb.ClassifyRequest(texts=chunk, model_name=self.model, model_version=self.model_version)
            response = self._call(self.stub.Classify, request, timeout)
            out += [Result(r.label, r.label_index, list(r.probabilities), r.token_count, r.truncated,
                           response.model_name, response.model_version) for r in response.results]
        return out

    def metadata(self, timeout: float | None = None) -> dict[str, Any]:
        request = pb.GetModelMetadataRequest(model_name=self.model, model_version=self.model_version)
        m = self._call(self.stub.GetModelMetadata, request, timeout)
        return {
            "model_name": m.model_name,
            "model_version": m.model_version,
            "label_names": list(m.labels),  # the proto's `labels` field
            "label_values": list(m.label_values),
            "max_tokens": m.max_tokens,
            "bundle_sha256": m.bundle_sha256,
            "execution_provider": m.execution_provider,
            "precision": m.precision,
            "max_texts": m.max_texts,
            "max_chars": m.max_chars,
            "long_text_policy": pb.LongTextPolicy.Name(m.long_text_policy),
            "probabilities_calibrated": m.probabilities_calibrated,
            "calibration_temperature": m.calibration_temperature,
            "model_card": m.model_card,
        }

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SentimentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _trace_context() -> list[tuple[str, str]]:
    """The caller's current span as W3C traceparent (and tracestate, baggage), by OpenTelemetry's propagator; none
    without one. A caller with a span has imported OpenTelemetry: any other pays one dictionary look-up."""
    if "opentelemetry.trace" not in sys.modules:
        return []
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def _chunks(items: list[T], size: int) -> Iterable[list[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default in its help (flags and options without one: none shown); examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.client", formatter_class=_Help, epilog=EXAMPLES,
                                description="Classify texts with a sentiment server (sentiment.v1 over gRPC).")
    p.add_argument("texts", nargs="*", help="texts to classify")
    p.add_argument("--file", help="read texts from this file, one per line ('-' = stdin)")
    p.add_argument("--target", default="127.0.0.1:50051", help="server host:port")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request, retries included")
    p.add_argument("--retries", type=int, default=3, help="extra attempts when the server is UNAVAILABLE")
    p.add_argument("--model", default="", help="the model to call, on a server of several (default: its one model)")
    p.add_argument("--model-version", default="", help="the model's version (default: its newest ready one)")
    p.add_argument("--batch", type=int, default=32, help="texts per request (at most the server's max_texts)")
    p.add_argument("--json", action="store_true", help="one JSON object per text")
    p.add_argument("--metadata", action="store_true",
                   help="print the model's metadata and exit (its model card's length; --model-card prints it)")
    p.add_argument("--model-card", action="store_true", help="print the model card (MODEL_CARD.md) and exit")
    p.add_argument("--token-file", help="bearer token file (also: SENTIMENT_AUTH_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate of the server (turns TLS on)")
    p.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="client private key (mutual TLS)")
    p.add_argument("--version", action="version", version=version_line("sentiment-client"))
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        texts = list(args.texts) + (_read_lines(args.file) if args.file else [])
        if not texts and not (args.metadata or args.model_card):
            p.error("give texts as arguments or --file")
        token = os.environ.get("SENTIMENT_AUTH_TOKEN")
        if args.token_file:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
        client = SentimentClient(args.target, timeout=args.timeout, retries=args.retries, token=token,
                                 tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, model=args.model,
                                 model_version=args.model_version)
    except (OSError, UnicodeDecodeError) as e:
        print(f"sentiment-client: error: {_file_error(e)}", file=sys.stderr)
        return 2
    try:
        if args.metadata or args.model_card:
            m = client.metadata()
            card = m.pop("model_card")
            print(card if args.model_card else json.dumps({**m, "model_card_chars": len(card)}, indent=2), end="\n"
                  if args.metadata else "")
            return 0
        labels = client.metadata()["label_names"]
        for chunk in _chunks(texts, max(1, args.batch)):
            for text, r in zip(chunk, client.classify(chunk), strict=True):
                if args.json:
                    print(json.dumps({"text": text, **asdict(r)}, ensure_ascii=False))
                else:
                    probs = " ".join(f"{name}={p:.3f}" for name, p in zip(labels, r.probabilities, strict=True))
                    cut = " (truncated)" if r.truncated else ""
                    print(f"{r.label}\t{probs}\t{r.token_count} tokens{cut}\t{text[:70]}")
    except ClientError as e:
        print(f"sentiment-client: error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def _read_lines(name: str) -> list[str]:
    stream = sys.stdin if name == "-" else open(name, encoding="utf-8")
    with stream:
        return [line.rstrip("\n") for line in stream if line.strip()]


def _file_error(e: OSError | UnicodeDecodeError) -> str:
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start})"
    return f"{e.filename}: {e.strerror}" if e.filename else str(e)


if __name__ == "__main__":
    sys.exit(main())
