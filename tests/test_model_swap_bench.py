"""bench/model_swap_bench.py, run short on the tiny bundle: a new version renamed into a polled repository under load
takes the traffic without a failed call, and a damaged one is refused while the old one keeps answering; the JSON
holds what docs/BENCHMARKS.md reports from it."""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from procs import REPO


def test_a_swap_and_a_damaged_version_under_load_fail_no_call(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "swap.json"
    run = subprocess.run([sys.executable, "bench/model_swap_bench.py", "--bundle", str(tiny_bundle), "--phases",
                          "swap", "bad", "--rate", "50", "--baseline-s", "2", "--swaps", "1", "--swap-gap-s", "0",
                          "--tail-s", "1", "--idle-s", "0", "--poll-s", "0.2", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert {"machine", "date", "load_average_start", "swap", "bad"} <= r.keys()

    swap = r["swap"]
    assert swap["failed"] == 0, swap["failed_examples"]
    assert swap["calls"] >= 100 and swap["before"]["calls"] > 0 and swap["during"]["calls"] > 0
    assert swap["before"]["p99_ms"] > 0 and swap["p99_ratio"] > 0 and swap["rss_ratio"] > 0
    assert set(swap["rss_mib"]) == {"before", "after", "idle_after"}
    assert [w["version"] for w in swap["per_swap"]] == [2]
    assert set(swap["versions"]) == {"1", "2"}  # the traffic moved to the new version
    assert swap["answers_from_an_unloaded_version"] == 0
    assert swap["model_loads"] == {"loaded": 2, "failed": 0, "unloaded": 1}
    assert swap["server"]["exit_code"] == 0

    bad = r["bad"]
    assert bad["failed"] == 0, bad["failed_examples"]
    line = next(x for x in bad["index"] if x["version"] == "2")
    assert line["state"] == "UNAVAILABLE" and "model.onnx: checksum mismatch" in line["reason"]
    assert bad["failed_loads_at_refusal"] == 1 and bad["model_loads"]["failed"] == 1
    assert set(bad["versions_after_rename"]) == {"1"} and bad["versions_after_rename"]["1"] > 0
    assert "### swap" in run.stdout and "| p99 in the windows / before |" in run.stdout


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 12 minutes on a host without AVX-512
def test_two_models_the_flooded_one_takes_no_call_of_the_other(tiny_bundle: Path, tmp_path: Path) -> None:
    """The phase two, short: b measured alone, under h2load's flood of a, alone again; b's calls are never refused
    for a's flood, and both models answered in it (a's texts counted by the server)."""
    out = tmp_path / "two.json"
    run = subprocess.run([sys.executable, "bench/model_swap_bench.py", "--bundle", str(tiny_bundle), "--phases",
                          "two", "--two-s", "1", "--two-rounds", "2", "--concurrency", "4", "--flood-callers", "24",
                          "--poll-s", "0.2", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    two = json.loads(out.read_text())["two"]
    assert two["b_refused_in_flood"] == 0 and two["b_flooded"]["failed"] == 0
    assert two["b_flooded"]["calls"] > 0 and two["b_alone"]["calls"] > 0 and two["b_alone_again"]["calls"] > 0
    assert two["a_flood"]["texts_per_s"] > 0 and two["a_flood"]["client"] == "h2load, 16 connections x 2 streams"
    assert 0 < two["b_share"] and 0 < two["b_p99_ratio"] and two["server"]["exit_code"] == 0
    first = two["rounds"][0]  # the first flood against the runs alone before and after it
    assert first["share"] == round(2 * two["b_flooded"]["texts_per_s"] / (two["b_alone"]["texts_per_s"]
                                                                          + two["b_alone_again"]["texts_per_s"]), 3)
    assert len(two["rounds"]) == 2 and two["b_share"] == statistics.median(r["share"] for r in two["rounds"])
    assert "| b's texts/s in the flood / alone (median) |" in run.stdout


def test_a_terminated_benchmark_stops_its_server(tiny_bundle: Path, tmp_path: Path) -> None:
    """SIGTERM to the benchmark mid-phase: its server goes with it (it ran on, holding a port and a core, before)."""
    bench = subprocess.Popen([sys.executable, "bench/model_swap_bench.py", "--bundle", str(tiny_bundle), "--phases",
                              "swap", "--rate", "20", "--baseline-s", "60", "--poll-s", "0.2"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers: list[psutil.Process] = []
    try:
        end = time.monotonic() + 60
        while not servers and time.monotonic() < end and bench.poll() is None:
            time.sleep(0.2)
            servers = [p for p in psutil.Process(bench.pid).children(recursive=True)
                       if "serving.server" in " ".join(p.cmdline())]
        assert servers, "the benchmark started no server"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(servers, timeout=30)
        assert not alive, f"servers left running: {[p.pid for p in alive]}"
    finally:
        bench.kill()
        for p in servers:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
