"""compose.yaml, started as the README starts it (`podman-compose up -d`; podman-compose from PyPI, in .venv-deploy;
slow suite): the server behind its proxy on one host, called through the proxy's published ports by the real client
(serving/client.py), by tritonclient and over HTTP; only the proxy's ports and the server's metrics (on loopback) are
published; the proxy follows the server to a new address when its container starts again; both stop with exit 0.
compose.repository.yaml (the server on a model repository) is checked as podman-compose merges it with compose.yaml,
and started with it (slow suite): a new version renamed into the repository takes the calls without a failed one.

The images are those tests/test_container.py and tests/images.py build with buildah (podman reads the same storage),
named by compose.yaml's SERVER_IMAGE and PROXY_IMAGE. This machine's podman needs a containers.conf of its own
(CONTAINERS_CONF): its containers may not set RLIMIT_NOFILE or RLIMIT_NPROC as high as podman does by default (no
CAP_SYS_RESOURCE here), and Debian bookworm's crun refuses this machine's hybrid cgroup layout, so the file names
runc and lower limits. compose.yaml itself runs as written.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from http_fixtures import classify
from images import need, ok, proxy_image, unavailable, wait_serving
from procs import REPO, free_port, run
from serving_fixtures import reviews, wait_until
from test_container import TOKEN, _tritonclient, base_image, build, image, wheelhouse  # noqa: F401 (fixtures)
from test_deploy_manifests import _server_config

from serving.client import SentimentClient, Unavailable
from serving.model.predictor import Predictor

TOOLS = Path(os.environ.get("TS_DEPLOY_TOOLS", REPO / ".venv-deploy" / "bin"))


def _containers_conf(path: Path) -> Path:
    """runc, and limits a container may set here: this process's own for files, buildah's default for processes."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limits = [f"nofile={nofile}:{nofile}", "nproc=32768:32768"]
    path.write_text(f'[containers]\ndefault_ulimits = {json.dumps(limits)}\n[engine]\nruntime = "runc"\n')
    return path


@pytest.fixture
def compose(image: str, tiny_bundle: Path,  # noqa: F811 (image: test_container's fixture)
            tmp_path: Path) -> Iterator[tuple[list[str], dict[str, str]]]:
    """podman-compose on compose.yaml as a project of its own, its settings in the environment; `down` after."""
    need("podman")
    need("runc")
    tool = TOOLS / "podman-compose"
    if not tool.exists():
        unavailable(f"{tool} missing: run `make deploy-venv`")
    token = tmp_path / "token"
    token.write_text(TOKEN, encoding="utf-8")
    token.chmod(0o644)  # the server's user reads it
    env = {**os.environ, "CONTAINERS_CONF": str(_containers_conf(tmp_path / "containers.conf")),
           "BUNDLE": str(tiny_bundle), "TOKEN_FILE": str(token), "SENTIMENT_PORT": str(free_port()),
           "HTTP_PORT": str(free_port()),
           "METRICS_PORT": str(free_port())}
    for name, built in (("SERVER_IMAGE", image), ("PROXY_IMAGE", proxy_image())):  # by id: a tag may move meanwhile
        env[name] = ok(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", built],
                       timeout=60).stdout.strip()
    command = [str(tool), "-f", str(REPO / "compose.yaml"), "-p", f"ts-compose-{os.getpid()}"]
    try:
        yield command, env
    finally:
        run([*command, "down"], timeout=300, env=env, cwd=REPO)


def _podman(env: dict[str, str], *args: str) -> str:
    return ok(["podman", *args], timeout=120, env=env).stdout


def _serving(target: str, env: dict[str, str], project: str) -> None:
    """Until the server answers SERVING through the proxy and the proxy routes model calls to it, over gRPC and over
    HTTP: health passes straight through, while model calls are answered UNAVAILABLE (HTTP: 503, "cannot be reached
    (proxy)") until the proxy's own check of each port (every second) has seen the server up (a fresh clone's CI run
    called in that second, once on gRPC's port and once on HTTP's)."""
    try:
        wait_serving(target, 120)
        with SentimentClient(target, token=TOKEN, timeout=30, retries=30, backoff=0.1) as client:
            client.classify(["prêt"])
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        wait_until(lambda: classify(int(env["HTTP_PORT"]), ["prêt"], bearer).status != 503, 30,
                   what="the proxy routing HTTP to the server")
    except (AssertionError, Unavailable) as e:
        raise AssertionError(f"{e}\n{_logs(env, project)}") from None


def _logs(env: dict[str, str], project: str) -> str:
    """Both containers' output, for a failure's message."""
    return "\n".join(f"--- {service}:\n" + run(["podman", "logs", f"{project}_{service}_1"], timeout=60, env=env).stderr
                     for service in ("server", "proxy"))


