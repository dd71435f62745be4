"""The soak (bench/soak.py) in short: the same script, a real server subprocess, 20 s of load.

The missing-bundle check runs in the default suite; the rest is slow. The full soak (10 minutes at concurrency 128,
docs/RELIABILITY.md) is run by hand; this wrapper keeps the script working and checks its refusal accounting: with a
queue of 16 texts and 48 callers sending 2 texts each, the queue overflows, and every refusal must be a queue
refusal past that limit while every answer stays right. RSS growth is reported but not judged here: 20 s measure no
steady state (the full soak warms up 3 minutes); what is judged is that the client's counts agree with the server's
own and that the RSS is the server's, sampled during the load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serving_fixtures import REPO_ROOT


@pytest.mark.slow
def test_soak_script_short_run(tiny_bundle: Path, data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO_ROOT / "bench" / "soak.py"), "--bundle", str(tiny_bundle), "--data",
           str(data_dir), "--seconds", "20", "--warmup", "5", "--window", "5", "--concurrency", "48",
           "--texts-per-request", "2", "--server-args", "--max-queue 16 --max-texts 4", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO_ROOT)
    assert out.is_file(), run.stdout + run.stderr
    r = json.loads(out.read_text())
    checks = dict(r["checks"])
    checks.pop("RSS growth < 5%")
    assert all(checks.values()), (checks, run.stdout[-3000:])
    assert r["ok"] > 100 and r["wrong_answers"] == 0
    assert set(r["errors"]) <= {"RESOURCE_EXHAUSTED"} and r["errors"].get("RESOURCE_EXHAUSTED", 0) > 0
    assert r["refusals_not_past_the_limit"] == []
    assert r["exit_code"] == 0 and r["health_at_end"] == "SERVING"
    # The client's count against the server's own (/metrics, every method, read after the load): each refusal the
    # client recorded was counted by the server, and the server answered at least as many OK calls as the client
    # recorded (it also answered health checks). A client that miscounts, or a server that labels codes wrongly,
    # fails one of the two.
    server, warmup = r["server_codes"], r["warmup"]
    refused = r["errors"].get("RESOURCE_EXHAUSTED", 0) + warmup["errors"].get("RESOURCE_EXHAUSTED", 0)
    assert server.get("RESOURCE_EXHAUSTED", 0) == refused, (server, r["errors"], warmup)
    assert server.get("OK", 0) >= r["ok"] + warmup["requests"] - sum(warmup["errors"].values()), (server, r["ok"])
    assert [w["window"] for w in r["windows"]] == [0, 1, 2, 3] and all(w["ok"] > 0 for w in r["windows"])
    # RSS in MiB of the server (onnxruntime + gRPC: tens of MiB, not bytes or KiB), sampled every 2.5 s of load.
    rss = r["rss_mib"]
    assert 30 < rss["idle"] < 2048 and 30 < rss["end"] < 2048, rss
    times = [t for t, _ in r["rss_samples_mib"]]
    assert len(times) >= 6 and times == sorted(times) and times[-1] <= 25 + 5, times
    assert "| window |" in run.stdout


@pytest.mark.parametrize("script", ["bench/soak.py", "bench/protocol_attacks.py"])
def test_a_missing_bundle_is_one_line_before_any_process_starts(script: str, tmp_path: Path) -> None:
    """Before, the soak died in a traceback from the predictor, and the attacks script in one of its own
    (RuntimeError: server did not start) after starting a server."""
    missing = tmp_path / "no-bundle"
    p = subprocess.run([sys.executable, script, "--bundle", str(missing)], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.splitlines()[-1].endswith(f"error: --bundle: {missing}: bundle folder not found")


@pytest.mark.parametrize(("args", "line"), [
    (["--via-haproxy", "0"], "error: --via-haproxy must be >= 1, got 0"),
    (["--haproxy-source-limit", "10"], "error: --haproxy-source-limit needs --via-haproxy"),
    (["--before-repo", "/nonexistent"], "error: --before-repo: /nonexistent holds no serving/server.py"),
], ids=["zero calls", "a limit without the proxy", "a tree without a server"])
def test_a_run_the_attacks_script_cannot_make_is_one_line(args: list[str], line: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "bench/protocol_attacks.py", "--bundle", str(tmp_path), *args],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.splitlines()[-1].endswith(line)
