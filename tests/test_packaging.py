"""Packaging off this machine: the onnxruntime package each platform gets, the torch build `make` installs, and the
Python the package claims. The wheel itself, built and installed one extra at a time: tests/test_wheel.py.

pip runs against PyPI with this machine's own pip configuration switched off (no pip.conf, no PIP_FIND_LINKS), as on
a stock machine: here, that configuration supplies torch's CPU build from local disk and would hide the question.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from serving_fixtures import REPO_ROOT

ORT = ("onnxruntime", "onnxruntime-gpu")
# (pip platform tag, marker environment, the package it must get). PyPI has onnxruntime-gpu wheels for Linux
# x86_64 and Windows x64 only (plus Linux aarch64 for glibc >= 2.34, which a marker cannot see).
PLATFORMS = [
    ("manylinux_2_28_x86_64", {"sys_platform": "linux", "platform_machine": "x86_64"}, "onnxruntime-gpu"),
    ("win_amd64", {"sys_platform": "win32", "platform_machine": "AMD64"}, "onnxruntime-gpu"),
    ("manylinux_2_28_aarch64", {"sys_platform": "linux", "platform_machine": "aarch64"}, "onnxruntime"),
    ("macosx_14_0_arm64", {"sys_platform": "darwin", "platform_machine": "arm64"}, "onnxruntime"),
    ("win_arm64", {"sys_platform": "win32", "platform_machine": "ARM64"}, "onnxruntime"),
]


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _extras() -> dict[str, list[str]]:
    return _pyproject()["project"]["optional-dependencies"]


def _pin(name: str) -> str:
    for line in (REPO_ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines():
        req = line.split("#")[0].strip()
        if req and Requirement(req).name == name:
            return req.split(";")[0].strip()
    raise AssertionError(f"{name} is not pinned in requirements.lock")


def _stock_pip(*args: str, timeout: float = 300,
               python: str | Path = sys.executable) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf at all
    return subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO_ROOT)


@pytest.mark.parametrize("extra", ["serve", "train"])
@pytest.mark.parametrize(("tag", "platform", "expected"), PLATFORMS, ids=[p[0] for p in PLATFORMS])
def test_markers_give_each_platform_exactly_one_onnxruntime(extra: str, tag: str, platform: dict[str, str],
                                                             expected: str) -> None:
    env = {**default_environment(), **platform}
    chosen = [r.name for r in map(Requirement, _extras()[extra])
              if r.name in ORT and (r.marker is None or r.marker.evaluate(env))]
    assert chosen == [expected]


@pytest.mark.parametrize(("tag", "platform", "expected"), PLATFORMS, ids=[p[0] for p in PLATFORMS])
def test_the_chosen_onnxruntime_has_a_wheel_there_and_the_other_one_may_not(tag: str, platform: dict[str, str],
                                                                             expected: str, tmp_path: Path) -> None:
    def dry_run(name: str) -> subprocess.CompletedProcess[str]:
        return _stock_pip("install", "--dry-run", "--ignore-installed", "--no-deps", "--target", str(tmp_path),
                          "--only-binary=:all:", "--platform", tag, "--python-version", "3.12", _pin(name))

    out = dry_run(expected)
    assert out.returncode == 0 and "Would install" in out.stdout, out.stderr
    if expected == "onnxruntime":  # why the marker exists: the GPU package does not install there
        assert dry_run("onnxruntime-gpu").returncode != 0


def _fake_torch_index(root: Path, version: str) -> str:
    """A package index holding only a torch wheel `version` with no dependencies: stands in for torch's own index
    (download.pytorch.org/whl/cpu, unreachable here). Resolution reads the wheel's metadata, not its code."""
    name = f"torch-{version}"
    wheel = root / "torch" / f"{name}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")
    (wheel.parent / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n', encoding="utf-8")
    return root.as_uri()


def _make_torch_pip(torch_index: str) -> list[str]:
    out = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-torch-pip: ; @echo $(TORCH_PIP)",
                          "print-torch-pip", f"TORCH_INDEX={torch_index}"], capture_output=True, text=True,
                         timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _resolved_torch(torch_pip: list[str], tmp_path: Path) -> str:
    """The torch version pip picks for `make setup`'s torch step (its dependencies left out: resolving the CUDA
    build's 15 NVIDIA packages takes most of a minute and shows nothing more than the version does)."""
    report = tmp_path / "report.json"
    out = _stock_pip("install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report", str(report),
                     "-c", "requirements.lock", *torch_pip, "torch")
    assert out.returncode == 0, out.stderr
    return next(i["metadata"]["version"] for i in json.loads(report.read_text())["install"])


