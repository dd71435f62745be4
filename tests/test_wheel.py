"""The wheel is the product: `python -m build` makes the sdist and, from it, the wheel a user installs. The wheel
holds every file the packages read at run time (each module, the generated gRPC code and its types, the proto files),
says who wrote it and what it is (authors, keywords, classifiers), and, installed into fresh virtualenvs, each extra
runs its own command while the others say in one line which extra they need.

The `client` virtualenv installs from PyPI with this machine's pip configuration off, as a stock machine has it
(tests/test_packaging.py says why). The slow tests install the `serve` and `train` extras with it on, which serves
torch's CPU build from local disk, through requirements.lock's pins: one extra per virtualenv, so that neither hides
a dependency the other forgot (about one and two minutes on 2 cores, most of it pip).
"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trove_classifiers
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from serving_fixtures import LISTENING, REPO_ROOT, running_server
from test_packaging import HEAVY, _pyproject, _stock_pip

PACKAGES = ("contract", "serving", "trainer")  # the import packages; the rest of the checkout is not installed
# The proto files, the gRPC API, ship in the package beside the code generated from them (pyproject.toml's
# package-dir): a checkout's proto/X is the wheel's serving/proto/X.
PROTO, PROTO_IN_WHEEL = "proto", "serving/proto"
PINS = ("-c", str(REPO_ROOT / "requirements.lock"))


def _checkout_files() -> list[str]:
    """The checkout as `git clone` would give it, with files not yet committed (those git does not ignore)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    return sorted(f for f in out.stdout.split("\0") if f and (REPO_ROOT / f).is_file())  # deleted, not committed


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`python -m build` (the sdist, then the wheel from the unpacked sdist) on a copy of the checkout: building in
    the repo would write build/ and *.egg-info there, under other tests reading the tree. No network: the venv's
    setuptools (--no-isolation)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, src / name)
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr
    (wheel,) = out.glob("*.whl")
    assert len(list(out.glob("*.tar.gz"))) == 1, "python -m build made no sdist"
    return {"src": src, "wheel": wheel}


@pytest.fixture(scope="module")
def wheel(dist: dict[str, Path]) -> Path:
    return dist["wheel"]


