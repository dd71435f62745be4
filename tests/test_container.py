"""The server's image (Containerfile), built and run as CI does: no registry, a base made from Debian's packages.

buildah builds and runs the image with `--isolation chroot` (no daemon; podman's OCI runtime cannot set rlimits in
this sandbox); a container run that way shares the host's network, so the server listens on a loopback port and
the clients call it from outside. mmdebstrap makes the base image from Debian's packages, because no container
registry is reachable. `make container-deps` installs both with apt (root); in CI a missing tool fails the test.

Cached between runs, keyed by their inputs, under $TS_CONTAINER_CACHE (else ~/.cache/transfer-sentiment/container):
the base tarball and the wheelhouse the build installs from (made by the host's pip: the build itself is offline).
buildah's layer cache does the rest; a run without any cache (a new machine) builds everything.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from procs import free_port, kill_group, popen, run
from serving_fixtures import REPO_ROOT, reviews

from serving.client import SentimentClient
from serving.model.predictor import Predictor

sys.path.insert(0, str(REPO_ROOT / "deploy"))
from healthcheck import check
from serve_requirements import serve_requirements

IMAGE = "localhost/transfer-sentiment:test"
SUITE = "bookworm"  # the base: Debian's python3 (3.11 in bookworm: the wheelhouse's Python below)
BASE_PYTHON = "3.11"
MMDEBSTRAP = ["--variant=essential", "--include=python3,python3-venv,libstdc++6",  # libstdc++: grpcio, onnxruntime
              *[f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "info", "locale")]]
APP_UID = 10001  # the Containerfile's USER
TOKEN = "container-test-token-0123456789"
TRITON_PYTHON = Path(os.environ.get("TRITON_PYTHON", REPO_ROOT / ".venv-triton" / "bin" / "python"))


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not found: run `make container-deps` (apt-get install buildah mmdebstrap, as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _cache() -> Path:
    root = os.environ.get("TS_CONTAINER_CACHE") or Path.home() / ".cache" / "transfer-sentiment" / "container"
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(root)


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _ok(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    out = run(cmd, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(cmd[:4])}... exited {out.returncode}:\n{out.stderr[-4000:]}"
    return out


def _has_image(name: str) -> bool:
    return run(["buildah", "inspect", "--type", "image", name], timeout=60).returncode == 0


@pytest.fixture(scope="module")
def base_image() -> str:
    """A Debian base image with python3, made by mmdebstrap (cached as a tarball) and imported into buildah."""
    _need("buildah")
    _need("mmdebstrap")
    key = _key(SUITE, MMDEBSTRAP)
    name = f"localhost/transfer-sentiment-base:{key}"
    if _has_image(name):
        return name
    tarball = _cache() / f"base-{SUITE}-{key}.tar"
    if not tarball.exists():
        partial = tarball.with_suffix(".partial.tar")
        partial.unlink(missing_ok=True)
        _ok(["mmdebstrap", *MMDEBSTRAP, SUITE, str(partial)], timeout=900)
        partial.rename(tarball)  # atomic: a run killed half-way leaves no tarball that looks whole
    ctr = _ok(["buildah", "from", "scratch"], timeout=60).stdout.strip()
    _ok(["buildah", "add", "--quiet", ctr, str(tarball), "/"], timeout=300)
    _ok(["buildah", "commit", "--quiet", "--rm", ctr, name], timeout=300)
    return name


def _wheelhouse(ort_package: str) -> Path:
    """The server's wheels for the base's Python and this machine, downloaded by the host's pip. The GPU image's
    (onnxruntime-gpu with the CUDA and cuDNN wheels) is about 2 GB."""
    requirements = serve_requirements(REPO_ROOT / "pyproject.toml", ort_package)
    lock = (REPO_ROOT / "requirements.lock").read_text(encoding="utf-8")
    machine = platform.machine()
    folder = _cache() / f"wheels-{_key(requirements, lock, BASE_PYTHON, machine)}"
    if not folder.is_dir():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        # pip matches manylinux_2_N exactly: every N the base's glibc (2.36 in bookworm) runs, and the old aliases.
        tags = [f"manylinux_2_{n}" for n in range(36, 4, -1)] + ["manylinux2014", "manylinux2010", "manylinux1"]
        platforms = [a for tag in tags for a in ("--platform", f"{tag}_{machine}")]
        _ok([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(partial), "--only-binary=:all:",
             *platforms, "--python-version", BASE_PYTHON, "--implementation", "cp",
             "--constraint", str(REPO_ROOT / "requirements.lock"), *requirements], timeout=1200)
        partial.rename(folder)
    return folder


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    return _wheelhouse("onnxruntime")


def _build_command(base_image: str, wheelhouse: Path) -> list[str]:
    """`buildah bud` with this test's base, offline from the wheelhouse (mounted at /wheels during the build)."""
    return ["buildah", "bud", "--isolation", "chroot", "--layers", "--force-rm", "--format", "docker", "--quiet",
            "--build-arg", f"BASE_IMAGE={base_image}", "--build-arg", "PIP_NO_INDEX=1",
            "--build-arg", "PIP_FIND_LINKS=/wheels", "--volume", f"{wheelhouse}:/wheels:ro",
            "-f", str(REPO_ROOT / "Containerfile")]


