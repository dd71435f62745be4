"""Property-based fuzzing of the live server through both protocols.

A real server (`python -m serving.server`, a subprocess on 127.0.0.1) gets generated requests: random unicode
(NUL, RTL marks, emoji sequences, combining marks, any code point), lone surrogates where the wire can carry them
(raw protobuf bytes for sentiment.v1: a protobuf string must be UTF-8, so these are parse errors; raw elements of
a KServe BYTES tensor), 100k-character texts, random batch sizes, random KServe tensor shapes, datatypes and data
placements, random deadlines, several requests at once (so that they share batches). Properties:
  - the status code is the one the contract gives for that request (OK, INVALID_ARGUMENT, NOT_FOUND,
    RESOURCE_EXHAUSTED for a message over the size limit; DEADLINE_EXCEEDED only under a short deadline):
    in particular never INTERNAL or UNKNOWN;
  - every OK answer equals the in-process predictor's (serving.model.predictor) for the same texts;
  - the server never dies: after every example the process is alive and health says SERVING, and its log holds
    no internal error.
Hypothesis settings profiles: "fuzz-ci" (the default suite, a few hundred examples in all) and "fuzz-slow"
(>= 1,000 examples per protocol, `pytest -m slow tests/test_reliability_fuzz.py`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from serving_fixtures import ServerProcess, reviews

from serving.gen.inference import grpc_service_pb2 as kpb
from serving.gen.inference import grpc_service_pb2_grpc as kpb_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.predictor import Prediction, Predictor

MAX_TEXTS = 16
MAX_CHARS = 120_000  # above the 100k-character texts, so that those are computed (and 120,001 refused)
MAX_MESSAGE = 4 * 1024 * 1024  # the server's default max_message_bytes
MESSAGE_SLACK = 64  # bytes around the size limit where either answer is right (gRPC framing)
SHORT_DEADLINE = 2.0  # seconds: under this, DEADLINE_EXCEEDED is a right answer to any request
HANG = 60.0  # seconds without an answer to a request without deadline: the server hangs
ATOL = 1e-5  # served vs in-process probabilities (a row batched with others vs alone: ~1e-6)
OUTPUTS = ("probabilities", "label", "token_count", "truncated")

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.register_profile("fuzz-ci", max_examples=150, derandomize=True, **_COMMON)  # x3 tests: 450 examples
settings.register_profile("fuzz-slow", max_examples=1000, **_COMMON)  # x3 tests: 3,000 examples
CI, SLOW = settings.get_profile("fuzz-ci"), settings.get_profile("fuzz-slow")


def fuzz_tests(check: Callable[..., None], **strategies: st.SearchStrategy) -> tuple[Callable, Callable]:
    """`check(server, reference, **drawn)` as the two tests of one property: under "fuzz-ci" in the default suite,
    and under "fuzz-slow", marked slow (each its own @given: a settings profile belongs to one wrapped test)."""
    return CI(given(**strategies)(check)), pytest.mark.slow(SLOW(given(**strategies)(check)))


_REVIEWS: list[str] = []  # review-length real texts, filled by the `server` fixture from data_dir
_PREDICTOR: list[Predictor] = []  # the reference predictor, set by its fixture: its tokenizer is part of the oracle


def _review(i: int) -> str:
    return _REVIEWS[i % len(_REVIEWS)]


# ------------------------------------------------------------------------------------- strategies

SPECIAL = ["\x00", "\u200f", "\u200e", "\u202e", "\u2066", "\u05e9\u05dc\u05d5\u05dd", "\u0645\u0631\u062d\u0628\u0627",
           "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\U0001f1eb\U0001f1f7", "\ufeff",
           "\u0301", "e\u0301", "\u200b", "\ufffd", "\U0010ffff", "\x7f", "\x1f", "\u2028", " ", "\n", "\t",
           "Très bien !", "nul", "\\x00", "'; DROP TABLE --"]
WHITESPACE = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2028\u2029\u3000"

char = st.characters(codec="utf-8")  # any code point UTF-8 can encode (plain characters() yields surrogates too)
unicode_text = st.lists(st.one_of(char, st.sampled_from(SPECIAL)), max_size=40).map("".join)
nonempty_unicode = st.lists(st.one_of(char, st.sampled_from(SPECIAL)), min_size=1, max_size=40).map("".join)
blank_text = st.text(alphabet=WHITESPACE, max_size=6)
long_text = st.builds(lambda unit, n: (unit * (n // len(unit) + 1))[:n],
                      st.one_of(st.sampled_from(SPECIAL[5:10] + ["a", "mot "]), nonempty_unicode),
                      st.sampled_from([100_000, MAX_CHARS, MAX_CHARS + 1, 30_000]))
text = st.one_of(st.integers(0, 10_000).map(_review), unicode_text, blank_text, long_text)
valid_text = st.one_of(st.integers(0, 10_000).map(_review), nonempty_unicode.filter(str.strip),
                       long_text.filter(lambda t: len(t) <= MAX_CHARS and t.strip()))
texts = st.one_of(st.lists(text, min_size=1, max_size=4), st.lists(text, max_size=MAX_TEXTS + 2),
                  st.lists(long_text, min_size=8, max_size=MAX_TEXTS))  # the last: messages near the size limit
# Lone surrogates and other unpaired halves: only raw bytes can carry them ("surrogatepass" gives CESU bytes).
surrogate_text = st.lists(st.one_of(char, st.characters(categories=["Cs"])), min_size=1,
                          max_size=12).map("".join)
deadline = st.one_of(st.none(), st.floats(0.0005, 0.05), st.floats(0.05, 1.0), st.just(30.0))


# ------------------------------------------------------------------------------------- the server and the oracle


@pytest.fixture(scope="module")
def server(tiny_bundle: Path, data_dir: Path):
    _REVIEWS[:] = reviews(data_dir, 400)
    proc = ServerProcess(tiny_bundle, "--device", "cpu", "--intra-op-threads", "1", "--max-texts", str(MAX_TEXTS),
                         "--max-chars", str(MAX_CHARS), "--max-message-bytes", str(MAX_MESSAGE))
    try:
        port = proc.wait_listening()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            yield proc, channel
        assert proc.proc.poll() is None, f"server died:\n{proc.log}"
        assert "internal error" not in proc.log and "Traceback" not in proc.log, proc.log[-5000:]
    finally:
        proc.close()


@pytest.fixture(scope="module")
def reference(predictor: Predictor) -> Predictor:
    """conftest's predictor, also kept in _PREDICTOR: its tokenizer is part of the oracle."""
    _PREDICTOR[:] = [predictor]
    return predictor


