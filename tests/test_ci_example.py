"""deploy/ci/export-check.yml, the example export step of a user's CI: its commands, read from the file and run as
written on the tiny preset (the export, the check with its thresholds, and the image build with buildah, the way
tests/test_container.py builds the server's image), so the example cannot drift from the code it calls."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from procs import REPO, run
from test_container import base_image, build, wheelhouse  # noqa: F401 (fixtures: the container test's image build)

WORKFLOW = REPO / "deploy" / "ci" / "export-check.yml"
TOOLS = Path(os.environ.get("TS_DEPLOY_TOOLS", REPO / ".venv-deploy" / "bin"))


def workflow() -> dict:
    """The workflow as data (PyYAML lives in .venv-deploy, not in the project's venv)."""
    python = TOOLS / "python"
    if not python.exists():
        message = f"{python} missing: run `make deploy-venv`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    to_json = "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"
    out = subprocess.run([str(python), "-c", to_json], input=WORKFLOW.read_text(encoding="utf-8"),
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def run_step(steps: dict[str, str], step: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One step's `run:` script, as the runner runs it (bash -e, the job's env, the checkout as working folder)."""
    return subprocess.run(["bash", "-e", "-c", steps[step]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # 50 s of make test's 920 on 2026-12-02; the job file's paths are checked below in it
def test_the_example_ci_job_runs_on_the_tiny_preset(tiny_classifier_artifact: Path, tiny_bundle: Path,
                                                    data_dir: Path, tmp_path: Path,
                                                    request: pytest.FixtureRequest) -> None:
    wf = workflow()
    (job,) = wf["jobs"].values()
    steps = {s["id"]: s["run"] for s in job["steps"] if "id" in s}
    assert list(steps) == ["export", "check", "image"]
    # The job's variables, with this test's paths and the tiny model's limits (it is barely trained: 48%). BUNDLE
    # is runs/NAME/bundle as in the job, with a NAME of this test's own: the image step builds from the checkout.
    # Not the variables of a `make test` around this test: a make inside it would print "Entering directory".
    run_dir = REPO / "runs" / f"ci-example-{os.getpid()}"
    bundle = run_dir / Path(wf["env"]["BUNDLE"]).name
    outer = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env = {**outer, **{k: str(v) for k, v in wf["env"].items()},
           "ARTIFACT": str(tiny_classifier_artifact), "BUNDLE": str(bundle.relative_to(REPO)),
           "BASELINE": str(tiny_bundle), "DATA": str(data_dir / "cls-books-fr" / "test.review.txt"),
           "DATA_LIMIT": "100", "MIN_ACCURACY": "30", "MIN_AGREEMENT": "90", "MAX_DROP": "10",
           "REPORTS": str(tmp_path / "reports"), "IMAGE": f"localhost/transfer-sentiment:ci-example-{os.getpid()}"}
    try:
        export = run_step(steps, "export", env)
        assert export.returncode == 0, export.stderr[-3000:]
        assert (bundle / "manifest.json").is_file()

        check = run_step(steps, "check", env)
        assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
        report = json.loads((tmp_path / "reports" / "check.json").read_text())
        assert report["passed"] and {t["threshold"] for t in report["thresholds"]} == {"min-accuracy",
                                                                                       "min-agreement", "max-drop"}
        assert (tmp_path / "reports" / "check.xml").read_text().startswith('<?xml version="1.0" encoding="UTF-8"?>')

        # A threshold the bundle cannot meet fails the step with exit 1; with no baseline max-drop is left out.
        strict = {**env, "MIN_ACCURACY": "99.9", "BASELINE": str(tmp_path / "no-baseline-yet")}
        check = run_step(steps, "check", strict)
        assert check.returncode == 1, check.stdout[-3000:] + check.stderr[-3000:]
        report = json.loads((tmp_path / "reports" / "check.json").read_text())
        assert not report["passed"] and "max-drop" not in {t["threshold"] for t in report["thresholds"]}

        # The image step: what make runs with the job's CONTAINER_BUILD, then for real with buildah.
        image = run_step(steps, "image", {**env, "MAKEFLAGS": "-n"})
        assert image.returncode == 0, image.stderr[-3000:]
        assert image.stdout.strip() == (f"docker build -f Containerfile -t {env['IMAGE']} --target bundled "
                                        f"--build-arg BUNDLE={env['BUNDLE']} .")
        build_image(steps, env, bundle, request)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def build_image(steps: dict[str, str], env: dict[str, str], bundle: Path, request: pytest.FixtureRequest) -> None:
    """The image step for real, CONTAINER_BUILD being the container test's buildah (its base and wheelhouse: no
    registry here): the image holds the bundle just exported at /mnt/models, and its server loads it. Skipped where
    tests/test_container.py skips (no buildah: the steps before have run by then; in CI a missing tool fails)."""
    buildah_bud = request.getfixturevalue("build")  # ends with -f Containerfile: the Makefile adds its own
    env = {**env, "CONTAINER_BUILD": " ".join(buildah_bud[:-2])}
    try:
        image = run_step(steps, "image", env)
        assert image.returncode == 0, image.stdout[-2000:] + image.stderr[-3000:]
        ctr = run(["buildah", "from", "--pull-never", env["IMAGE"]], timeout=120).stdout.strip()
        try:
            read = ("import json; from serving.model.predictor import Predictor; p = Predictor('/mnt/models'); "
                    "print(json.dumps([p.predict(['Super.'])[0].label, open('/mnt/models/manifest.json').read()]))")
            out = run(["buildah", "run", "--isolation", "chroot", ctr, "--", "python", "-c", read], timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            label, manifest = json.loads(out.stdout)
            assert manifest == (bundle / "manifest.json").read_text(encoding="utf-8")  # the bundle just exported
            assert label in json.loads(manifest)["label_names"]
        finally:
            run(["buildah", "rm", ctr], timeout=120)
    finally:
        run(["buildah", "rmi", env["IMAGE"]], timeout=120)


def test_the_job_s_paths_are_a_user_s_own() -> None:
    """BUNDLE is where the build context lets a bundle in (.dockerignore, .containerignore: runs/*/bundle/), and
    DATA is a file of the user's repository, not one beside this checkout."""
    wf = workflow()
    bundle, data = wf["env"]["BUNDLE"], wf["env"]["DATA"]
    for ignore in (".dockerignore", ".containerignore"):
        allowed = [line[1:].rstrip("/") for line in (REPO / ignore).read_text(encoding="utf-8").splitlines()
                   if line.startswith("!")]
        assert any(fnmatch.fnmatch(bundle.rstrip("/"), pattern) for pattern in allowed), (ignore, bundle, allowed)
    assert not Path(data).is_absolute() and ".." not in Path(data).parts, data
