"""The training image (Containerfile.train): its CPU variant built with buildah as CI does and run as its non-root
user; its CUDA variant's logic checked without building it (its wheels are gigabytes).

The CPU variant (slow: `make test-slow`) builds offline from a wheelhouse made by the host's pip (torch's CPU
build, the `train` extra for the base's Python, and DeepSpeed's wheel built here from its sdist), on the Debian base
that tests/test_container.py makes with mmdebstrap (the same cached image). Inside it, `python -m trainer params
--preset lab` prints the lab's parameter table, and a two-step pretraining run writes its checkpoint and artifact
into a mounted folder, both as user 10001 with no writable home but /tmp. The CUDA variant: PyPI's torch wheel
metadata (read by pip's resolver without downloading the wheel) names the CUDA major that the Makefile's base image
and the build's own check must agree with.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
from pathlib import Path

import pytest
from images import cache, key, need, ok
from procs import REPO, free_port, run
from test_container import base_image  # noqa: F401  (the shared fixture)

sys.path.insert(0, str(REPO / "deploy"))
from train_image import torch_problem, train_requirements

IMAGE = "localhost/transfer-sentiment-train:test"
BASE_PYTHON = "3.11"  # the mmdebstrap base's python3 (bookworm)
APP_UID = 10001  # Containerfile.train's USER


def _torch_pin() -> str:
    lock = (REPO / "requirements.lock").read_text(encoding="utf-8")
    return re.search(r"^torch==(\S+)$", lock, re.M).group(1)


@pytest.fixture(scope="module")
def train_wheelhouse() -> Path:
    """Every wheel the CPU variant installs, for the base's Python and this machine: torch's CPU build (pip's
    configuration may offer it from a local folder; else the CPU index), the `train` extra from PyPI, and
    DeepSpeed's wheel, built here from its sdist against the host's torch (pure Python: its ops compile at run
    time)."""
    requirements = train_requirements(REPO / "pyproject.toml", "onnxruntime")
    lock = (REPO / "requirements.lock").read_text(encoding="utf-8")
    machine = platform.machine()
    folder = cache() / f"train-wheels-{key(requirements, lock, BASE_PYTHON, machine)}"
    if folder.is_dir():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    pip = [sys.executable, "-m", "pip"]
    ok([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(partial),
        "--constraint", str(REPO / "requirements.lock"), "deepspeed"], timeout=600)
    platforms = [a for tag in ("manylinux_2_28", "manylinux_2_17", "manylinux2014")
                 for a in ("--platform", f"{tag}_{machine}")]
    target = ["--only-binary=:all:", *platforms, "--python-version", BASE_PYTHON, "--implementation", "cp"]
    ok([*pip, "download", "--quiet", "--dest", str(partial), *target, "--no-deps", "--extra-index-url",
        "https://download.pytorch.org/whl/cpu", f"torch=={_torch_pin()}"], timeout=900)
    # The rest, with DeepSpeed's dependencies (torch's among them) but not DeepSpeed's sdist (its wheel is already
    # there), from PyPI: the CPU index gives torch alone, as in the image's build.
    ok([*pip, "download", "--quiet", "--dest", str(partial), *target, "--find-links", str(partial),
        "--constraint", str(REPO / "requirements.lock"), *requirements], timeout=900)
    partial.rename(folder)
    return folder


@pytest.fixture(scope="module")
def train_image(base_image: str, train_wheelhouse: Path) -> str:  # noqa: F811
    ok(["buildah", "bud", "--isolation", "chroot", "--layers", "--force-rm", "--format", "docker", "--quiet",
        "--build-arg", f"BASE_IMAGE={base_image}", "--build-arg", "PIP_NO_INDEX=1",
        "--build-arg", "PIP_FIND_LINKS=/wheels", "--volume", f"{train_wheelhouse}:/wheels:ro",
        "-f", str(REPO / "Containerfile.train"), "-t", IMAGE, str(REPO)], timeout=1800)
    return IMAGE


@pytest.mark.slow  # minutes: a build from cached layers took 150 s here, a first one (wheels, torch) about 9 min
def test_the_cpu_image_trains_as_a_non_root_user(train_image: str, tiny_tokenizer_dir: Path, data_dir: Path,
                                                 tmp_path: Path) -> None:
    config = json.loads(ok(["buildah", "inspect", "--type", "image", train_image], timeout=60).stdout)
    config = config["Docker"]["config"]
    assert config["User"] == f"{APP_UID}:{APP_UID}" and config["Entrypoint"][1:] == ["-m", "trainer"]
    ctr = ok(["buildah", "from", "--pull-never", train_image], timeout=120).stdout.strip()
    try:
        root = Path(ok(["buildah", "mount", ctr], timeout=60).stdout.strip())
        try:
            site = next((root / "opt" / "venv" / "lib").glob("python3*/site-packages"))
            installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
            assert {"torch", "deepspeed", "sentencepiece", "onnxruntime", "tensorboard"} <= installed
            assert not installed & {"grpcio_health_checking", "onnxruntime_gpu", "pip", "transfer_sentiment"}
            torch_version = next(site.glob("torch-*.dist-info")).name.removesuffix(".dist-info").split("-")[1]
            assert torch_version == f"{_torch_pin()}+cpu"  # the CPU build, the lock's version
            assert sorted(p.name for p in (root / "opt" / "app").iterdir()) == ["contract", "launch", "trainer"]
        finally:
            run(["buildah", "umount", ctr], timeout=60)

        entry = [*config["Entrypoint"]]
        params = ok(["buildah", "run", "--isolation", "chroot", ctr, "--", *entry, "params", "--preset", "lab"],
                    timeout=300)
        assert "21,018,401" in params.stdout and "10,968,602" in params.stdout, params.stdout
        who = ok(["buildah", "run", "--isolation", "chroot", ctr, "--", "/opt/venv/bin/python", "-c",
                  "import os; print(os.getuid(), os.getgid(), os.environ['HOME'])"], timeout=120)
        assert who.stdout.split() == [str(APP_UID), str(APP_UID), "/tmp"]

        # A run writes only into its --out folder (and /tmp): the mounted folder is the one writable place.
        out = tmp_path / "runs"
        out.mkdir()
        out.chmod(0o777)
        port = free_port()  # `buildah run --isolation chroot` shares this machine's network: a free loopback port
        train = ok(["buildah", "run", "--isolation", "chroot", "--env", f"MASTER_PORT={port}",
                    "--volume", f"{data_dir}:/data:ro", "--volume", f"{tiny_tokenizer_dir}:/tokenizer:ro",
                    "--volume", f"{out}:/runs", ctr, "--", *entry, "pretrain", "--preset", "tiny",
                    "--tokenizer", "/tokenizer", "--set", "data.root=/data", "--set", "pretrain.max_steps=2",
                    "--resume", "auto", "--out", "/runs/tiny"], timeout=600)
        assert "artifact: /runs/tiny/artifact" in train.stdout, train.stdout + train.stderr[-3000:]
        assert (out / "tiny" / "checkpoints" / "latest").read_text().strip() == "step00000002"
        assert (out / "tiny" / "artifact" / "model.safetensors").stat().st_uid == APP_UID
    finally:
        run(["buildah", "rm", ctr], timeout=120)
        run(["buildah", "rmi", train_image], timeout=300)


# ----------------------------------------------------------------------------------------- the CUDA variant


def _makefile_var(name: str) -> str:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return re.search(rf"^{name} \?=[ \t]*(.*)$", text, re.M).group(1).strip()


def test_the_cuda_variant_pairs_torchs_cuda_major_with_its_base(tmp_path: Path) -> None:
    """PyPI's torch wheel for the CUDA variant (TORCH_INDEX empty) requires NVIDIA's libraries of one CUDA major;
    the Makefile's base image is a devel image of that major, so the build's own check passes for it."""
    need("buildah")  # the same prerequisites as the image tests (network to PyPI for the metadata)
    base, index = _makefile_var("TRAIN_CUDA_BASE"), _makefile_var("TRAIN_CUDA_TORCH_INDEX")
    assert index == "", "the CUDA variant takes PyPI's own build"
    ubuntu_python = "3.12"  # ubuntu24.04's python3, which the base stage installs
    report = tmp_path / "report.json"
    # --dry-run --report: pip resolves from the wheel's metadata file (PEP 658) without downloading the wheel.
    # --isolated: this machine's pip configuration (a local folder of CPU builds) does not apply.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    ok([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--no-deps",
        "--quiet", "--report", str(report), "--only-binary=:all:", "--python-version", ubuntu_python,
        "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--target", str(tmp_path / "t"),
        *(["--cert", os.environ["PIP_CERT"]] if os.environ.get("PIP_CERT") else []),
        f"torch=={_torch_pin()}"], timeout=600, env=env)
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["version"] == _torch_pin()  # no local label: PyPI's own build
    needs = item["metadata"]["requires_dist"]
    majors = {int(m) for r in needs for m in re.findall(r"^nvidia-[a-z-]+-cu(\d+)\b", r)}
    toolkit = [r for r in needs if r.startswith("cuda-toolkit")]
    assert len(majors) == 1 and toolkit, needs
    (major,) = majors
    assert re.search(r"==\s*(\d+)\.", toolkit[0]).group(1) == str(major), toolkit
    base_major = int(re.search(r"nvidia/cuda:(\d+)\.\d+\.\d+-devel-ubuntu24\.04$", base).group(1))
    assert base_major == major, f"{base}: CUDA {base_major}, but torch {_torch_pin()} from PyPI needs CUDA {major}"
    # The build's check (deploy/train_image.py check-torch) with that torch on that base passes, and catches a
    # mismatch either way.
    assert torch_problem(f"{major}.0", index, base_major) == ""
    assert "nvcc is CUDA 12" in torch_problem(f"{major}.0", index, 12)
    assert "no nvcc" in torch_problem(f"{major}.0", index, None)
    assert "asks for the CPU build" in torch_problem(f"{major}.0", "https://download.pytorch.org/whl/cpu", None)
    assert torch_problem(None, "https://download.pytorch.org/whl/cpu", None) == ""