@pytest.mark.slow  # 81 s of make test's 920 on 2026-12-02; the merged files' checks below stay in it
def test_compose_serves_through_the_proxy_follows_a_new_server_and_stops_cleanly(
        compose: tuple[list[str], dict[str, str]], tiny_bundle: Path, data_dir: Path) -> None:
    command, env = compose
    project = command[-1]
    ok([*command, "up", "-d"], timeout=300, env=env, cwd=REPO)
    target = f"127.0.0.1:{env['SENTIMENT_PORT']}"
    _serving(target, env, project)

    # What the host publishes: the proxy's port to all, the server's metrics on loopback, nothing else.
    published = {}
    for service in ("server", "proxy"):
        ports = json.loads(_podman(env, "inspect", f"{project}_{service}_1"))[0]["NetworkSettings"]["Ports"]
        published[service] = {k: [(b["HostIp"], b["HostPort"]) for b in v] for k, v in ports.items() if v}
    assert published == {"server": {"8002/tcp": [("127.0.0.1", env["METRICS_PORT"])]},
                         "proxy": {"50051/tcp": [("", env["SENTIMENT_PORT"])],  # "": every address
                                   "8000/tcp": [("", env["HTTP_PORT"])]}}, published

    texts = reviews(data_dir, 6) + ["Un très beau livre.", "Décevant."]
    reference = Predictor(tiny_bundle, device="cpu")
    expected = [reference.predict([t])[0] for t in texts]  # one text a run on both sides: equal answers
    with SentimentClient(target, token=TOKEN, timeout=30) as client:
        got = [client.classify([t])[0] for t in texts]
    assert [r.label for r in got] == [e.label for e in expected]
    np.testing.assert_allclose([r.probabilities for r in got], [e.probabilities for e in expected], atol=1e-5)
    triton = _tritonclient(target, texts)
    assert triton["live"] and triton["ready"] and triton["model_ready"]
    np.testing.assert_allclose(triton["probabilities"], [e.probabilities for e in reference.predict(texts)],
                               atol=1e-4)
    assert triton["errors"]["no token"]["status"] == "StatusCode.UNAUTHENTICATED"
    over_http = classify(int(env["HTTP_PORT"]), texts, {"Authorization": f"Bearer {TOKEN}"})
    assert over_http.status == 200, over_http
    np.testing.assert_allclose([r["probabilities"] for r in over_http.json["results"]],
                               [e.probabilities for e in reference.predict(texts)], atol=1e-4)
    with urllib.request.urlopen(f"http://127.0.0.1:{env['METRICS_PORT']}/metrics", timeout=10) as reply:
        assert "sentiment_requests_total" in reply.read().decode()

    # The server's container started again (its restart policy, after a crash) gets a new address: the proxy
    # resolves `server` again and calls go on (with the address it resolved at its start, they would not).
    address = ["inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", f"{project}_server_1"]
    before = _podman(env, *address)
    _podman(env, "stop", f"{project}_server_1")
    # A container that takes an address while the server has none, so that the server's next one is another
    squatter = ok(["podman", "run", "-d", "--network", f"{project}_default", "--entrypoint", "sleep",
                   env["PROXY_IMAGE"], "300"], timeout=120, env=env).stdout.strip()
    try:
        _podman(env, "start", f"{project}_server_1")
        assert _podman(env, *address) != before
        _serving(target, env, project)
        with SentimentClient(target, token=TOKEN, timeout=30) as client:
            assert client.classify(texts[:1])[0].label == expected[0].label
    finally:
        run(["podman", "rm", "-f", squatter], timeout=120, env=env)

    # Stopped as a user stops it: the proxy first (its STOPSIGNAL, a soft stop), then the server (SIGTERM, drain).
    ok([*command, "stop"], timeout=300, env=env, cwd=REPO)
    for service in ("server", "proxy"):
        state = json.loads(_podman(env, "inspect", f"{project}_{service}_1"))[0]["State"]
        assert (state["Status"], state["ExitCode"]) == ("exited", 0), (service, state, _logs(env, project))


def _merged(files: list[str], env: dict[str, str]) -> dict:
    """What podman-compose makes of compose files given together (`config`: merged, its variables filled in)."""
    import yaml  # requirements.lock pins it (schemathesis, wandb)

    need("podman")  # podman-compose asks podman its version first, even for `config`
    tool = TOOLS / "podman-compose"
    if not tool.exists():
        unavailable(f"{tool} missing: run `make deploy-venv`")
    out = ok([str(tool), *(a for f in files for a in ("-f", str(REPO / f))), "config"], timeout=120, env=env, cwd=REPO)
    return yaml.safe_load(out.stdout)