def texts_status(items: list[str]) -> str:
    """What the contract answers for these texts (limits of the fuzz server)."""
    if not items or len(items) > MAX_TEXTS:
        return "INVALID_ARGUMENT"
    if any(not t.strip() or len(t) > MAX_CHARS for t in items):
        return "INVALID_ARGUMENT"
    if any(not any(c.isalnum() for c in t) for t in items):  # no letter or digit: NUL, emoji, punctuation alone
        return "INVALID_ARGUMENT"
    if any(e.token_count <= 2 for e in _PREDICTOR[0].encode(items)):  # no pieces (U+200B, a BOM alone...)
        return "INVALID_ARGUMENT"
    return "OK"


def size_status(size: int) -> str | None:
    if size > MAX_MESSAGE + MESSAGE_SLACK:
        return "RESOURCE_EXHAUSTED"
    if size > MAX_MESSAGE - MESSAGE_SLACK:
        return "EITHER"
    return None


def same_predictions(got: list[tuple[str, np.ndarray, int, bool]], want: list[Prediction]) -> None:
    """(label, probabilities, token_count, truncated) per text equal the predictor's; a label may differ only
    where the two most probable classes are within ATOL (a tie)."""
    assert len(got) == len(want)
    for (label, probs, count, truncated), ref in zip(got, want, strict=True):
        np.testing.assert_allclose(probs, ref.probabilities, rtol=0, atol=ATOL)
        assert (count, truncated) == (ref.token_count, ref.truncated)
        top = np.sort(ref.probabilities)[-2:]
        assert label == ref.label or top[1] - top[0] <= 2 * ATOL, (label, ref.label, ref.probabilities)


def check_outcome(future: grpc.Future, expected: str, timeout: float | None,
                  on_ok: Callable[[object], None]) -> None:
    try:
        response = future.result(timeout=HANG)
        code = "OK"
    except FutureTimeout:
        future.cancel()
        raise AssertionError(f"no answer in {HANG} s (expected {expected})") from None
    except grpc.RpcError as e:
        code, response = e.code().name, e.details()
    if currently_in_test_context():
        event(f"expected {expected}, got {code}")  # `pytest --hypothesis-show-statistics` shows the mix
    assert code not in ("INTERNAL", "UNKNOWN"), response
    if code == "DEADLINE_EXCEEDED" and timeout is not None and timeout < SHORT_DEADLINE:
        return
    if expected == "EITHER":
        assert code in ("OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"), (code, response)
        return
    assert code == expected, (code, response)
    if code == "OK":
        on_ok(response)


