"""bench/gpu_serve_check.sh off a GPU: its options, the prepared onnxruntime-gpu's parts (joined, each checked, a
missing or altered one named; shellcheck: test_shell_scripts.py), and (slow) the whole CPU path on the tiny model
with its summary."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from procs import REPO

SCRIPT = REPO / "bench" / "gpu_serve_check.sh"


def _run(*args: str, tmp_path: Path, timeout: float = 120, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "TMPDIR": str(tmp_path), "PY": sys.executable, **(env or {})}
    environment.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=environment)


def _steps(out: Path) -> dict[str, str]:
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    return {r[0]: r[1] for r in rows}


def test_help_lists_the_steps_and_options(tmp_path: Path) -> None:
    run = _run("--help", tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    for word in ("setup", "machine", "tests", "serve", "iobinding", "workers", "--quick", "--only", "--deadline",
                 "--carry", "--pack"):
        assert word in run.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--bogus"], "unknown option --bogus"),
    (["--device", "tpu"], "--device tpu: choose auto, cuda or cpu"),
    (["--only", "setup,benchmarks"], "--only: unknown step benchmarks"),
    (["--deadline", "5"], "--deadline 5: a number of seconds >= 10"),
    (["--deadline", "soon"], "--deadline soon"),
    (["--seconds", "-1"], "--seconds -1"),
    (["--out"], "--out needs a value"),
])
def test_bad_options_exit_2_naming_the_problem(args: list[str], message: str, tmp_path: Path) -> None:
    run = _run(*args, tmp_path=tmp_path)
    assert run.returncode == 2
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "ts-gpu-serve").exists(), "nothing runs before the options are checked"


def _prepared(tmp_path: Path, parts: int = 3) -> tuple[Path, str]:
    """A folder as `make gpu-serve-offline` writes it, around a small real wheel: ort/ with the wheel split by
    `split` and SHA256SUMS (parts, then the wheel)."""
    name = "ts_probe-1.0-py3-none-any.whl"
    wheel = tmp_path / name
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("ts_probe/__init__.py", "VALUE = 'joined ' + 'x' * 3000\n")
        z.writestr("ts_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: ts-probe\nVersion: 1.0\n")
        z.writestr("ts_probe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                   "Tag: py3-none-any\n")
        z.writestr("ts_probe-1.0.dist-info/RECORD", "")
    ort = tmp_path / "prepared" / "ort"
    ort.mkdir(parents=True)
    size = wheel.stat().st_size // parts + 1
    subprocess.run(["split", "-b", str(size), str(wheel), str(ort / f"{name}.part-")], check=True, timeout=60)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(ort.glob("*.part-*"))]
    lines.append(f"{hashlib.sha256(wheel.read_bytes()).hexdigest()}  {name}")
    (ort / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    wheel.unlink()
    return tmp_path / "prepared", name


def test_setup_joins_the_checked_parts_and_installs_the_wheel(tmp_path: Path) -> None:
    prepared, _ = _prepared(tmp_path)
    assert len(list((prepared / "ort").glob("*.part-*"))) == 3
    out = tmp_path / "out"
    run = _run("--only", "setup", "--device", "cpu", "--carry", str(prepared), "--out", str(out), tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    assert _steps(out)["setup"] == "ok", (out / "setup.txt").read_text()
    site = tmp_path / "ts-gpu-serve" / "site"
    probe = subprocess.run([sys.executable, "-c", "import ts_probe; print(ts_probe.VALUE[:6])"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(site)})
    assert probe.stdout.strip() == "joined", probe.stderr
    assert set(_steps(out)) == {"setup"}  # --only: nothing else ran


@pytest.mark.parametrize("damage", ["missing", "altered", "sums missing"])
def test_a_missing_or_altered_part_is_named_and_nothing_is_installed(damage: str, tmp_path: Path) -> None:
    prepared, name = _prepared(tmp_path)
    part = prepared / "ort" / f"{name}.part-ab"
    if damage == "missing":
        part.unlink()
    elif damage == "altered":
        part.write_bytes(part.read_bytes()[:-1])  # a copy cut short
    else:
        (prepared / "ort" / "SHA256SUMS").unlink()
    out = tmp_path / "out"
    run = _run("--only", "setup", "--device", "cpu", "--carry", str(prepared), "--out", str(out), tmp_path=tmp_path)
    assert run.returncode == 0  # a failed step is recorded, the script goes on
    assert _steps(out)["setup"] == "failed (exit 2)"
    log = (out / "setup.txt").read_text()
    expected = {"missing": f"{part} missing", "altered": f"{part}: sha256 differs",
                "sums missing": f"{prepared}/ort/SHA256SUMS missing"}[damage]
    assert expected in log, log
    assert not (tmp_path / "ts-gpu-serve" / "site").exists()


def test_pack_leaves_the_summary_and_one_archive_of_what_it_wrote(tmp_path: Path) -> None:
    """--pack: an output that is quick to copy off the node. The script's own files go into logs.tar.gz; a file of the
    user's in the same folder stays."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    run = _run("--only", "summary", "--device", "cpu", "--pack", "--carry", str(tmp_path / "none"), "--out",
               str(out), tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "notes.txt", "summary.md"]
    listed = subprocess.run(["tar", "-tzf", str(out / "logs.tar.gz")], capture_output=True, text=True, timeout=60)
    assert sorted(listed.stdout.split()) == ["device.txt", "steps.tsv", "summary.txt"]
    assert "## Steps" in (out / "summary.md").read_text()