def _venv(path: Path) -> Path:
    """A fresh virtualenv (no system site-packages): its bin/."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path / "bin"


def _pip(bin_: Path, *args: str, timeout: float = 600) -> None:
    """pip of the virtualenv at `bin_`, with this machine's pip configuration."""
    done = subprocess.run([str(bin_ / "python"), "-m", "pip", "install", "--quiet", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]


def _installed(bin_: Path) -> set[str]:
    listed = _stock_pip("list", "--format", "json", python=bin_ / "python")
    return {d["name"].lower() for d in json.loads(listed.stdout)}


def _env() -> dict[str, str]:
    """The environment of a command of a virtualenv: no PYTHONPATH, so the venv's package runs, not the checkout's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def _run(bin_: Path, command: str, *args: str | Path, cwd: Path,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_ / command), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=cwd)


@pytest.fixture(scope="module")
def client_bin(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install 'transfer-sentiment[client]'` into a fresh virtualenv, from PyPI as a stock machine has it:
    grpcio and protobuf, none of torch, onnxruntime or numpy."""
    bin_ = _venv(tmp_path_factory.mktemp("client") / "venv")
    install = _stock_pip("install", "--quiet", f"{wheel}[client]", python=bin_ / "python")
    assert install.returncode == 0, install.stderr
    installed = _installed(bin_)
    assert {"transfer-sentiment", "grpcio", "protobuf"} <= installed and not installed & HEAVY, installed
    return bin_


# ------------------------------------------------------------------------------ what the wheel holds and says


def test_the_wheel_holds_every_file_the_packages_read(dist: dict[str, Path]) -> None:
    """Every file of the package folders (modules, the generated gRPC code and its .pyi types) and the proto files,
    byte for byte, and nothing else: a package left out of pyproject.toml's `packages`, or a data file of a package
    left out of its `package-data`, is a file missing here. The wheel is built from the sdist, so the sdist has
    them too."""
    src = dist["src"]
    want = {str(p.relative_to(src)): p for name in PACKAGES for p in (src / name).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    want |= {f"{PROTO_IN_WHEEL}/{p.relative_to(src / PROTO)}": p for p in (src / PROTO).rglob("*.proto")}
    assert {"serving/proto/sentiment/v1/sentiment_service.proto", "serving/proto/inference/grpc_service.proto",
            "serving/gen/sentiment/v1/sentiment_service_pb2.pyi",
            "serving/gen/sentiment/v1/sentiment_service_pb2_grpc.py"} <= set(want)
    with zipfile.ZipFile(dist["wheel"]) as z:
        got = {n for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
        missing, extra = sorted(set(want) - got), sorted(got - set(want))
        assert not missing, ("not in the wheel (a package: pyproject.toml's [tool.setuptools] packages; another "
                             f"file: its package-data): {missing}")
        assert not extra, f"in the wheel but not in the package folders: {extra}"
        changed = [n for n, p in want.items() if z.read(n) != p.read_bytes()]
    assert not changed, changed


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        info = f"transfer_sentiment-{_pyproject()['project']['version']}.dist-info"
        return email.message_from_bytes(z.read(f"{info}/METADATA"))


def test_the_wheel_carries_the_license_and_the_python_it_needs(wheel: Path) -> None:
    meta = _metadata(wheel)
    with zipfile.ZipFile(wheel) as z:
        info = f"transfer_sentiment-{_pyproject()['project']['version']}.dist-info"
        assert z.read(f"{info}/licenses/LICENSE") == (REPO_ROOT / "LICENSE").read_bytes()
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert meta["Requires-Python"] == _pyproject()["project"]["requires-python"]
    client = [r for r in map(Requirement, meta.get_all("Requires-Dist")) if r.marker is not None
              and r.marker.evaluate({**default_environment(), "extra": "client"})]
    assert sorted(r.name for r in client) == ["grpcio", "protobuf"]


def test_the_wheel_names_its_authors_keywords_and_classifiers(wheel: Path) -> None:
    """Authors and keywords are CITATION.cff's (what GitHub's "Cite this repository" reads); its addresses, where it
    gives any (`url`, `repository-code`), are the project's URLs, and no other address is made up; each classifier
    is a valid trove classifier, none deprecated, and the Pythons it names are those requires-python admits."""
    citation = yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    meta = _metadata(wheel)
    names = [a.get("name") or f"{a['given-names']} {a['family-names']}" for a in citation["authors"]]
    assert meta["Author"] == ", ".join(names)
    assert meta["Keywords"].split(",") == citation["keywords"]
    urls = {k: v for k, v in (("Homepage", citation.get("url")), ("Source", citation.get("repository-code"))) if v}
    assert dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or []) == urls
    classifiers = meta.get_all("Classifier")
    assert classifiers and classifiers == sorted(classifiers)
    invalid = [c for c in classifiers if c not in trove_classifiers.classifiers]
    assert not invalid, f"not trove classifiers: {invalid}"
    assert not set(classifiers) & set(trove_classifiers.deprecated_classifiers)
    floor = _pyproject()["project"]["requires-python"].removeprefix(">=")
    pythons = [c.rsplit(" :: ", 1)[1] for c in classifiers
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert pythons and pythons[0] == floor, (pythons, floor)


# ------------------------------------------------------------------------------ installed, one extra at a time


def _says_it_needs(out: subprocess.CompletedProcess[str], command: str, extra: str) -> None:
    """`out` is `command`'s one line for a missing `extra` (whichever of its modules is imported first), exit 2."""
    line = (rf"error: {re.escape(command)} needs the '{extra}' extra \(no module named '[\w.]+'\): "
            rf"pip install 'transfer-sentiment\[{extra}\]'\n")
    assert out.returncode == 2 and out.stdout == "" and re.fullmatch(line, out.stderr), (out.returncode, out.stderr)


def test_each_command_names_the_extra_it_lacks(wheel: Path, client_bin: Path, tiny_bundle: Path,
                                               tmp_path: Path) -> None:
    """With the `client` extra alone, `sentiment-server` and `transfer-sentiment` end with one line naming their
    extra and exit 2 (their --help still works); with no extra, `sentiment-client` does the same. A traceback is
    no answer to a user who installed the wrong extra."""
    for command, args, extra in [("sentiment-server", [tiny_bundle], "serve"),
                                 ("transfer-sentiment", ["params", "--preset", "lab"], "train")]:
        _says_it_needs(_run(client_bin, command, *args, cwd=tmp_path), command, extra)
        helped = _run(client_bin, command, "--help", cwd=tmp_path)
        assert helped.returncode == 0 and helped.stdout.startswith("usage: "), helped.stderr
    bare = _venv(tmp_path / "bare")
    _pip(bare, "--no-index", str(wheel))  # no extra: the package alone, no dependency
    assert _installed(bare) - {"pip", "setuptools"} == {"transfer-sentiment"}
    out = _run(bare, "sentiment-client", "--target", "127.0.0.1:1", "Super.", cwd=tmp_path)
    _says_it_needs(out, "sentiment-client", "client")


def test_the_client_extra_alone_classifies_with_a_real_server(client_bin: Path, tiny_bundle: Path, predictor,
                                                              tmp_path: Path) -> None:
    """The `client` virtualenv's `sentiment-client` classifies with a server of the full install, and gets the
    server's own answers."""
    helped = _run(client_bin, "sentiment-client", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: "), helped.stderr
    version = _run(client_bin, "sentiment-client", "--version", cwd=tmp_path).stdout
    assert version == f"sentiment-client {_pyproject()['project']['version']}\n"
    texts = ["Un livre magnifique.", "Ennuyeux, je n'ai pas fini."]
    with running_server(tiny_bundle, device="cpu") as server:
        answered = _run(client_bin, "sentiment-client", "--target", f"127.0.0.1:{server.port}", "--json", *texts,
                        cwd=tmp_path)
    assert answered.returncode == 0, answered.stderr
    _assert_answers(answered.stdout, texts, predictor)


def _assert_answers(stdout: str, texts: list[str], predictor) -> None:
    got = [json.loads(line) for line in stdout.splitlines()]
    for g, text, want in zip(got, texts, predictor.predict(texts), strict=True):
        assert g["text"] == text and g["label"] == want.label
        assert g["probabilities"] == pytest.approx(list(want.probabilities), abs=1e-5)


@pytest.fixture
def big_venv(tmp_path: Path) -> Iterator[Path]:
    """A fresh virtualenv for an extra with large wheels (onnxruntime, torch: 0.5 to 2 GB), removed after its test."""
    try:
        yield _venv(tmp_path / "venv")
    finally:
        shutil.rmtree(tmp_path / "venv", ignore_errors=True)


@pytest.mark.slow
def test_the_serve_extra_serves_and_stops_on_sigterm(wheel: Path, big_venv: Path, client_bin: Path,
                                                     tiny_bundle: Path, predictor, tmp_path: Path) -> None:
    """`pip install 'transfer-sentiment[serve]'` (requirements.lock's pins), no torch, no DeepSpeed: its
    `sentiment-server` serves the tiny bundle on 127.0.0.1 over gRPC (to the `client` virtualenv's
    `sentiment-client`), HTTP and Prometheus, answers as the checkout's predictor does, and exits 0 on SIGTERM."""
    _pip(big_venv, *PINS, f"{wheel}[serve]")
    installed = _installed(big_venv)
    assert {"onnxruntime-gpu", "grpcio", "uvicorn"} <= installed and not installed & {"torch", "deepspeed"}
    server = subprocess.Popen([str(big_venv / "sentiment-server"), str(tiny_bundle), "--port", "0", "--http-port", "0",
                               "--metrics-port", "0", "--device", "cpu"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(), cwd=tmp_path)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:  # the whole log, in a thread: a full pipe would block the server
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if LISTENING.search(line):
                ready.set()
        ready.set()  # it exited

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(60)
        started = next((line for line in lines if LISTENING.search(line)), None)
        assert started, "".join(lines)
        listening = LISTENING.search(started)
        ports = dict(re.findall(r"(HTTP|metrics) on [\d.]+:(\d+)", started))
        texts = ["Un livre magnifique.", "Ennuyeux, je n'ai pas fini."]
        answered = _run(client_bin, "sentiment-client", "--target", f"127.0.0.1:{listening.group(2)}", "--json",
                        *texts, cwd=tmp_path)
        assert answered.returncode == 0, answered.stderr
        _assert_answers(answered.stdout, texts, predictor)
        request = urllib.request.Request(f"http://127.0.0.1:{ports['HTTP']}/v1/classify", method="POST",
                                         data=json.dumps({"texts": texts}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            results = json.loads(r.read())["results"]
        assert [r["label"] for r in results] == [p.label for p in predictor.predict(texts)]
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=30) as r:
            assert r.status == 200 and b"# TYPE sentiment_" in r.read()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        reader.join(10)
    log = "".join(lines)
    assert server.returncode == 0 and "Traceback" not in log, log


@pytest.mark.slow
def test_the_train_extra_counts_the_labs_parameters(wheel: Path, big_venv: Path, tmp_path: Path) -> None:
    """`pip install 'transfer-sentiment[train]'` (requirements.lock's pins; torch's CPU build where pip's
    configuration offers it): `transfer-sentiment params --preset lab` prints the lab's two totals, the language
    model's and the classifier's; `sentiment-server`, without gRPC there, names the `serve` extra."""
    _pip(big_venv, *PINS, f"{wheel}[train]")
    assert {"torch", "deepspeed", "onnxruntime-gpu"} <= _installed(big_venv)
    out = _run(big_venv, "transfer-sentiment", "params", "--preset", "lab", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    totals = re.findall(r"^total \(counted\) +([\d,]+)$", out.stdout, re.M)
    assert totals == ["21,018,401", "10,968,602"], out.stdout
    _says_it_needs(_run(big_venv, "sentiment-server", tmp_path, cwd=tmp_path), "sentiment-server", "serve")