def assert_alive(server: tuple[ServerProcess, grpc.Channel]) -> None:
    proc, channel = server
    assert proc.proc.poll() is None, f"server died:\n{proc.log[-5000:]}"
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------------------------- sentiment.v1


def check_classify(server: tuple[ServerProcess, grpc.Channel], reference: Predictor,
                   requests: list[tuple[list[str], float | None]]) -> None:
    """Several Classify requests at once (they may share batches); each answered as the contract says."""
    stub = pb_grpc.SentimentServiceStub(server[1])
    sent = []
    for items, timeout in requests:
        request = pb.ClassifyRequest(texts=items)
        expected = size_status(request.ByteSize()) or texts_status(items)
        sent.append((items, timeout, expected, stub.Classify.future(request, timeout=timeout)))
    for items, timeout, expected, future in sent:
        def on_ok(response: pb.ClassifyResponse, items: list[str] = items) -> None:
            got = [(r.label, np.array(r.probabilities), r.token_count, r.truncated) for r in response.results]
            same_predictions(got, reference.predict(items))

        check_outcome(future, expected, timeout, on_ok)
    assert_alive(server)


classify_requests = st.lists(st.tuples(texts, deadline), min_size=1, max_size=4)


test_classify_fuzz, test_classify_fuzz_slow = fuzz_tests(check_classify, requests=classify_requests)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def check_raw_classify(server: tuple[ServerProcess, grpc.Channel], reference: Predictor, payload: bytes,
                       timeout: float | None) -> None:
    """A ClassifyRequest built byte by byte: texts may hold lone surrogates (invalid UTF-8), or the payload
    may be no protobuf at all. The oracle parses it as the server must."""
    try:
        parsed = pb.ClassifyRequest.FromString(payload)
        expected = texts_status(list(parsed.texts))
    except DecodeError:
        parsed, expected = None, "INVALID_ARGUMENT"
    call = server[1].unary_unary("/sentiment.v1.SentimentService/Classify",
                                 response_deserializer=pb.ClassifyResponse.FromString)

    def on_ok(response: pb.ClassifyResponse) -> None:
        got = [(r.label, np.array(r.probabilities), r.token_count, r.truncated) for r in response.results]
        same_predictions(got, reference.predict(list(parsed.texts)))

    check_outcome(call.future(payload, timeout=timeout), expected, timeout, on_ok)
    assert_alive(server)


raw_texts_payload = st.lists(st.one_of(text, surrogate_text), max_size=6).map(
    lambda items: b"".join(b"\x0a" + _varint(len(b)) + b for b in (t.encode("utf-8", "surrogatepass") for t in items)))
raw_payload = st.one_of(raw_texts_payload, raw_texts_payload, st.binary(max_size=64))


test_classify_raw_wire_fuzz, test_classify_raw_wire_fuzz_slow = fuzz_tests(check_raw_classify, payload=raw_payload,
                                                                            timeout=deadline)


# ------------------------------------------------------------------------------------- KServe v2 ModelInfer