def test_a_gpu_whose_cuda_provider_does_not_load_is_said_loudly(tmp_path: Path) -> None:
    """On a GPU machine where onnxruntime's CUDA provider cannot load, the benchmarks fall back to the CPU, and the
    output says so with the reason, instead of CPU figures passing for GPU ones. The GPU is a stand-in nvidia-smi
    (this machine has none); the missing libraries are this machine's own."""
    from contract.runtime import cuda_library_problem

    problem = cuda_library_problem()
    if problem is None:
        pytest.skip("onnxruntime's CUDA provider loads here")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
    (fake / "nvidia-smi").chmod(0o755)
    run = _run("--only", "summary", "--carry", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
               tmp_path=tmp_path, env={"PATH": f"{fake}:{os.environ['PATH']}"})
    assert run.returncode == 0, run.stderr
    (warning,) = [x for x in run.stdout.splitlines() if "WARNING" in x]
    assert "CUDA provider does not load" in warning and problem.split(":")[0] in warning, warning
    assert (tmp_path / "out" / "device.txt").read_text().strip() == "cpu"


@pytest.mark.slow
def test_the_cpu_path_runs_every_step_it_can_and_summarizes(data_dir: Path, tmp_path: Path) -> None:
    """No GPU here: the tiny model, short points; the CUDA-only steps are skipped with their reason, the rest run
    (workers only where h2load is installed) and the summary holds their tables."""
    out = tmp_path / "out"
    run = _run("--quick", "--device", "cpu", "--carry", str(tmp_path / "none"), "--out", str(out),
               tmp_path=tmp_path, timeout=600, env={"TS_DATA": str(data_dir)})
    assert run.returncode == 0, run.stderr
    steps = _steps(out)
    for name in ("bundles", "serve-fp32", "rss", "summary"):
        assert steps[name] == "ok", (name, (out / f"{name}.txt").read_text()[-3000:])
    for name in ("tests", "bundles-fp16", "serve-fp16", "iobinding"):
        assert steps[name].startswith("skipped: "), (name, steps[name])
    assert steps["workers"] == "ok" if shutil.which("h2load") else steps["workers"].startswith("skipped: h2load")
    summary = (out / "summary.md").read_text()
    assert "| server, batching on | cpu, int8 | 4 | 4 |" in summary
    assert "batching on / off, 1 text per call" in summary and "PyTorch eager fp32" in summary
    assert "peak_rss_mib" in summary
    rows = json.loads((out / "serve-fp32.json").read_text())["rows"]
    assert {(r["mode"], r["per_call"], r["concurrency"]) for r in rows} >= {
        (m, k, c) for m in ("in-process predictor", "server, batching on", "server, batching off",
                            "PyTorch eager fp32") for k in (1, 4) for c in (1, 4)}
    assert all(r["texts_per_s"] > 0 and not r.get("errors") for r in rows)