def test_torch_index_gives_the_cpu_build_where_pypi_gives_cuda(tmp_path: Path) -> None:
    """`make setup`'s torch step (TORCH_PIP from the Makefile) on a stock machine: PyPI alone resolves the pin to
    its own build (CUDA, on Linux x86_64); with TORCH_INDEX the index's +cpu build wins."""
    torch_pin = _pin("torch").split("==")[1]
    assert _resolved_torch(_make_torch_pip(""), tmp_path) == torch_pin  # what a stock machine got before
    index = _fake_torch_index(tmp_path / "index", f"{torch_pin}+cpu")
    torch_pip = _make_torch_pip(index)
    assert torch_pip == ["--extra-index-url", index]
    assert _resolved_torch(torch_pip, tmp_path) == f"{torch_pin}+cpu"


@pytest.mark.parametrize("ort", ORT)
def test_image_requirements_name_the_chosen_onnxruntime_once(ort: str) -> None:
    """The Containerfile's build stage installs these (deploy/serve_requirements.py): the serve extra and the base
    dependencies, with the onnxruntime package of the build argument in place of the platform-marked pair."""
    sys.path.insert(0, str(REPO_ROOT / "deploy"))
    from serve_requirements import serve_requirements

    reqs = [Requirement(r) for r in serve_requirements(REPO_ROOT / "pyproject.toml", ort)]
    (spec,) = {str(r.specifier) for r in map(Requirement, _extras()["serve"]) if r.name in ORT}
    (chosen,) = [r for r in reqs if r.name in ORT]
    assert (chosen.name, str(chosen.specifier)) == (ort, spec)
    # The GPU image gets the CUDA and cuDNN libraries onnxruntime-gpu is built for, as the `gpu` extra asks.
    assert chosen.extras == ({"cuda", "cudnn"} if ort == "onnxruntime-gpu" else set())
    # pip evaluates what markers are left (uvloop: not on Windows) in the image, a Linux one: each holds there
    linux = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}
    assert chosen.marker is None and all(r.marker is None or r.marker.evaluate(linux) for r in reqs)
    names = {r.name for r in reqs}
    assert {Requirement(r).name for r in _extras()["serve"]} - set(ORT) <= names
    assert "torch" not in names


# ------------------------------------------------------------------------------ the GPU install's CUDA major

def _lock_version(name: str) -> Version:
    return Version(_pin(name).split("==")[1])


def _onnxruntime_gpu_build() -> tuple[int, list[Requirement]]:
    """The CUDA major the installed onnxruntime-gpu is built for and its `cuda` + `cudnn` extras' requirements; the
    installed one is the lock's (make setup installs through it)."""
    import onnxruntime

    if importlib.metadata.version("onnxruntime-gpu") != str(_lock_version("onnxruntime-gpu")):
        pytest.skip("the installed onnxruntime-gpu is not the lock's")
    cuda = getattr(onnxruntime, "cuda_version", "")
    assert cuda, "onnxruntime-gpu without a CUDA version"
    requires = [Requirement(r) for r in importlib.metadata.requires("onnxruntime-gpu") or []]
    extras = [r for r in requires if r.marker is not None and any(
        r.marker.evaluate({**default_environment(), "extra": e}) for e in ("cuda", "cudnn"))]
    return int(cuda.split(".")[0]), extras


