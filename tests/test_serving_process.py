"""The server as its users start it (`python -m serving.server`, launch/serve.sh) and the client CLI.

SIGTERM under load: requests in flight complete, later ones are refused cleanly, exit 0. A missing or corrupt
bundle: a clear message and a non-zero exit before any port opens.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from serving_fixtures import (
    REPO_ROOT,
    ServerProcess,
    reviews,
    running_server,
    sigterm_under_load,
    target,
    waited_out_the_server,
)

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.predictor import Predictor


def test_sigterm_under_load_completes_accepted_requests_and_exits_0(tiny_bundle: Path, data_dir: Path) -> None:
    texts = reviews(data_dir, 16)
    expected = np.stack([p.probabilities for p in Predictor(tiny_bundle, device="cpu").predict(texts)])
    server, outcomes, sigterm_at, rc = sigterm_under_load(tiny_bundle, ["--grace-s", "20"], texts, answers=12,
                                                          own_connections=False)
    assert rc == 0, server.log
    assert "draining" in server.log and "stopped" in server.log
    # Sent before SIGTERM: answered, or refused with UNAVAILABLE if it reached the server after the refusal
    # began. Sent after: gRPC itself cancels the few that reach the listener in the instant it closes, before
    # any handler sees them (a client reads CANCELLED); the server refuses work before that, so no call it
    # accepted is among them. A call started before SIGTERM by the client's clock may still leave it after (12
    # client threads on 2 cores; under load they were seen up to 15 ms late): CANCELLED is then its fate too, and it
    # ends after SIGTERM, possibly while accepted calls are still being answered. A call the server accepted and
    # then dropped is one of those the server's log names when its grace runs out; one cancelled before SIGTERM
    # is a failure.
    assert "they are cancelled" not in server.log, server.log
    before = {o[2] for o in outcomes if o[0] < sigterm_at and not (o[2] == "CANCELLED" and o[1] >= sigterm_at)}
    client_waits = {id(o) for o in waited_out_the_server(outcomes, sigterm_at, server)}  # gRPC's, rarely
    after = {o[2] for o in outcomes if o[0] >= sigterm_at and id(o) not in client_waits}
    failed = [(round(o[0] - sigterm_at, 3), round(o[1] - sigterm_at, 3), o[2], o[3]) for o in outcomes
              if o[2] != "OK"]
    assert before <= {"OK", "UNAVAILABLE"}, failed
    assert after <= {"OK", "UNAVAILABLE", "CANCELLED"}, failed
    across = [o for o in outcomes if o[0] < sigterm_at < o[1] and o[2] == "OK"]
    assert across, "no request was in flight at SIGTERM"  # accepted before, answered after
    for o in outcomes:
        if o[2] == "OK":
            np.testing.assert_allclose(o[3], expected, atol=1e-5)
    assert sum(o[2] == "OK" for o in outcomes) > 12  # more than one answer a caller


def test_missing_bundle_exits_non_zero_with_a_clear_message(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "nope")
    rc = server.wait_exit(30)
    assert rc == 2 and "bundle folder not found" in server.log and str(tmp_path / "nope") in server.log
    assert "Traceback" not in server.log


def test_corrupt_bundle_exits_non_zero_naming_the_file(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = shutil.copytree(tiny_bundle, tmp_path / "bundle")
    with open(bundle / "tokenizer" / "spm.model", "ab") as f:
        f.write(b"\x00")
    server = ServerProcess(bundle)
    rc = server.wait_exit(30)
    assert rc == 2 and "spm.model: checksum mismatch" in server.log, server.log
    assert "listening" not in server.log and "Traceback" not in server.log


def test_launch_script_serves_and_stops_on_sigterm(tiny_bundle: Path) -> None:
    proc = subprocess.Popen(["bash", str(REPO_ROOT / "launch" / "serve.sh"), str(tiny_bundle), "--port", "0",
                             "--http-port", "0", "--no-metrics", "--device", "cpu"],  # no port another run holds
                            env={**os.environ, "PY": sys.executable},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        deadline = time.monotonic() + 30
        assert proc.stdout is not None
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if "listening on" in line:
                port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
        assert port, "launch/serve.sh did not start the server"
        stub = pb_grpc.SentimentServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        assert len(stub.Classify(pb.ClassifyRequest(texts=["Lancé par le script."]), timeout=10).results) == 1
        proc.send_signal(signal.SIGTERM)  # exec: the signal reaches the server itself
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_client_cli(tiny_bundle: Path, tmp_path: Path) -> None:
    reviews_file = tmp_path / "reviews.txt"
    reviews_file.write_text("Un roman magnifique.\n\nTrop long et ennuyeux.\n", encoding="utf-8")
    with running_server(tiny_bundle, device="cpu") as s:
        cli = [sys.executable, "-m", "serving.client", "--target", target(s)]
        out = subprocess.run([*cli, "Bien.", "--file", str(reviews_file), "--json"], capture_output=True,
                             text=True, timeout=60, cwd=REPO_ROOT)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().split("\n")
        assert len(lines) == 3 and '"text": "Un roman magnifique."' in lines[1]
        bad = subprocess.run([*cli, "a" * 30_000], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_chars" in bad.stderr


def test_token_file_option(tiny_bundle: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-long-enough-secret-token\n")
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--auth-token-file", str(token))
    try:
        port = server.wait_listening()
        assert "token auth" in server.log
        stub = pb_grpc.SentimentServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with pytest.raises(grpc.RpcError) as info:
            stub.Classify(pb.ClassifyRequest(texts=["x"]), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Classify(pb.ClassifyRequest(texts=["x"]), timeout=10,
                           metadata=[("authorization", "Bearer a-long-enough-secret-token")])
        assert len(ok.results) == 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(30) == 0
    finally:
        server.close()


@pytest.mark.parametrize("where", ["file", "variable"])
def test_an_empty_token_is_refused_not_read_as_no_auth(tiny_bundle: Path, tmp_path: Path, where: str) -> None:
    """An empty token file (a Secret mounted without its key) or an empty SENTIMENT_AUTH_TOKEN once started the
    server without authentication; it is a configuration error (exit 2) naming its source."""
    token = tmp_path / "token"
    token.write_text("\n")
    args, env = (["--auth-token-file", str(token)], {}) if where == "file" else ([], {"SENTIMENT_AUTH_TOKEN": ""})
    out = subprocess.run([sys.executable, "-m", "serving.server", str(tiny_bundle), "--device", "cpu",
                          "--port", "0", *args], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                         env={**os.environ, **env})
    assert out.returncode == 2, out.stderr
    assert ("--auth-token-file" if where == "file" else "SENTIMENT_AUTH_TOKEN") in out.stderr and "empty" in out.stderr