@st.composite
def infer_requests(draw: st.DrawFn) -> kpb.ModelInferRequest:
    """A ModelInferRequest: well-formed about half the time (its texts may still break a limit), otherwise with
    random faults in the model name, version, inputs, datatype, shape, data placement, framing or outputs."""
    faulty = draw(st.booleans())

    def pick(valid: list, invalid: list) -> object:
        return draw(st.sampled_from(valid + invalid if faulty else valid))

    req = kpb.ModelInferRequest(model_name=pick(["sentiment"] * 4, ["", "Sentiment", "resnet", "sentiment\x00"]),
                                model_version=pick(["", "", "1"], ["2", "latest"]),
                                id=draw(st.one_of(st.just(""), unicode_text)))
    if faulty:
        elements = draw(st.lists(st.one_of(text.map(str.encode), st.binary(max_size=24), surrogate_text.map(
            lambda t: t.encode("utf-8", "surrogatepass"))), max_size=MAX_TEXTS + 2))
    else:
        elements = [t.encode() for t in draw(st.one_of(st.lists(valid_text, min_size=1, max_size=4),
                                                       st.lists(valid_text, min_size=1, max_size=MAX_TEXTS),
                                                       st.lists(text, max_size=MAX_TEXTS + 2)))]
    n = len(elements)
    for k in range(pick([1], [1, 1, 1, 0, 2])):
        tensor = req.inputs.add(
            name=pick(["TEXT"], ["TEXT", "TEXT", "text", "INPUT0", ""]) if k == 0 else "TEXT",
            datatype=pick(["BYTES"], ["BYTES", "BYTES", "FP32", "INT32", "INT64", "BOOL", "UINT8", "FP16", "BF16",
                                      "STRING", "bytes", ""]),
        )
        shape = [n] if draw(st.booleans()) else [n, 1]
        if faulty and draw(st.booleans()):
            shape = draw(st.lists(st.one_of(st.integers(-3, MAX_TEXTS + 3), st.just(2**63 - 1), st.just(-(2**63))),
                                  max_size=4))
        tensor.shape.extend(shape)
    placement = pick(["raw", "raw", "contents"], ["both", "raw twice", "raw cut", "raw extra", "fp32", "int"])
    framed = b"".join(struct.pack("<I", len(b)) + b for b in elements)
    tensor = req.inputs[0] if req.inputs else None
    if placement in ("raw", "both", "fp32", "int"):
        req.raw_input_contents.append(framed)
    elif placement == "raw twice":
        req.raw_input_contents.extend([framed, framed])
    elif placement == "raw cut":
        req.raw_input_contents.append(framed[: draw(st.integers(0, max(0, len(framed) - 1)))])
    elif placement == "raw extra":
        req.raw_input_contents.append(framed + draw(st.binary(min_size=1, max_size=8)))
    if tensor is not None:
        if placement in ("contents", "both"):
            tensor.contents.bytes_contents.extend(elements)
            if placement == "both":
                tensor.contents.SetInParent()
        elif placement == "fp32":
            tensor.contents.fp32_contents.extend([0.5] * draw(st.integers(0, 3)))
            tensor.contents.SetInParent()
        elif placement == "int":
            del req.raw_input_contents[:]
            tensor.contents.int_contents.extend([1] * draw(st.integers(1, 3)))
    for name in draw(st.lists(st.sampled_from(list(OUTPUTS) + (["logits", "LABEL"] if faulty else [])),
                              max_size=5)):
        out = req.outputs.add(name=name)
        if faulty and draw(st.integers(0, 4)) == 0:
            out.parameters["classification"].int64_param = 2
    return req


