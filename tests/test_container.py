"""The server's image (Containerfile), built and run as CI does (tests/images.py: no registry, a base made from
Debian's packages, buildah; its caches). The build installs offline from a wheelhouse made by the host's pip,
cached as the bases are."""

from __future__ import annotations

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
from images import cache, config, debian_base, key, locked, ok, wait_serving
from procs import free_port, kill_group, popen, run
from serving_fixtures import REPO_ROOT, reviews

from serving.client import SentimentClient
from serving.model.predictor import Predictor

sys.path.insert(0, str(REPO_ROOT / "deploy"))
from serve_requirements import serve_requirements

IMAGE = "localhost/transfer-sentiment:test"
SUITE = "bookworm"  # the base: Debian's python3 (3.11 in bookworm: the wheelhouse's Python below)
BASE_PYTHON = "3.11"
MMDEBSTRAP = ["--variant=essential", "--include=python3,python3-venv,libstdc++6",  # libstdc++: grpcio, onnxruntime
              *[f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "info", "locale")]]
APP_UID = 10001  # the Containerfile's USER
TOKEN = "container-test-token-0123456789"
TRITON_PYTHON = Path(os.environ.get("TRITON_PYTHON", REPO_ROOT / ".venv-triton" / "bin" / "python"))


@pytest.fixture(scope="module")
def base_image() -> str:
    """A Debian base image with python3, made by mmdebstrap (cached as a tarball) and imported into buildah."""
    return debian_base(SUITE, MMDEBSTRAP)


def _wheelhouse(ort_package: str) -> Path:
    """The server's wheels for the base's Python and this machine, downloaded by the host's pip. The GPU image's
    (onnxruntime-gpu with the CUDA and cuDNN wheels) is about 2 GB."""
    requirements = serve_requirements(REPO_ROOT / "pyproject.toml", ort_package)
    lock = (REPO_ROOT / "requirements.lock").read_text(encoding="utf-8")
    machine = platform.machine()
    folder = cache() / f"wheels-{key(requirements, lock, BASE_PYTHON, machine)}"
    with locked(folder.name):
        if not folder.is_dir():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            # pip matches manylinux_2_N exactly: every N the base's glibc (2.36 in bookworm) runs, and old aliases.
            tags = [f"manylinux_2_{n}" for n in range(36, 4, -1)] + ["manylinux2014", "manylinux2010", "manylinux1"]
            platforms = [a for tag in tags for a in ("--platform", f"{tag}_{machine}")]
            ok([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(partial), "--only-binary=:all:",
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
    """The default target of the Containerfile (built once at a time: tests/test_compose.py runs it too)."""
    with locked(IMAGE):
        ok([*build, "-t", IMAGE, str(REPO_ROOT)], timeout=1200)
    return IMAGE


@pytest.fixture
def container(image: str) -> Iterator[str]:
    ctr = ok(["buildah", "from", "--pull-never", image], timeout=120).stdout.strip()
    try:
        yield ctr
    finally:
        ok(["buildah", "rm", ctr], timeout=120)


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
    settings = config(image)
    assert settings["User"] == f"{APP_UID}:{APP_UID}"
    entrypoint, cmd = settings["Entrypoint"], settings["Cmd"]
    assert entrypoint[1:] == ["-m", "serving.server"], "exec form: the server itself is PID 1"
    assert cmd[0] == "/mnt/models"

    # The final stage holds the server and its dependencies, not the training stack.
    root = Path(ok(["buildah", "mount", container], timeout=60).stdout.strip())
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
                   str(metrics_port), "--http-port", str(free_port()), "--auth-token-file", "/run/secrets/token"]
    with log.open("w") as out:
        # No --user: the image's own USER runs the server.
        launcher = popen(["buildah", "run", "--isolation", "chroot", "--volume", f"{bundle}:/mnt/models:ro",
                          "--volume", f"{token}:/run/secrets/token:ro", container, "--", *server_args],
                         stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_serving(target, 180, launcher, log)
        server = _server_process(psutil.Process(launcher.pid), time.monotonic() + 60)
        assert server.uids().real == APP_UID
        assert server.parent().name() not in ("sh", "bash", "dash"), "a shell between the runtime and the server"

        # The image's own HEALTHCHECK command, run inside the container, with this run's port.
        health = settings["Healthcheck"]["Test"]
        assert health[0] == "CMD"
        probe = ok(["buildah", "run", "--isolation", "chroot", container, "--", *health[1:-1], target], timeout=120)
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
        ok([*build, "--target", "bundled", "--build-arg", f"BUNDLE={context_bundle.relative_to(REPO_ROOT)}",
            "-t", name, str(REPO_ROOT)], timeout=1200)
    finally:
        shutil.rmtree(context_bundle.parent)
    ctr = ok(["buildah", "from", "--pull-never", name], timeout=120).stdout.strip()
    try:
        load = ("from serving.model.predictor import Predictor; "
                "print(Predictor('/mnt/models').predict(['Super.'])[0].label)")
        out = ok(["buildah", "run", "--isolation", "chroot", ctr, "--", "python", "-c", load], timeout=300)
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
    ok([*build, "--build-arg", "ORT_PACKAGE=onnxruntime-gpu", "-t", GPU_IMAGE, str(REPO_ROOT)], timeout=3600)
    settings = config(GPU_IMAGE)
    assert settings["User"] == f"{APP_UID}:{APP_UID}"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in settings["Env"]
    ctr = ok(["buildah", "from", "--pull-never", GPU_IMAGE], timeout=120).stdout.strip()
    try:
        def inside(*cmd: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
            return run(["buildah", "run", "--isolation", "chroot", "--volume", f"{tiny_bundle}:/mnt/models:ro", ctr,
                        "--", *cmd], timeout=timeout)

        who = inside("id", "-u")
        assert who.stdout.strip() == str(APP_UID), (who.returncode, who.stderr)  # once empty in CI, nothing said
        facts = json.loads(ok(["buildah", "run", "--isolation", "chroot", ctr, "--", "python", "-c", GPU_FACTS],
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
