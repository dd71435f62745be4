"""The images the tests build and run as CI does: no registry, bases made from Debian's packages, buildah.

buildah builds and runs the images with `--isolation chroot` (no daemon); a container run that way shares the host's
network. mmdebstrap makes each base from Debian's packages, because no container registry is reachable.
`make container-deps` installs both with apt (root), and podman for tests/test_compose.py; in CI a missing tool
fails the test.

Cached between runs, keyed by their inputs, under $TS_CONTAINER_CACHE (else ~/.cache/transfer-sentiment/container):
the bases' tarballs (and the server's wheelhouse, tests/test_container.py). buildah's layer cache does the rest; a
run without any cache (a new machine) builds everything. A build holds a file lock, so that pytest-xdist's workers
build an image once, one after the other.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest
from procs import REPO, run

sys.path.insert(0, str(REPO / "deploy"))
from healthcheck import check

PROXY_IMAGE = "localhost/transfer-sentiment-proxy:test"
# The proxy's base: Debian trixie with apt, its security updates in reach (haproxy 3.0.11 has the issue-1219 fix);
# Containerfile.proxy installs haproxy itself, as it does on debian:trixie-slim.
PROXY_SUITE = "trixie"
PROXY_MMDEBSTRAP = ["--variant=apt", *[f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "info", "locale")]]
PROXY_MIRRORS = ["deb http://deb.debian.org/debian trixie main",
                 "deb http://deb.debian.org/debian trixie-updates main",
                 "deb http://deb.debian.org/debian-security trixie-security main"]
# What haproxy.cfg's `maxconn 4000` needs (2 per connection, and some), within this machine's hard limit: a buildah
# container's own default here is 1024, which haproxy cannot raise as a non-root user.
PROXY_NOFILE = 10000


def unavailable(message: str) -> NoReturn:
    """A tool the test needs is missing: in CI a failure, elsewhere a skip."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        unavailable(f"{tool} not found: run `make container-deps` (buildah, mmdebstrap, podman, runc: apt, as root)")
    return path


def wait_serving(target: str, seconds: float, launcher: subprocess.Popen[str] | None = None,
                 log: Path | None = None) -> None:
    """Until grpc.health.v1 at `target` answers SERVING (the images' own check, deploy/healthcheck.py); fails after
    `seconds`, or as soon as `launcher` (the command that runs the container) has exited, with its `log`."""
    deadline = time.monotonic() + seconds
    while check(target) != "SERVING":
        output = log.read_text() if log else ""
        assert launcher is None or launcher.poll() is None, f"exited {launcher.returncode}:\n{output}"
        assert time.monotonic() < deadline, f"{target}: not SERVING after {seconds} s\n{output}"
        time.sleep(0.5)


def cache() -> Path:
    root = os.environ.get("TS_CONTAINER_CACHE") or Path.home() / ".cache" / "transfer-sentiment" / "container"
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(root)


def key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def ok(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    out = run(cmd, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(cmd[:4])}... exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def has_image(name: str) -> bool:
    return run(["buildah", "inspect", "--type", "image", name], timeout=60).returncode == 0


def config(image: str) -> dict:
    """The image's Docker config: User, Entrypoint, Cmd, Env, Healthcheck, StopSignal, ExposedPorts."""
    return json.loads(ok(["buildah", "inspect", "--type", "image", image], timeout=60).stdout)["Docker"]["config"]


@contextmanager
def locked(name: str) -> Iterator[None]:
    """One process at a time builds `name` (the others wait, then find it built)."""
    with (cache() / f"{key(name)}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def debian_base(suite: str, options: list[str], mirrors: list[str] = ()) -> str:
    """A Debian image of `suite` made by mmdebstrap with `options` (cached as a tarball), imported into buildah."""
    need("buildah")
    need("mmdebstrap")
    k = key(suite, options, *([list(mirrors)] if mirrors else []))  # without mirrors: the key bases had before
    name = f"localhost/transfer-sentiment-base:{k}"
    with locked(name):
        if has_image(name):
            return name
        tarball = cache() / f"base-{suite}-{k}.tar"
        if not tarball.exists():
            partial = tarball.with_suffix(".partial.tar")
            partial.unlink(missing_ok=True)
            ok(["mmdebstrap", *options, suite, str(partial), *mirrors], timeout=900)
            partial.rename(tarball)  # atomic: a run killed half-way leaves no tarball that looks whole
        ctr = ok(["buildah", "from", "scratch"], timeout=60).stdout.strip()
        ok(["buildah", "add", "--quiet", ctr, str(tarball), "/"], timeout=300)
        ok(["buildah", "commit", "--quiet", "--rm", ctr, name], timeout=300)
    return name


@functools.cache
def proxy_image() -> str:
    """Containerfile.proxy built on a Debian trixie base, haproxy installed by its own step from Debian's mirror;
    buildah's layer cache keeps it, and a change to deploy/proxy/ rebuilds what follows. Once a process. Returns the
    image's id: the tag is one for every checkout on the machine, and another checkout's build moves it."""
    base = debian_base(PROXY_SUITE, PROXY_MMDEBSTRAP, PROXY_MIRRORS)
    with locked(PROXY_IMAGE):
        ok(["buildah", "bud", "--isolation", "chroot", "--layers", "--force-rm", "--format", "docker", "--quiet",
            "--build-arg", f"BASE_IMAGE={base}", "-f", str(REPO / "Containerfile.proxy"), "-t", PROXY_IMAGE,
            str(REPO)], timeout=900)
        return ok(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", PROXY_IMAGE],
                  timeout=60).stdout.strip()