def test_compose_repository_file_serves_a_polled_repository_and_changes_nothing_else(tmp_path: Path) -> None:
    """compose.repository.yaml over compose.yaml: the server's command is compose.yaml's with --model-repository and
    --model-control=poll in place of the bundle (parsed by the server's own parser); MODEL_REPOSITORY (else
    ./runs/models) is the one folder at /mnt/models, read-only; all else is compose.yaml's. The copy and rename its
    comments give land a version in that folder, under the model name compose.yaml's clients call."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_REPOSITORY", "BUNDLE")}
    alone = _merged(["compose.yaml"], {**env, "BUNDLE": str(tmp_path / "bundle")})
    both = _merged(["compose.yaml", "compose.repository.yaml"], {**env, "MODEL_REPOSITORY": str(tmp_path / "models")})
    server, base = both["services"]["server"], alone["services"]["server"]
    args = server["command"]
    cfg = _server_config(args, tmp_path)
    assert cfg.model_control == "poll" and cfg.model_repository == "/mnt/models"
    assert [a for a in args if not a.startswith("--")] == [], "a bundle beside the repository"
    assert base["command"][0] == "/mnt/models"
    assert [a for a in args if not a.startswith(("--model-repository=", "--model-control="))] == base["command"][1:]
    assert server["volumes"] == [f"{tmp_path / 'models'}:{cfg.model_repository}:ro"], server["volumes"]
    assert base["volumes"] == [f"{tmp_path / 'bundle'}:/mnt/models:ro"], base["volumes"]
    assert {k: v for k, v in server.items() if k not in ("command", "volumes")} == \
        {k: v for k, v in base.items() if k not in ("command", "volumes")}
    assert {k: v for k, v in both.items() if k != "services"} == {k: v for k, v in alone.items() if k != "services"}
    assert both["services"]["proxy"] == alone["services"]["proxy"]

    (default,) = _merged(["compose.yaml", "compose.repository.yaml"], env)["services"]["server"]["volumes"]
    folder = Path(default.split(":")[0])
    text = (REPO / "compose.repository.yaml").read_text(encoding="utf-8")
    (copied,) = re.findall(r"^#\s+cp -r \S+ (\S+)$", text, re.M)
    ((temp, final),) = re.findall(r"^#\s+mv -T (\S+) (\S+)$", text, re.M)
    temp, final = Path(temp), Path(final)
    assert Path(copied) == temp and temp.parent == final.parent  # one rename within one folder
    assert not temp.name.isdigit() and final.name.isdigit()  # the server ignores the copy until it is renamed
    assert final.parent.parent == folder and final.parent.name == cfg.model_name


@pytest.mark.slow
def test_compose_repository_file_swaps_a_new_version_in_under_calls_without_a_failed_one(
        compose: tuple[list[str], dict[str, str]], tiny_bundle: Path, tmp_path: Path) -> None:
    """compose.repository.yaml started with compose.yaml (podman-compose, both -f) on a repository holding version 1:
    calls through the proxy go on while version 2 is copied and renamed in as the file's comments say; answers move to
    version 2 within the poll and the warm-up, and no call fails on the way."""
    base, env = compose
    project = base[-1]
    command = [*base[:3], "-f", str(REPO / "compose.repository.yaml"), *base[3:]]
    models = tmp_path / "models" / "sentiment"
    shutil.copytree(tiny_bundle, models / "1")
    env = {**env, "MODEL_REPOSITORY": str(models.parent)}
    ok([*command, "up", "-d"], timeout=300, env=env, cwd=REPO)
    target = f"127.0.0.1:{env['SENTIMENT_PORT']}"
    _serving(target, env, project)

    answered: list[str] = []  # the version of every answer, in order
    failed: list[str] = []
    stop = threading.Event()

    def calls() -> None:
        with SentimentClient(target, token=TOKEN, timeout=30) as client:
            while not stop.is_set():
                try:
                    answered.append(client.classify(["Un très beau livre."])[0].model_version)
                except Exception as e:  # every failure is the finding
                    failed.append(f"{type(e).__name__}: {e}")
                time.sleep(0.02)

    caller = threading.Thread(target=calls)
    caller.start()
    try:
        deadline = time.monotonic() + 60
        while len(answered) < 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.copytree(tiny_bundle, models / ".incoming-2")  # the file's cp -r, then its mv -T: one rename
        os.rename(models / ".incoming-2", models / "2")
        while (not answered or answered[-1] != "2") and time.monotonic() < deadline + 60:
            time.sleep(0.1)
        seen = len(answered)
        while len(answered) < seen + 20 and time.monotonic() < deadline + 90:
            time.sleep(0.1)
    finally:
        stop.set()
        caller.join(60)
    assert failed == [], (failed[:5], _logs(env, project))
    first_two = answered.index("2") if "2" in answered else len(answered)
    assert set(answered[:first_two]) == {"1"} and set(answered[first_two:]) == {"2"} and \
        len(answered) - first_two >= 20, (answered[:first_two][-3:], answered[first_two:][:3], _logs(env, project))
    ok([*command, "stop"], timeout=300, env=env, cwd=REPO)
    state = json.loads(_podman(env, "inspect", f"{project}_server_1"))[0]["State"]
    assert (state["Status"], state["ExitCode"]) == ("exited", 0), (state, _logs(env, project))
