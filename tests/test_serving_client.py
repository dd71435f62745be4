"""The client library and CLI against a real server on 127.0.0.1: more texts than the server's max_texts are split,
errors are the client's own types naming the target, the CLI reports bad files and unreachable servers in one line,
and both --help texts show defaults and examples."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from procs import REPO, env, free_port
from serving_fixtures import reviews, running_server

from serving.client import ClientError, InvalidArgument, SentimentClient, Unavailable
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc


def client_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving.client", *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=120)


def test_more_texts_than_max_texts_are_split_in_order(tiny_bundle: Path, predictor, data_dir: Path) -> None:
    texts = reviews(data_dir, 11)
    with running_server(tiny_bundle, device="cpu", max_texts=4, max_queue=16) as s:
        target = f"127.0.0.1:{s.port}"
        with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as raw:  # one request: refused
            pb_grpc.SentimentServiceStub(ch).Classify(pb.ClassifyRequest(texts=texts), timeout=10)
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with SentimentClient(target) as client:
            served = client.classify(texts)
            assert client.classify([]) == []
        for got, want in zip(served, predictor.predict(texts), strict=True):
            assert got.label == want.label
            np.testing.assert_allclose(got.probabilities, want.probabilities, atol=1e-5)
        p = client_cli("--target", target, *texts[:9])  # the CLI's --batch 32 is above max_texts too
        assert p.returncode == 0 and len(p.stdout.splitlines()) == 9, p.stderr


def test_errors_are_the_clients_own_types_and_name_the_target(tiny_bundle: Path) -> None:
    port = free_port()
    with SentimentClient(f"127.0.0.1:{port}", timeout=2, retries=0) as client, pytest.raises(Unavailable) as e:
        client.classify(["personne"])
    assert isinstance(e.value, grpc.RpcError) and e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert str(e.value).startswith(f"127.0.0.1:{port}: UNAVAILABLE: ") and "is a server running there" in str(e.value)
    with running_server(tiny_bundle, device="cpu", max_chars=10) as s, SentimentClient(f"127.0.0.1:{s.port}") as c:
        with pytest.raises(InvalidArgument) as bad:
            c.classify(["x" * 11])
        assert isinstance(bad.value, ClientError) and "10" in bad.value.details()


def test_cli_reports_a_missing_file_and_an_unreachable_server_in_one_line() -> None:
    p = client_cli("--file", "no-such-file.txt")
    assert p.returncode == 2 and p.stderr == "sentiment-client: error: no-such-file.txt: No such file or directory\n"
    port = free_port()
    p = client_cli("--target", f"127.0.0.1:{port}", "--timeout", "2", "--retries", "0", "Bien.")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith(f"sentiment-client: error: 127.0.0.1:{port}: UNAVAILABLE: ")


def test_both_help_texts_show_defaults_meanings_and_examples() -> None:
    from serving.server import _parser

    p = client_cli("--help")
    assert "--target TARGET       server host:port (default: 127.0.0.1:50051)" in p.stdout
    assert "examples:\n  python -m serving.client" in p.stdout
    parser = _parser()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        assert action.help and len(action.help) > 12, f"{action.option_strings}: no meaning"
        if action.default not in (None, False) and action.nargs != 0:
            assert "(default: " in action.help, action.option_strings
    text = parser.format_help()
    assert "--max-texts MAX_TEXTS" in text and "texts per request (default: 64)" in " ".join(text.split())
    assert "examples:" in text and "python -m trainer export ARTIFACT --out BUNDLE" in text