def test_gpu_pins_are_the_cuda_major_onnxruntime_gpu_is_built_for() -> None:
    """The nvidia-* pins of requirements.lock (what `make setup` on a GPU node and the GPU image install) satisfy
    onnxruntime-gpu's own `cuda` and `cudnn` extras, and are of the CUDA major its CUDA provider was built for:
    a CUDA 12 runtime beside a CUDA 13 onnxruntime is the provider that never loads."""
    major, extras = _onnxruntime_gpu_build()
    names = {r.name for r in extras}
    assert {"nvidia-cuda-runtime", "nvidia-cudnn-cu13" if major == 13 else f"nvidia-cudnn-cu{major}"} <= names
    for r in extras:
        assert r.specifier.contains(_lock_version(r.name)), f"requirements.lock's {_pin(r.name)} against {r}"
    for library in ("nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-nvrtc"):
        assert _lock_version(library).major == major, f"{_pin(library)}: onnxruntime-gpu is built for CUDA {major}"
    assert any(r.name == f"nvidia-cudnn-cu{major}" for r in extras), f"no cuDNN for CUDA {major} in the extras"
    assert _lock_version(f"nvidia-cudnn-cu{major}").major == 9  # the provider loads libcudnn.so.9


def _metadata_requires(pins: list[str], tmp_path: Path) -> dict[str, list[Requirement]]:
    """PyPI packages' Requires-Dist for Linux x86_64 and Python 3.12, read from their metadata (no download)."""
    report = tmp_path / "report.json"
    out = _stock_pip("install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report", str(report),
                     "--target", str(tmp_path / "t"), "--only-binary=:all:", "--python-version", "3.12",
                     "--platform", "manylinux_2_28_x86_64", *pins)
    assert out.returncode == 0, out.stderr
    return {i["metadata"]["name"]: [Requirement(r) for r in i["metadata"].get("requires_dist", [])]
            for i in json.loads(report.read_text())["install"]}


def test_torch_cuda_build_pins_the_same_libraries(tmp_path: Path) -> None:
    """PyPI's torch (the build `make setup TORCH_INDEX=` takes on Linux x86_64) pins its CUDA libraries exactly, via
    cuda-toolkit's extras: requirements.lock's GPU pins must be those versions, so that one set of nvidia-* wheels
    serves torch and onnxruntime (two versions of one package cannot be installed), and of onnxruntime's CUDA."""
    major, ort_extras = _onnxruntime_gpu_build()
    linux = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux",
             "platform_machine": "x86_64", "python_version": "3.12"}
    requires = _metadata_requires([_pin("torch"), _pin("cuda-toolkit")], tmp_path)
    torch_requires = [r for r in requires["torch"] if r.marker is None or r.marker.evaluate({**linux, "extra": ""})]
    (toolkit,) = [r for r in torch_requires if r.name == "cuda-toolkit"]
    assert toolkit.specifier.contains(_lock_version("cuda-toolkit"))
    assert _lock_version("cuda-toolkit").major == major, f"torch {_pin('torch')} is a CUDA {toolkit} build"
    pinned_by_torch = [r for r in torch_requires if r.name.startswith("nvidia-")]
    pinned_by_torch += [r for r in requires["cuda-toolkit"] if r.marker is not None and any(
        r.marker.evaluate({**linux, "extra": e}) for e in toolkit.extras)]
    for r in pinned_by_torch:
        assert r.specifier.contains(_lock_version(r.name)), f"requirements.lock's {_pin(r.name)} against torch's {r}"
    assert {r.name for r in ort_extras} <= {r.name for r in pinned_by_torch}, "onnxruntime needs a library torch lacks"


@pytest.mark.parametrize(("torch_index", "gpu"), [("https://download.pytorch.org/whl/cpu", False),
                                                  ("https://download.pytorch.org/whl/cpu/", False),
                                                  ("https://download.pytorch.org/whl/cu130", True), ("", True)])
def test_make_setup_adds_the_gpu_extra_with_a_cuda_torch(torch_index: str, gpu: bool) -> None:
    out = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-extras: ; @echo $(EXTRAS)",
                          "print-extras", f"TORCH_INDEX={torch_index}"], capture_output=True, text=True, timeout=60,
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    extras = out.stdout.strip().split(",")
    assert set(extras) - {"gpu"} == {"train", "serve", "dev", "trackers"} and ("gpu" in extras) == gpu
    assert set(extras) <= set(_extras())


