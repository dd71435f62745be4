"""The OpenAPI document the server serves (/openapi.json) against the server itself: the same paths and methods as its
routes, and schemathesis (a property-based API fuzzer) generating calls from it: no 5xx, every answer's status,
content type, headers and body as the document says, malformed calls refused, memory flat, the server still serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_fixtures import call, classify
from serving_fixtures import ServerProcess, running_server

from serving.protocols.http.routes import Endpoint

TOKEN = "openapi-test-token-0123456789"
SCHEMATHESIS = [sys.executable, "-m", "schemathesis.cli"]
# Every check schemathesis has, but one: positive_data_acceptance expects every schema-valid call to be accepted,
# and a text also needs a letter or a digit and pieces the tokenizer keeps, rules no JSON Schema states (such calls
# get 400, which the negative checks accept).
EXCLUDED = "positive_data_acceptance"
# Its coverage phase also sends an unknown header and expects a refusal; HTTP ignores header fields it does not know
# (RFC 9110, section 5.1), as this server does. The other phases: examples, fuzzing, stateful.
PHASES = "examples,fuzzing,stateful"
EXAMPLES = 25


def test_the_document_describes_every_route_and_only_those(tiny_bundle: Path) -> None:
    with running_server(tiny_bundle, device="cpu", http_port=0, auth_token=TOKEN) as s:
        doc = call(s.http_port, "GET", "/openapi.json").json
        routes = s.http._server.config.app.routes
    served = {r.path: {m.lower() for m in r.app.methods if m != "HEAD"} for r in routes
              if isinstance(r.app, Endpoint) and r.path not in ("/openapi.json", "/")}
    assert {path: set(ops) for path, ops in doc["paths"].items()} == served
    assert doc["components"]["schemas"]["ClassifyRequest"]["properties"]["texts"]["maxItems"] == 64
    open_paths = {p for p, ops in doc["paths"].items() if all(op["security"] == [] for op in ops.values())}
    assert open_paths == {"/v2/health/live", "/v2/health/ready"}


@pytest.mark.slow  # 37 s; by default test_the_document_describes_every_route_and_only_those checks the schema it fuzzes
def test_schemathesis_finds_nothing(tiny_bundle: Path, tmp_path: Path) -> None:
    server = ServerProcess(tiny_bundle, "--http-port", "0", "--metrics-port", "0", "--device", "cpu",
                           "--max-texts", "16", "--max-message-bytes", str(256 * 1024),
                           env={"SENTIMENT_AUTH_TOKEN": TOKEN})
    try:
        server.wait_listening(60)
        process = server._tree()[0]
        for _ in range(50):  # warm: the first calls allocate what every later call reuses
            classify(server.http_port, ["Un livre, un vrai."] * 16, {"Authorization": f"Bearer {TOKEN}"})
        time.sleep(6)  # the reclaimer runs 5 s after the last call (memory_reclaim_idle_s)
        before = process.memory_info().rss
        report = tmp_path / "junit.xml"
        # The deadline header is fixed: a schema-valid deadline of 1e-300 ms gets the 504 it must get.
        run = subprocess.run([*SCHEMATHESIS, "run", f"http://127.0.0.1:{server.http_port}/openapi.json",
                              "--checks", "all", "--exclude-checks", EXCLUDED, "--phases", PHASES,
                              "--max-examples", str(EXAMPLES), "--seed", "7", "--workers", "1",
                              "-H", f"Authorization: Bearer {TOKEN}", "-H", "Request-Timeout-Ms: 60000",
                              "--report", "junit",
                              "--report-junit-path", str(report)],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env={**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"})
        summary = run.stdout[run.stdout.find("SUMMARY"):]
        assert run.returncode == 0, run.stdout[-6000:]
        assert "generated" in summary and "failure" not in summary.split("Test cases:")[1], summary
        time.sleep(6)
        grown = process.memory_info().rss - before
        assert grown < 16 * 1024 * 1024, f"resident memory grew by {grown / 2**20:.1f} MiB"
        codes = server.codes()
        assert codes.get("INTERNAL", 0) == 0 and codes.get("OK", 0) > 0, codes
        assert classify(server.http_port, ["Toujours là."], {"Authorization": f"Bearer {TOKEN}"}).status == 200
        cases = next(line for line in summary.splitlines()[summary.splitlines().index("Test cases:") + 1:] if line)
        print(json.dumps({"cases": cases.strip(), "codes": codes,
                          "rss_growth_mib": round(grown / 2**20, 2)}))
        assert server.stop() == 0
    finally:
        server.close()


@pytest.mark.parametrize("path", ["/openapi.json"])
def test_the_document_is_open_and_json(tiny_bundle: Path, path: str) -> None:
    with running_server(tiny_bundle, device="cpu", http_port=0, auth_token=TOKEN) as s:
        reply = call(s.http_port, "GET", path)
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    assert reply.json["openapi"].startswith("3.0") and reply.json["components"]["securitySchemes"]["bearer"]