@pytest.fixture(scope="module")
def build(base_image: str, wheelhouse: Path) -> list[str]:
    return _build_command(base_image, wheelhouse)


@pytest.fixture(scope="module")
def image(build: list[str]) -> str:
    """The default target of the Containerfile."""
    _ok([*build, "-t", IMAGE, str(REPO_ROOT)], timeout=1200)
    return IMAGE


def _config(image: str) -> dict:
    out = _ok(["buildah", "inspect", "--type", "image", image], timeout=60).stdout
    return json.loads(out)["Docker"]["config"]


@pytest.fixture
def container(image: str) -> Iterator[str]:
    ctr = _ok(["buildah", "from", "--pull-never", image], timeout=120).stdout.strip()
    try:
        yield ctr
    finally:
        _ok(["buildah", "rm", ctr], timeout=120)


def _server_process(launcher: psutil.Process, deadline: float) -> psutil.Process:
    """The python process that runs serving.server, among the descendants of `buildah run`."""
    while time.monotonic() < deadline:
        for p in launcher.children(recursive=True):
            try:
                if p.cmdline()[1:3] == ["-m", "serving.server"]:
                    return p
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    raise AssertionError("no serving.server process under `buildah run`")


def _tritonclient(target: str, texts: list[str]) -> dict:
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON} missing: run `make triton-venv`")
    out = subprocess.run([str(TRITON_PYTHON), str(REPO_ROOT / "tests" / "triton_client_check.py"), "infer", target,
                          "sentiment", TOKEN], input=json.dumps(texts), capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_image_serves_a_root_exported_bundle_as_non_root_and_stops_on_sigterm(
        image: str, container: str, default_bundle: Path, data_dir: Path, tmp_path: Path) -> None:
    config = _config(image)
    assert config["User"] == f"{APP_UID}:{APP_UID}"
    entrypoint, cmd = config["Entrypoint"], config["Cmd"]
    assert entrypoint[1:] == ["-m", "serving.server"], "exec form: the server itself is PID 1"
    assert cmd[0] == "/mnt/models"

    # The final stage holds the server and its dependencies, not the training stack.
    root = Path(_ok(["buildah", "mount", container], timeout=60).stdout.strip())
    try:
        site = next((root / "opt" / "venv" / "lib").glob("python3*/site-packages"))
        installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
        # onnx: the bundle verifier (contract/bundle.py) reads the graph's tables before onnxruntime runs it.
        assert {"onnxruntime", "onnx", "grpcio", "sentencepiece"} <= installed
        assert not installed & {"torch", "deepspeed", "onnxruntime_gpu", "pip", "transfer_sentiment"}
        assert sorted(p.name for p in (root / "opt" / "app").iterdir()) == [
            "__pycache__", "contract", "healthcheck.py", "serving"]
    finally:
        run(["buildah", "umount", container], timeout=60)

    # Exported by this (root) process as `export` writes it by default, mounted as it is: its modes follow the umask.
    bundle = default_bundle
    token = tmp_path / "token"
    token.write_text(TOKEN, encoding="utf-8")
    token.chmod(0o644)
    port, metrics_port = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    log = tmp_path / "server.log"
    server_args = [*entrypoint, cmd[0], "--host", "127.0.0.1", "--port", str(port), "--metrics-port",
                   str(metrics_port), "--auth-token-file", "/run/secrets/token"]
    with log.open("w") as out:
        # No --user: the image's own USER runs the server.
        launcher = popen(["buildah", "run", "--isolation", "chroot", "--volume", f"{bundle}:/mnt/models:ro",
                          "--volume", f"{token}:/run/secrets/token:ro", container, "--", *server_args],
                         stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while check(target) != "SERVING":
            assert launcher.poll() is None, f"the server exited {launcher.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not SERVING after 180 s:\n{log.read_text()}"
            time.sleep(0.5)
        server = _server_process(psutil.Process(launcher.pid), deadline)
        assert server.uids().real == APP_UID
        assert server.parent().name() not in ("sh", "bash", "dash"), "a shell between the runtime and the server"

        # The image's own HEALTHCHECK command, run inside the container, with this run's port.
        health = config["Healthcheck"]["Test"]
        assert health[0] == "CMD"
        probe = _ok(["buildah", "run", "--isolation", "chroot", container, "--", *health[1:-1], target], timeout=120)
        assert "SERVING" in probe.stdout

        texts = reviews(data_dir, 8) + ["Un très beau livre.", "Décevant."]
        reference = Predictor(bundle, device="cpu")
        assert reference.graph == "model.int8.onnx"  # the CPU graph, as in the image
        # One text a request, one after the other: each is a batch of one on both sides, so the answers are equal.
        # (int8 quantizes activations with one scale per batch: rows batched differently differ by ~1e-3.)
        expected = [reference.predict([t])[0] for t in texts]
        with SentimentClient(target, token=TOKEN, timeout=60) as client:
            got = [client.classify([t])[0] for t in texts]
            assert client.metadata()["precision"] == "int8"  # the server says which graph it runs
        assert [r.label for r in got] == [e.label for e in expected]
        np.testing.assert_allclose([r.probabilities for r in got], [e.probabilities for e in expected], atol=1e-5)
        triton = _tritonclient(target, texts)  # one request of 10 texts, batched as the server batches them
        assert triton["live"] and triton["ready"] and triton["model_ready"]
        together = np.array([e.probabilities for e in reference.predict(texts)])
        np.testing.assert_allclose(triton["probabilities"], together, atol=5e-3)
        decided = np.abs(together[:, 0] - together[:, 1]) > 1e-2
        assert (np.array(triton["label"]) == np.array([e.label for e in expected]))[decided].all()
        assert triton["errors"]["no token"]["status"] == "StatusCode.UNAUTHENTICATED"

        server.send_signal(signal.SIGTERM)  # what the container runtime sends to PID 1
        assert launcher.wait(timeout=120) == 0, log.read_text()
        assert "stopped" in log.read_text()
        # onnxruntime's telemetry is off (no device id written, nothing uploaded): it warns when it cannot
        # persist its device id, which it would try here ($HOME is /nonexistent) if it were on.
        assert "telemetry" not in log.read_text().lower()
    finally:
        kill_group(launcher)


def test_bundled_target_bakes_the_bundle_in(build: list[str], tiny_bundle: Path) -> None:
    """`--target bundled --build-arg BUNDLE=...`: the bundle inside the image, loadable by the image's user."""
    context_bundle = REPO_ROOT / "runs" / f"container-test-{os.getpid()}" / "bundle"
    shutil.copytree(tiny_bundle, context_bundle)  # keeps the modes export gave it
    name = f"{IMAGE}-bundled"
    try:
        _ok([*build, "--target", "bundled", "--build-arg", f"BUNDLE={context_bundle.relative_to(REPO_ROOT)}",
             "-t", name, str(REPO_ROOT)], timeout=1200)
    finally:
        shutil.rmtree(context_bundle.parent)
    ctr = _ok(["buildah", "from", "--pull-never", name], timeout=120).stdout.strip()
    try:
        load = ("from serving.model.predictor import Predictor; "
                "print(Predictor('/mnt/models').predict(['Super.'])[0].label)")
        out = _ok(["buildah", "run", "--isolation", "chroot", ctr, "--", "python", "-c", load], timeout=300)
        assert out.stdout.strip() in json.loads((tiny_bundle / "manifest.json").read_text())["label_names"]
    finally:
        run(["buildah", "rm", ctr], timeout=120)
        run(["buildah", "rmi", name], timeout=120)


# ------------------------------------------------------------------------------------------------ the GPU image

GPU_IMAGE = "localhost/transfer-sentiment:test-gpu"
SITE = f"/opt/venv/lib/python{BASE_PYTHON}/site-packages"
PROVIDER = f"{SITE}/onnxruntime/capi/libonnxruntime_providers_cuda.so"
# Inside the image: what onnxruntime offers, the CUDA version it is built for, and the CUDA and cuDNN libraries the
# nvidia-* wheels installed (their sonames carry the major: libcudart.so.13, libcudnn.so.9).
GPU_FACTS = """
import glob, json, os, onnxruntime as o
from contract import runtime
libs = sorted(os.path.basename(p) for p in glob.glob("/opt/venv/lib/python*/site-packages/nvidia/*/lib/lib*.so.*"))
print(json.dumps({"providers": o.get_available_providers(), "cuda_version": o.cuda_version, "libraries": libs,
                  "problem": runtime.cuda_library_problem()}))
"""


def _soname_major(libraries: list[str], stem: str) -> int:
    (major,) = {int(name.split(".so.")[1].split(".")[0]) for name in libraries if name.startswith(stem + ".so.")}
    return major


@pytest.mark.slow
def test_gpu_image_holds_the_cuda_libraries_its_onnxruntime_is_built_for(
        base_image: str, tiny_bundle: Path, tmp_path: Path) -> None:
    """`--build-arg ORT_PACKAGE=onnxruntime-gpu`, on the same Debian base, the CUDA 13 and cuDNN 9 libraries from
    PyPI's nvidia-* wheels (no CUDA base image): non-root; onnxruntime offers CUDA; every library of its CUDA provider
    resolves except the driver's libcuda.so.1, which the node's NVIDIA container runtime mounts (there is no GPU
    here); the CUDA major of the image's libraries is onnxruntime's; the server asked for CUDA names that library.
    Slow: a 1.4 GB wheelhouse and a 2.5 GB image: 7 minutes on 2 cores (buildah caches the layers afterwards)."""
    build = _build_command(base_image, _wheelhouse("onnxruntime-gpu"))
    _ok([*build, "--build-arg", "ORT_PACKAGE=onnxruntime-gpu", "-t", GPU_IMAGE, str(REPO_ROOT)], timeout=3600)
    config = _config(GPU_IMAGE)
    assert config["User"] == f"{APP_UID}:{APP_UID}"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in config["Env"]
    ctr = _ok(["buildah", "from", "--pull-never", GPU_IMAGE], timeout=120).stdout.strip()
    try:
        def inside(*cmd: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
            return run(["buildah", "run", "--isolation", "chroot", "--volume", f"{tiny_bundle}:/mnt/models:ro", ctr,
                        "--", *cmd], timeout=timeout)

        assert inside("id", "-u").stdout.strip() == str(APP_UID)
        facts = json.loads(_ok(["buildah", "run", "--isolation", "chroot", ctr, "--", "python", "-c", GPU_FACTS],
                               timeout=300).stdout)
        assert "CUDAExecutionProvider" in facts["providers"], facts["providers"]
        major = int(facts["cuda_version"].split(".")[0])
        libraries = facts["libraries"]
        for stem in ("libcudart", "libcublas", "libcublasLt"):
            assert _soname_major(libraries, stem) == major, (stem, facts["cuda_version"], libraries)
        assert _soname_major(libraries, "libcudnn") == 9
        # Everything but the driver loads: the contract's own check says only libcuda.so.1 is missing.
        assert facts["problem"] is not None and "libcuda.so.1 is missing, the NVIDIA driver's library" in \
            facts["problem"], facts["problem"]

        ldd = inside("ldd", PROVIDER)
        assert ldd.returncode == 0, ldd.stderr
        unresolved = re.findall(r"^\s*(\S+) => not found", ldd.stdout, re.M)
        assert unresolved == ["libcuda.so.1"], ldd.stdout
        resolved = dict(re.findall(r"^\s*(\S+) => (\S+)", ldd.stdout, re.M))
        for soname in (f"libcudart.so.{major}", f"libcublas.so.{major}", f"libcublasLt.so.{major}"):
            assert "/site-packages/nvidia/" in resolved[soname], (soname, resolved.get(soname))

        refused = inside("python", "-m", "serving.server", "/mnt/models", "--device", "cuda", "--port", "0",
                         "--no-metrics")
        assert refused.returncode == 2, refused.stderr[-3000:]
        (line,) = [x for x in refused.stderr.splitlines() if x.startswith("sentiment-server: error:")]
        assert "libcuda.so.1" in line and "NVIDIA driver" in line, line
    finally:
        run(["buildah", "rm", ctr], timeout=120)