def test_the_torch_index_serves_torch_alone() -> None:
    """Each pip install given TORCH_INDEX (`make setup`, `make lock`, Containerfile.train) asks it for torch alone,
    --no-deps: with it as an extra index for a whole resolution, any package of the same name there would compete
    with PyPI's (and where it is unreachable, each package cost a round of retries)."""
    index = "https://example.invalid/whl/cpu"
    asked = []
    for target in (".venv/.installed", "lock"):
        out = subprocess.run(["make", "-n", "-B", "--no-print-directory", target, f"TORCH_INDEX={index}"],
                             capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert out.returncode == 0, out.stderr
        asked += [line.split() for line in out.stdout.splitlines() if "pip install" in line and index in line]
    recipe = (REPO_ROOT / "Containerfile.train").read_text(encoding="utf-8").replace("\\\n", " ")
    asked += [cmd.split() for cmd in recipe.split("&&") if "pip install" in cmd and "TORCH_INDEX:+" in cmd]
    assert len(asked) == 3, asked
    for words in asked:
        assert "--no-deps" in words and words[-1].split("==")[0] == "torch", " ".join(words)


# ------------------------------------------------------------------------------ the package as a user installs it

# Standard-library modules newer than some Python we might claim: (module, the first Python that has it).
NEWER_STDLIB = {"tomllib": (3, 11), "wsgiref.types": (3, 11), "annotationlib": (3, 14), "compression": (3, 14),
                "string.templatelib": (3, 14)}
SOURCES = ("contract", "trainer", "serving", "tests", "bench", "deploy")  # every Python file of the repo
HEAVY = {"torch", "deepspeed", "onnxruntime", "onnxruntime-gpu", "onnx", "numpy", "sentencepiece"}


def test_requires_python_is_the_lowest_python_the_code_and_its_pins_run_on() -> None:
    """requires-python's floor is ruff's target, parses every file of the repo, and is exactly what the code's
    imports of newer stdlib modules and the pinned dependencies' own Requires-Python need: lower, and pip installs
    the package where it cannot run; higher, and it refuses a Python that works."""
    pyproject = _pyproject()
    (floor,) = [Version(s.version) for s in SpecifierSet(pyproject["project"]["requires-python"]) if s.operator == ">="]
    lowest = (floor.major, floor.minor)
    assert pyproject["tool"]["ruff"]["target-version"] == f"py{floor.major}{floor.minor}"
    needs: dict[str, tuple[int, int]] = {}  # what needs a newer Python than 3.8 -> that Python
    for path in sorted(p for folder in SOURCES for p in (REPO_ROOT / folder).rglob("*.py")):
        where = str(path.relative_to(REPO_ROOT))
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), where, feature_version=lowest)
        except SyntaxError as e:
            needs[f"{where}:{e.lineno}: syntax"] = (99, 0)
            continue
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for module in modules:
                for name, version in NEWER_STDLIB.items():
                    if module == name or module.startswith(name + "."):
                        needs[f"{where}:{node.lineno}: import {module}"] = version
    for line in (REPO_ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines():
        req = line.split("#")[0].strip()
        if not req:
            continue
        try:
            spec = importlib.metadata.metadata(Requirement(req).name).get("Requires-Python")
        except importlib.metadata.PackageNotFoundError:
            continue  # pinned for another machine (the GPU's)
        if spec:
            needs[f"requirements.lock: {req} (Requires-Python {spec})"] = next(
                (3, minor) for minor in range(8, 30) if SpecifierSet(spec).contains(f"3.{minor}"))
    too_new = [what for what, version in needs.items() if version > lowest]
    assert not too_new, f"requires-python {floor} is below what these need:\n" + "\n".join(too_new)
    assert max(needs.values()) == lowest, f"nothing needs Python {floor}: claim the lowest one that works"


def test_the_client_imports_no_numpy_onnxruntime_or_torch() -> None:
    """What the `client` extra leaves out, serving.client must not import (checked here in the full venv, fast;
    tests/test_wheel.py's fresh virtualenv proves it installs and runs without them)."""
    out = subprocess.run([sys.executable, "-c", "import sys, serving.client; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert not {m.split(".")[0] for m in out.stdout.split()} & {m.replace("-", "_") for m in HEAVY}


def test_the_citation_names_the_packages_version_and_license() -> None:
    """CITATION.cff (what GitHub's "Cite this repository" reads) says the version and license pyproject.toml says."""
    import yaml

    citation = yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert citation["cff-version"] == "1.2.0"
    assert (citation["version"], citation["license"]) == (project["version"], project["license"])