def kserve_status(req: kpb.ModelInferRequest) -> tuple[str, list[str] | None]:
    """The contract's answer to a ModelInfer request, and its texts when it is valid (serving/protocols/kserve_v2.py's
    docstring: input TEXT, BYTES, shape [n] or [n, 1], data once, raw framed or in bytes_contents, UTF-8)."""
    size = size_status(req.ByteSize())
    if size:
        return size, None
    if req.model_name != "sentiment" or req.model_version not in ("", "1"):
        return "NOT_FOUND", None
    bad = "INVALID_ARGUMENT", None
    if len(req.inputs) != 1 or req.inputs[0].name != "TEXT" or req.inputs[0].datatype != "BYTES":
        return bad
    tensor, shape = req.inputs[0], list(req.inputs[0].shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 0 or shape[0] > MAX_TEXTS:
        return bad
    n = shape[0]
    if req.raw_input_contents:
        if len(req.raw_input_contents) != 1 or tensor.HasField("contents"):
            return bad
        raw, items, offset = req.raw_input_contents[0], [], 0
        for _ in range(n):
            if offset + 4 > len(raw):
                return bad
            (k,) = struct.unpack_from("<I", raw, offset)
            if offset + 4 + k > len(raw):
                return bad
            items.append(raw[offset + 4: offset + 4 + k])
            offset += 4 + k
        if offset != len(raw):
            return bad
    else:
        if [f.name for f, _ in tensor.contents.ListFields() if f.name != "bytes_contents"]:
            return bad
        items = list(tensor.contents.bytes_contents)
        if len(items) != n:
            return bad
    try:
        decoded = [b.decode("utf-8") for b in items]
    except UnicodeDecodeError:
        return bad
    if any(o.name not in OUTPUTS or "classification" in o.parameters for o in req.outputs):
        return bad
    if len({o.name for o in req.outputs}) != len(req.outputs):  # an output named twice
        return bad
    status = texts_status(decoded)
    return status, decoded if status == "OK" else None


def check_infer(server: tuple[ServerProcess, grpc.Channel], reference: Predictor,
                requests: list[tuple[kpb.ModelInferRequest, float | None]]) -> None:
    stub = kpb_grpc.GRPCInferenceServiceStub(server[1])
    sent = [(req, timeout, *kserve_status(req), stub.ModelInfer.future(req, timeout=timeout))
            for req, timeout in requests]
    for req, timeout, expected, items, future in sent:
        def on_ok(response: kpb.ModelInferResponse, req: kpb.ModelInferRequest = req,
                  items: list[str] | None = items) -> None:
            ref = reference.predict(items)
            n = len(items)
            wanted = [o.name for o in req.outputs] or list(OUTPUTS)
            assert (response.model_name, response.model_version, response.id) == ("sentiment", "1", req.id)
            assert [o.name for o in response.outputs] == wanted
            out = {}
            for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
                if tensor.name == "probabilities":
                    assert (tensor.datatype, list(tensor.shape)) == ("FP32", [n, len(reference.label_names)])
                    out[tensor.name] = np.frombuffer(raw, dtype="<f4").reshape(n, -1)
                elif tensor.name == "label":
                    assert (tensor.datatype, list(tensor.shape)) == ("BYTES", [n])
                    labels, offset = [], 0
                    for _ in range(n):
                        (k,) = struct.unpack_from("<I", raw, offset)
                        labels.append(raw[offset + 4: offset + 4 + k].decode())
                        offset += 4 + k
                    assert offset == len(raw)
                    out[tensor.name] = labels
                elif tensor.name == "token_count":
                    assert (tensor.datatype, list(tensor.shape)) == ("INT32", [n])
                    out[tensor.name] = np.frombuffer(raw, dtype="<i4").tolist()
                else:
                    assert (tensor.datatype, list(tensor.shape)) == ("BOOL", [n])
                    out[tensor.name] = np.frombuffer(raw, dtype=np.bool_).tolist()
            if "probabilities" in out:
                np.testing.assert_allclose(out["probabilities"], np.stack([r.probabilities for r in ref]), rtol=0,
                                           atol=ATOL)
            if "label" in out:
                for label, r in zip(out["label"], ref, strict=True):
                    top = np.sort(r.probabilities)[-2:]
                    assert label == r.label or top[1] - top[0] <= 2 * ATOL
            if "token_count" in out:
                assert out["token_count"] == [r.token_count for r in ref]
            if "truncated" in out:
                assert out["truncated"] == [r.truncated for r in ref]

        check_outcome(future, expected, timeout, on_ok)
    assert_alive(server)


infer_batch = st.lists(st.tuples(infer_requests(), deadline), min_size=1, max_size=4)


test_kserve_infer_fuzz, test_kserve_infer_fuzz_slow = fuzz_tests(check_infer, requests=infer_batch)


# ------------------------------------------------------------------------------------- the oracle itself


def test_the_oracle_agrees_with_hand_picked_cases(server, reference) -> None:
    """The properties are only as good as the oracle: pin it on cases whose answer is known, through the
    server (so a wrong oracle or a wrong server both fail here)."""
    ok = [("Un très bon livre.", "OK"), ("\x00", "INVALID_ARGUMENT"), ("\U0001f44d" * 100_000, "INVALID_ARGUMENT"),
          ("\U0001f44d" * 99 + "a", "OK"), ("5/5", "OK"), ("!?!", "INVALID_ARGUMENT"), ("é" * MAX_CHARS, "OK"),
          ("a" * (MAX_CHARS + 1), "INVALID_ARGUMENT"), (" \u3000\x1f", "INVALID_ARGUMENT"), ("", "INVALID_ARGUMENT"),
          ("\u200b", "INVALID_ARGUMENT"), ("\ufeff", "INVALID_ARGUMENT")]
    for t, status in ok:
        assert texts_status([t]) == status
    assert texts_status([]) == texts_status(["a"] * (MAX_TEXTS + 1)) == "INVALID_ARGUMENT"
    assert size_status(pb.ClassifyRequest(texts=["\U0001f44d" * 100_000] * 11).ByteSize()) == "RESOURCE_EXHAUSTED"
    check_classify(server, reference, [([t], 30.0) for t, _ in ok])
    check_classify(server, reference, [(["\U0001f44d" * 100_000] * 11, 30.0)])
    lone = b"\x0a\x03" + "\ud800".encode("utf-8", "surrogatepass")
    with pytest.raises(DecodeError):
        pb.ClassifyRequest.FromString(lone)
    check_raw_classify(server, reference, lone, 30.0)
    req = kpb.ModelInferRequest(model_name="sentiment")
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[2, 1])
    req.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in (b"ok", "\udfff".encode(
        "utf-8", "surrogatepass"))))
    assert kserve_status(req)[0] == "INVALID_ARGUMENT"
    req.raw_input_contents[0] = b"".join(struct.pack("<I", len(b)) + b for b in (b"ok", "שלום 👍".encode()))
    assert kserve_status(req) == ("OK", ["ok", "שלום 👍"])
    check_infer(server, reference, [(req, 30.0)])
