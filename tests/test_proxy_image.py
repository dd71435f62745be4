"""The proxy's image (Containerfile.proxy), built and run as CI does (tests/images.py): Debian trixie's haproxy with
the fix for HAProxy's issue 1219, deploy/proxy/'s files, a non-root user; in front of a real server, and stopped by
its own stop signal with a call in flight. What the proxy does to calls: tests/test_front_proxy.py, on this image."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from images import PROXY_NOFILE, PROXY_SUITE, config, debian_base, ok, proxy_image, wait_serving
from procs import REPO, free_port, kill_group, popen, run
from serving_fixtures import HeldRuns, running_server

from serving.client import SentimentClient
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

APP_UID = 10001  # the pod's user (deploy/deployment.yaml), the server image's too
TOKEN = "proxy-image-token-0123456789"
# The fix, as HAProxy's changelog names it (commit e87397bc7, backported to 3.0.11)
FIX = "BUG/MINOR: mux-h2: Reset streams with NO_ERROR code if full response was already sent"


@pytest.fixture(scope="module")
def image() -> str:
    return proxy_image()


@pytest.fixture
def container(image: str) -> Iterator[str]:
    ctr = ok(["buildah", "from", "--pull-never", "--ulimit", f"nofile={PROXY_NOFILE}:{PROXY_NOFILE}", image],
             timeout=120).stdout.strip()
    try:
        yield ctr
    finally:
        run(["buildah", "rm", ctr], timeout=120)


def _inside(ctr: str, *cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    settings = [a for k, v in (env or {}).items() for a in ("--env", f"{k}={v}")]
    return run(["buildah", "run", "--isolation", "chroot", *settings, ctr, "--", *cmd], timeout=120)


def test_the_image_holds_debians_haproxy_with_the_issue_1219_fix_and_deploy_proxys_files(
        image: str, container: str) -> None:
    settings = config(image)
    assert settings["User"] == f"{APP_UID}:{APP_UID}" and settings["StopSignal"] == "SIGUSR1"
    assert _inside(container, "id", "-u").stdout.strip() == str(APP_UID)
    version = _inside(container, "dpkg-query", "-W", "-f", "${Version}", "haproxy").stdout
    assert _inside(container, "dpkg", "--compare-versions", version, "ge", "3.0.11").returncode == 0, version
    changelog = _inside(container, "zcat", "/usr/share/doc/haproxy/changelog.gz")
    assert changelog.returncode == 0 and FIX in changelog.stdout, version
    root = Path(ok(["buildah", "mount", container], timeout=60).stdout.strip())
    try:
        shipped = {p.name: p.read_bytes() for p in (root / "etc" / "haproxy" / "sentiment").iterdir()}
    finally:
        run(["buildah", "umount", container], timeout=60)
    proxy = REPO / "deploy" / "proxy"
    assert shipped == {p.name: p.read_bytes() for p in proxy.iterdir() if p.suffix in (".cfg", ".http")}


def test_the_image_passes_calls_on_and_its_stop_signal_lets_the_call_in_flight_end(
        image: str, container: str, tiny_bundle: Path, tmp_path: Path) -> None:
    """The image's own entrypoint in front of a server, its settings from the environment: health and calls pass;
    its HEALTHCHECK command succeeds; its stop signal (SIGUSR1) closes the port at once, lets a call held in the
    model end, then haproxy exits 0."""
    settings = config(image)
    port = free_port()
    env = {"PROXY_BIND": f"127.0.0.1:{port}", "HTTP_BIND": f"127.0.0.1:{free_port()}"}  # no port another run holds
    target = f"127.0.0.1:{port}"
    log = tmp_path / "proxy.log"
    with running_server(tiny_bundle, device="cpu", behind_proxy=True, auth_token=TOKEN, batch_workers=1) as s, \
            log.open("w") as out:
        env["SERVER_ADDR"] = f"127.0.0.1:{s.port}"
        launcher = popen(["buildah", "run", "--isolation", "chroot",
                          *[a for k, v in env.items() for a in ("--env", f"{k}={v}")], container, "--",
                          *settings["Entrypoint"]], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_serving(target, 60, launcher, log)
            (haproxy,) = [p for p in psutil.Process(launcher.pid).children(recursive=True) if p.name() == "haproxy"]
            assert haproxy.uids().real == APP_UID
            health = settings["Healthcheck"]["Test"]
            assert health[0] == "CMD" and _inside(container, *health[1:], env=env).returncode == 0
            assert _inside(container, *health[1:], env={"PROXY_BIND": f":{free_port()}"}).returncode != 0

            with SentimentClient(target, token=TOKEN, timeout=30) as client:
                (first,) = client.classify(["Un très beau livre."])
                assert first.label in s.core.predictor.label_names
                with HeldRuns(s) as held, grpc.insecure_channel(target) as channel:
                    in_flight = pb_grpc.SentimentServiceStub(channel).Classify.future(
                        pb.ClassifyRequest(texts=["Décevant."]), timeout=30,
                        metadata=[("authorization", f"Bearer {TOKEN}")])
                    assert held.wait_entered()
                    haproxy.send_signal(signal.Signals[settings["StopSignal"]])
                    deadline = time.monotonic() + 10
                    while _accepts(port):
                        assert time.monotonic() < deadline, "the port still accepts connections"
                        time.sleep(0.1)
                    assert launcher.poll() is None, "haproxy ended before the call in flight did"
                    held.release()
                    assert len(in_flight.result().results) == 1
            assert launcher.wait(timeout=35) == 0, log.read_text()
        finally:
            kill_group(launcher)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_a_base_with_an_older_haproxy_stops_the_build() -> None:
    """Debian bookworm's haproxy 2.6.12 lacks the fix: the build says so and fails, rather than ship it."""
    base = debian_base("bookworm", ["--variant=apt"], ["deb http://deb.debian.org/debian bookworm main"])
    assert PROXY_SUITE != "bookworm"
    out = run(["buildah", "bud", "--isolation", "chroot", "--layers", "--force-rm", "--format", "docker", "--build-arg",
               f"BASE_IMAGE={base}", "-f", str(REPO / "Containerfile.proxy"), "-t",
               "localhost/transfer-sentiment-proxy:test-bookworm", str(REPO)], timeout=900)
    assert out.returncode != 0
    assert "haproxy 2.6" in out.stderr and "lacks the fix for HAProxy issue 1219" in out.stderr, out.stderr[-3000:]
