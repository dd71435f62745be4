"""The model repository (serving/model/repository.py, serving/model/models.py) and its API
(serving/protocols/repository_api.py) attacked the way a careless or hostile client, file or scheduler would: calls
without the token, model names that walk out of the repository, links out of it, versions copied in while the server
polls, broken policy files, load/unload storms and an unload under load. Real servers on 127.0.0.1; besides the
status codes, each test looks at what was read, the index, the log, the threads or the memory.

A test marked xfail(strict=True) is a defect of the server that it shows; its reason says where (docs/RELIABILITY.md,
"Model repository attacks").
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from http_fixtures import call
from serving_fixtures import HeldRuns, ServerProcess, running_server, wait_until

from serving.gen.inference import grpc_service_pb2 as kpb
from serving.gen.inference import grpc_service_pb2_grpc as kpb_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.process.app import SentimentServer

TOKEN = "repository-attack-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
META = [("authorization", f"Bearer {TOKEN}")]
TEXTS = ["Un livre magnifique, je le relirai.", "Ennuyeux du début à la fin."]
OLD_ATIME = 1_000_000.0  # 1970: a read moves an atime this old forward under relatime (older than a day)
POLL_S = 0.1


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def repo(tmp_path: Path, tiny_bundle: Path) -> Path:
    """A repository holding model `m`, version 1 (tiny_bundle)."""
    root = tmp_path / "repo"
    shutil.copytree(tiny_bundle, root / "m" / "1")
    return root


@contextmanager
def serving(repo: Path, **options: object) -> Iterator[tuple[SentimentServer, kpb_grpc.GRPCInferenceServiceStub,
                                                             pb_grpc.SentimentServiceStub]]:
    """An in-process server of `repo` (gRPC and HTTP on free ports; explicit model control unless `options` say),
    its KServe stub and its sentiment.v1 stub."""
    options = {"http_port": 0, "model_control": "explicit", **options}
    with running_server(None, model_repository=str(repo), **options) as server, \
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, kpb_grpc.GRPCInferenceServiceStub(channel), pb_grpc.SentimentServiceStub(channel)


def index(server: SentimentServer) -> dict[tuple[str, str], tuple[str, str]]:
    """The repository index as REST serves it: (name, version) -> (state, reason)."""
    reply = call(server.http_port, "POST", "/v2/repository/index", headers=AUTH if server.cfg.auth_token else None)
    assert reply.status == 200, reply.body
    return {(r["name"], r["version"]): (r["state"], r["reason"]) for r in reply.json}


def rest(server: SentimentServer, action: str, name: str, headers: dict[str, str] | None = None,
         timeout: float = 30.0):
    """POST /v2/repository/models/{name}/{action}, the name quoted as one path segment."""
    return call(server.http_port, "POST", f"/v2/repository/models/{urllib.parse.quote(name, safe='')}/{action}",
                headers=headers, timeout=timeout)


def load(kserve: kpb_grpc.GRPCInferenceServiceStub, name: str, metadata: list | None = None) -> None:
    kserve.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name=name), timeout=60, metadata=metadata)


def unload(kserve: kpb_grpc.GRPCInferenceServiceStub, name: str, metadata: list | None = None) -> None:
    kserve.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name=name), timeout=60, metadata=metadata)


def refusal(rpc, *args: object, **kw: object) -> grpc.RpcError:
    """The error `rpc(*args)` raises (it must raise one)."""
    with pytest.raises(grpc.RpcError) as e:
        rpc(*args, **kw)
    return e.value


def one_line(text: str, limit: int = 400) -> bool:
    return "\n" not in text and 0 < len(text) <= limit


class ReadProbe:
    """Which files and folders under `root` get read (a file opened and read, a folder listed) from now on: their
    atime is set to 1970, which a read moves forward (relatime updates an atime older than a day). A stat, which
    reads nothing of the entry, leaves it."""

    def __init__(self, root: Path) -> None:
        self.paths = [root, *root.rglob("*")]
        for p in self.paths:
            os.utime(p, (OLD_ATIME, p.stat().st_mtime))
        control = root.parent / f".{root.name}-atime-control"
        control.write_text("x")
        os.utime(control, (OLD_ATIME, control.stat().st_mtime))
        control.read_text()
        if control.stat().st_atime == OLD_ATIME:
            pytest.skip(f"this filesystem does not update atime on a read ({root}): nothing to probe with")

    def read(self) -> list[Path]:
        return [p for p in self.paths if p.stat().st_atime != OLD_ATIME]


class Callers:
    """`n` threads calling Classify on model `model` back to back until stopped; every outcome kept as
    (start, end, code, version or details)."""

    def __init__(self, classify: pb_grpc.SentimentServiceStub, model: str = "m", n: int = 2) -> None:
        self.outcomes: list[tuple[float, float, str, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(classify, model)) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, classify: pb_grpc.SentimentServiceStub, model: str) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                r = classify.Classify(pb.ClassifyRequest(texts=TEXTS, model_name=model), timeout=30)
                self.outcomes.append((start, time.monotonic(), "OK", r.model_version))
            except grpc.RpcError as e:
                self.outcomes.append((start, time.monotonic(), e.code().name, e.details() or ""))
            time.sleep(0.002)

    def stop(self) -> list[tuple[float, float, str, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a caller is still blocked after 60 s"
        return self.outcomes


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


# ---------------------------------------------------------------------------------------------- authentication


def test_load_and_unload_without_the_token_are_refused_and_change_nothing(repo: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with serving(repo, auth_token=TOKEN) as (server, kserve, classify):
        core = server.models.cores[0]
        for action in ("load", "unload"):
            for headers in (None, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
                reply = rest(server, action, "m", headers)
                assert reply.status == 401 and reply.json["code"] == "UNAUTHENTICATED", (action, headers, reply.body)
            for metadata in (None, [("authorization", "Bearer wrong-token-0123456789")]):
                e = refusal(load if action == "load" else unload, kserve, "m", metadata)
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (action, metadata, e)
        # nothing was unloaded or loaded again: the same version object serves, and answers
        assert server.models.cores == (core,) and index(server) == {("m", "1"): ("READY", "")}
        answer = classify.Classify(pb.ClassifyRequest(texts=TEXTS), timeout=10, metadata=META)
        assert answer.model_version == "1" and len(answer.results) == 2
        changes = [r.getMessage() for r in caplog.records if r.name == "serving.model.models"]
        assert changes == ["model 'm' version 1 loaded from %s and serving" % (repo / "m" / "1")], changes
        # the same calls with the token do what they ask: it was the token that was missing
        assert rest(server, "unload", "m", AUTH).status == 200 and server.models.cores == ()
        load(kserve, "m", META)
        assert [c.version for c in server.models.cores] == ["1"] and server.models.cores != (core,)


def test_without_a_token_the_repository_api_is_closed_and_the_index_readable(repo: Path) -> None:
    with serving(repo) as (server, kserve, classify):
        core = server.models.cores[0]
        for action in ("load", "unload"):
            reply = rest(server, action, "m")
            assert reply.status == 403 and reply.json["code"] == "PERMISSION_DENIED", reply.body
            assert one_line(reply.json["error"]) and "--auth-token-file" in reply.json["error"], reply.json
            e = refusal(load if action == "load" else unload, kserve, "m")
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "--repository-api-open" in e.details(), e
        assert index(server) == {("m", "1"): ("READY", "")}
        rows = kserve.RepositoryIndex(kpb.RepositoryIndexRequest(), timeout=10).models
        assert [(r.name, r.version, r.state) for r in rows] == [("m", "1", "READY")]
        assert server.models.cores == (core,)
        assert classify.Classify(pb.ClassifyRequest(texts=TEXTS), timeout=10).model_version == "1"
    with serving(repo, repository_api_open=True) as (server, kserve, _):  # opened on purpose: the same calls work
        unload(kserve, "m")
        assert index(server) == {("m", "1"): ("UNAVAILABLE", "unloaded")}


# ---------------------------------------------------------------------------------------------- names and links


def test_a_model_name_walking_out_of_the_repository_is_refused_and_nothing_outside_is_read(
        tmp_path: Path, repo: Path, tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    outside = tmp_path / "x"  # what `../x` reaches from the repository: a valid model folder
    shutil.copytree(tiny_bundle, outside / "1")
    names = ["../x", "..", "%2e%2e/x", "%2e%2e", str(outside), "x/../../x", "./../x", "x\x00", "\x00../x",
             "a" * 10_000, "m/../../x"]
    with serving(repo, repository_api_open=True) as (server, kserve, _):
        probe = ReadProbe(outside)
        for name in names:
            reply = rest(server, "load", name)
            assert reply.status in (400, 404) and reply.json["code"] in ("NOT_FOUND", "INVALID_ARGUMENT"), \
                (name[:40], reply.status, reply.body[:300])
            assert one_line(reply.json["error"]), (name[:40], reply.json)
            e = refusal(load, kserve, name)
            assert e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), (name[:40], e)
            assert one_line(e.details()), (name[:40], e.details()[:500])
        assert probe.read() == [], f"read outside the repository: {probe.read()}"
        assert index(server) == {("m", "1"): ("READY", "")}
        assert [(c.name, c.version) for c in server.models.cores] == [("m", "1")]
    assert not [r for r in caplog.records if str(outside) in r.getMessage() and "loaded" in r.getMessage()]


def test_a_version_linked_out_of_the_repository_is_listed_unavailable_and_a_link_inside_is_followed(
        tmp_path: Path, repo: Path, tiny_bundle: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "2"
    shutil.copytree(tiny_bundle, elsewhere)
    (repo / "m" / "2").symlink_to(elsewhere, target_is_directory=True)
    shutil.copytree(tiny_bundle, repo / ".store" / "m3")  # a dot-name: not a model of the repository
    (repo / "m" / "3").symlink_to(Path("..") / ".store" / "m3", target_is_directory=True)  # relative, inside
    (repo / "m" / "model.json").write_text(json.dumps({"version_policy": {"all": {}}}))
    probe = ReadProbe(elsewhere)
    with serving(repo, repository_api_open=True) as (server, kserve, classify):
        load(kserve, "m")  # an explicit load too: still not the link out
        rows = index(server)
        assert rows[("m", "1")] == ("READY", "") and rows[("m", "3")] == ("READY", ""), rows
        state, reason = rows[("m", "2")]
        assert state == "UNAVAILABLE" and reason == "m/2 leads outside the repository: not loaded", \
            rows
        assert sorted(c.version for c in server.models.cores) == ["1", "3"]
        assert classify.Classify(pb.ClassifyRequest(texts=TEXTS, model_name="m", model_version="3"),
                                 timeout=10).model_version == "3"
        e = refusal(classify.Classify, pb.ClassifyRequest(texts=TEXTS, model_name="m", model_version="2"), timeout=10)
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
    assert probe.read() == [], f"read through the link out of the repository: {probe.read()}"


def test_a_model_folder_linked_out_of_the_repository_is_not_loaded_and_a_link_inside_is_followed(
        tmp_path: Path, repo: Path, tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    evil = tmp_path / "elsewhere" / "evil"
    shutil.copytree(tiny_bundle, evil / "1")
    (repo / "evil").symlink_to(evil, target_is_directory=True)
    shutil.copytree(tiny_bundle, repo / ".models" / "real" / "1")
    (repo / "alias").symlink_to(repo / ".models" / "real", target_is_directory=True)  # absolute, inside
    probe = ReadProbe(evil)
    with serving(repo, repository_api_open=True) as (server, kserve, classify):
        e = refusal(load, kserve, "evil")
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
        # where the link leads, and where the server keeps its repository, are not the client's to read
        assert e.details() == "evil leads outside the repository: not loaded; no version serves", e
        assert "evil" not in server.models.names() and sorted(server.models.names()) == ["alias", "m"]
        assert classify.Classify(pb.ClassifyRequest(texts=TEXTS, model_name="alias"), timeout=10).model_name == \
            "alias"
    assert probe.read() == [], f"read through the link out of the repository: {probe.read()}"
    assert any("evil" in r.getMessage() for r in errors_logged(caplog)), "the link is not reported"


def test_a_model_folder_linked_out_of_the_repository_is_listed_unavailable_naming_the_link(
        tmp_path: Path, repo: Path, tiny_bundle: Path) -> None:
    shutil.copytree(tiny_bundle, tmp_path / "elsewhere" / "evil" / "1")
    (repo / "evil").symlink_to(tmp_path / "elsewhere" / "evil", target_is_directory=True)
    with serving(repo) as (server, _, _):
        rows = index(server)
        assert ("evil", "") in rows or ("evil", "1") in rows, rows
        state, reason = rows.get(("evil", ""), rows.get(("evil", "1")))
        assert state == "UNAVAILABLE" and reason == "evil leads outside the repository: not loaded", rows


def test_a_version_written_with_a_leading_zero_is_refused_not_taken_for_another(repo: Path,
                                                                               tiny_bundle: Path) -> None:
    """`7` and `07` would both be version 7, the one the directory lists last winning: `07` is refused, named."""
    shutil.copytree(tiny_bundle, repo / "m" / "7")
    shutil.copytree(tiny_bundle, repo / "m" / "07")
    with serving(repo) as (server, _, _):
        rows = index(server)
        assert rows[("m", "7")] == ("READY", "") and server.models.versions("m") == ["7"]
        state, reason = rows[("m", "07")]
        assert state == "UNAVAILABLE" and "m/07" in reason and "leading zero" in reason, rows


# ---------------------------------------------------------------------------------------------- a version copied in


def copy_slowly(server: SentimentServer, bundle: Path, dest: Path, last: str,
                caplog: pytest.LogCaptureFixture | None = None) -> str:
    """Copy `bundle` into `dest` file by file as `cp -r` does (each file created, then written), `last` last and in
    two halves; wait until the poller has refused the version while incomplete, and again with half of `last`, then
    complete it. Returns the reason the half-written version was refused. With `caplog`: the polls of the unchanged
    half-written version must log nothing more."""
    version = dest.name
    files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
    files.remove(last)

    def reason() -> str:
        state, why = index(server).get(("m", version), ("", ""))
        return why if state == "UNAVAILABLE" else ""

    dest.mkdir()
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle / rel, dest / rel)
        wait_until(reason, 10, what=f"version {version} refused while incomplete")
    data = (bundle / last).read_bytes()
    with open(dest / last, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        wait_until(lambda: Path(last).name in reason() and "missing" not in reason(), 10,
                   what=f"version {version} refused with half of {last}")
        half = reason()
        logged = len(errors_logged(caplog)) if caplog else 0
        time.sleep(5 * POLL_S)  # more polls of the half-written file
        if caplog:
            assert len(errors_logged(caplog)) == logged, "the same refusal logged again at each poll"
        f.write(data[len(data) // 2:])
    return half


@pytest.mark.parametrize("last", ["manifest.json", "model.onnx", "tokenizer/spm.model"])
def test_a_version_copied_in_while_polled_is_never_served_half_written(repo: Path, tiny_bundle: Path, last: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with serving(repo, model_control="poll", repository_poll_s=POLL_S, repository_api_open=True) as \
            (server, kserve, classify):
        callers = Callers(classify)
        half = copy_slowly(server, tiny_bundle, repo / "m" / "7", last, caplog)
        completed = time.monotonic()
        assert f"m/7/{last}" in half and one_line(half), half
        load(kserve, "m")  # an explicit load tries it again whatever the poller decided
        loaded = time.monotonic()
        wait_until(lambda: sum(o[0] > loaded for o in callers.outcomes) >= 5, 20, what="calls after the load")
        outcomes = callers.stop()
        assert index(server)[("m", "7")] == ("READY", "")
        assert Counter(o[2] for o in outcomes) == {"OK": len(outcomes)}, Counter(o[2] for o in outcomes)
        assert {o[3] for o in outcomes if o[1] < completed} == {"1"}  # the half-written version never answered
        assert {o[3] for o in outcomes if o[0] > loaded} == {"7"}
        assert server.models.versions("m") == ["7"]
    refusals = [r for r in errors_logged(caplog) if "version 7" in r.getMessage()]
    assert refusals and all(one_line(r.getMessage(), 600) for r in refusals)


@pytest.mark.parametrize("last", ["manifest.json", "model.onnx", "tokenizer/spm.model"])
def test_a_version_refused_half_written_is_loaded_by_the_poller_once_complete(repo: Path, tiny_bundle: Path,
                                                                            last: str) -> None:
    """Whichever file is written last, the poller tries the version again once it is complete, without an explicit
    load (a stamp of the folder's and manifest.json's mtime alone missed model.onnx and tokenizer/)."""
    with serving(repo, model_control="poll", repository_poll_s=POLL_S) as (server, _, classify):
        copy_slowly(server, tiny_bundle, repo / "m" / "7", last)
        end = time.monotonic() + 20 * POLL_S
        while index(server).get(("m", "7"), ("",))[0] != "READY" and time.monotonic() < end:
            time.sleep(POLL_S / 2)
        assert index(server)[("m", "7")][0] == "READY", index(server)[("m", "7")]
        assert classify.Classify(pb.ClassifyRequest(texts=TEXTS), timeout=10).model_version == "7"


# ---------------------------------------------------------------------------------------------- model.json


@pytest.mark.parametrize("content", [
    b"{", b"[]", b"\xff\xfe not utf-8", b'{"version_policy": {"newest": {}}}',
    b'{"version_policy": {"latest": {"num_versions": "2"}}}', b'{"version_policy": {"latest": {"num_versions": 0}}}',
    b'{"version_policy": {"specific": {"versions": []}}}', b'{"version_policy": {"all": []}}',
], ids=["not-json", "a-list", "not-utf8", "unknown-kind", "string-count", "zero-count", "no-versions", "all-a-list"])
def test_a_broken_model_json_is_one_line_and_the_versions_serving_keep_serving(
        repo: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    policy = repo / "m" / "model.json"
    with serving(repo, model_control="poll", repository_poll_s=POLL_S, repository_api_open=True) as \
            (server, kserve, classify):
        callers = Callers(classify, n=1)
        policy.write_bytes(content)
        wait_until(lambda: ("m", "") in index(server), 10, what="the policy file listed as refused")
        state, reason = index(server)[("m", "")]
        assert state == "UNAVAILABLE" and "m/model.json" in reason and one_line(reason), reason
        reply = rest(server, "load", "m")
        assert reply.status == 400 and reply.json["code"] == "FAILED_PRECONDITION", reply.body
        assert "m/model.json" in reply.json["error"] and one_line(reply.json["error"]), reply.json
        e = refusal(load, kserve, "m")
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "m/model.json" in e.details(), e
        time.sleep(5 * POLL_S)  # polls of the same broken file
        policy.unlink()
        wait_until(lambda: ("m", "") not in index(server), 10, what="the refusal gone once the file is")
        outcomes = callers.stop()
        assert outcomes and {(o[2], o[3]) for o in outcomes} == {("OK", "1")}
    logged = [r.getMessage() for r in errors_logged(caplog) if "m/model.json" in r.getMessage()]
    assert len(logged) == 1 and one_line(logged[0], 600), logged  # once per reason, not at every poll
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


DEEP_BUG = ("serving/model/repository.py read_policy: json.loads of a deeply nested model.json raises "
            "RecursionError, which nothing catches: the server does not start, a poll logs a traceback every "
            "repository_poll_s and skips the models after it, and an explicit load answers INTERNAL "
            "(contract/manifest.py's strict_json bounds depth)")


def test_a_deeply_nested_model_json_at_start_is_one_line_and_the_other_models_serve(repo: Path,
                                                                                   tiny_bundle: Path) -> None:
    shutil.copytree(tiny_bundle, repo / "a" / "1")
    (repo / "a" / "model.json").write_bytes(b"[" * 100_000)
    with serving(repo) as (server, _, _):
        assert server.models.names() == ["m"]
        state, reason = index(server)[("a", "")]
        assert state == "UNAVAILABLE" and "a/model.json" in reason and one_line(reason), reason


def test_a_deeply_nested_model_json_while_polled_is_one_line_and_the_poll_goes_on(
        repo: Path, tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    shutil.copytree(tiny_bundle, repo / "a" / "1")  # sorted before m: the poll meets it first
    with serving(repo, model_control="poll", repository_poll_s=POLL_S, repository_api_open=True) as \
            (server, kserve, _):
        (repo / "a" / "model.json").write_bytes(b"[" * 100_000)
        time.sleep(5 * POLL_S)
        shutil.copytree(tiny_bundle, repo / "m" / "2")
        wait_until(lambda: server.models.versions("m") == ["2"], 3, what="m's new version loaded by the poll")
        assert not [r for r in caplog.records if r.exc_info], "the poll logged a traceback"
        e = refusal(load, kserve, "a")
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "model.json" in e.details(), e


def test_a_huge_model_json_is_refused_by_its_size(repo: Path, tiny_bundle: Path) -> None:
    shutil.copytree(tiny_bundle, repo / "m" / "2")
    policy = repo / "m" / "model.json"
    policy.write_bytes(b'{"version_policy": {"all": {}}}' + b" " * (32 << 20))  # valid JSON, 32 MiB
    with serving(repo) as (server, _, _):
        assert server.models.versions("m") == []  # neither this file's policy nor a guess at another
        state, reason = index(server)[("m", "")]
        assert state == "UNAVAILABLE" and "m/model.json" in reason and one_line(reason), reason


@pytest.mark.parametrize("content", [{"version_policy": {"latest": {"num_version": 2}}},
                                     {"version_policy": {"all": {}}, "versions_policy": {"specific": {}}}])
def test_a_misspelt_model_json_field_is_refused(repo: Path, tiny_bundle: Path, content: dict) -> None:
    shutil.copytree(tiny_bundle, repo / "m" / "2")
    (repo / "m" / "model.json").write_text(json.dumps(content))
    with serving(repo) as (server, _, _):
        state, reason = index(server).get(("m", ""), ("", ""))
        assert state == "UNAVAILABLE" and "model.json" in reason, index(server)


# ---------------------------------------------------------------------------------------------- storms and unloads


def repository_storm(server: SentimentServer, kserve: kpb_grpc.GRPCInferenceServiceStub) -> Counter:
    """20 loads and 20 unloads of model `m` at once from 40 threads, half over gRPC and half over REST; every one
    must end within 60 s. Returns (action, code) -> count."""
    results: Counter = Counter()
    lock = threading.Lock()

    def one(action: str, i: int) -> None:
        if i % 2:
            try:
                (load if action == "load" else unload)(kserve, "m")
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
        else:
            reply = rest(server, action, "m", timeout=60)
            code = "OK" if reply.status == 200 else reply.json["code"]
        with lock:
            results[action, code] += 1

    threads = [threading.Thread(target=one, args=(a, i)) for i in range(20) for a in ("load", "unload")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a load or unload still blocked after 60 s: a deadlock"
    return results


def test_load_unload_storms_while_calls_classify_end_consistent(repo: Path, predictor,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with serving(repo, repository_api_open=True) as (server, kserve, classify):
        before = own_threads()
        callers = Callers(classify, n=3)
        # The storm starts on a model that answers: else, on a slow host, every call could land between an unload and
        # the next load (CI saw 132 UNAVAILABLE and no answer) and the test would prove refusals only.
        wait_until(lambda: any(o[2] == "OK" for o in callers.outcomes), 30, what="a call answered before the storm")
        started = time.monotonic()
        results = repository_storm(server, kserve)
        took = time.monotonic() - started
        outcomes = callers.stop()
        assert took < 60 and results == {("load", "OK"): 20, ("unload", "OK"): 20}, (took, results)
        codes = Counter(o[2] for o in outcomes)
        assert set(codes) <= {"OK", "UNAVAILABLE", "NOT_FOUND"} and codes["OK"] > 0, codes
        assert all("model 'm'" in o[3] for o in outcomes if o[2] != "OK"), {o[3] for o in outcomes if o[2] != "OK"}
        # the index says what calls find
        rows = index(server)
        serving_now = server.models.versions("m")
        assert [v for (n, v), (state, _) in rows.items() if state == "READY"] == serving_now
        assert all(state in ("READY", "UNAVAILABLE") for state, _ in rows.values()), rows  # none left half-way
        if not serving_now:
            assert rows[("m", "1")] == ("UNAVAILABLE", "unloaded")
            assert refusal(classify.Classify, pb.ClassifyRequest(texts=TEXTS), timeout=10).code() == \
                grpc.StatusCode.UNAVAILABLE
        load(kserve, "m")
        answer = classify.Classify(pb.ClassifyRequest(texts=TEXTS), timeout=10)
        np.testing.assert_allclose([list(r.probabilities) for r in answer.results],
                                   [p.probabilities for p in predictor.predict(TEXTS)], atol=1e-5)
        # no thread left behind: besides the pools (bounded by their size), the same threads as before the storm,
        # one version's batcher threads among them
        assert own_threads() == before, (before, own_threads())
    assert not errors_logged(caplog), [r.getMessage() for r in errors_logged(caplog)][:5]


POOLS = ("grpc_", "uvloop_", "asyncio_", "ThreadPoolExecutor-", "repository_")  # the gRPC pool, the HTTP loop's
# executor, the repository API's (two threads at most: serving/protocols/repository_api.py)


def own_threads() -> Counter:
    """The threads of this process outside the pools, by name."""
    return Counter(t.name for t in threading.enumerate() if not t.name.startswith(POOLS))


def test_unload_load_cycles_give_their_memory_back(repo: Path) -> None:
    server = ServerProcess(None, "--model-repository", str(repo), "--model-control", "explicit",
                           "--repository-api-open", "--http-port", "0", "--device", "cpu")
    try:
        server.wait_listening()
        process = psutil.Process(server.proc.pid)

        def cycles(n: int) -> None:
            for _ in range(n):
                assert call(server.http_port, "POST", "/v2/repository/models/m/unload").status == 200
                assert call(server.http_port, "POST", "/v2/repository/models/m/load").status == 200
                assert call(server.http_port, "POST", "/v1/classify", {"texts": TEXTS}).status == 200

        cycles(5)  # warm: allocator pools, the HTTP loop's threads
        rss, threads = process.memory_info().rss, process.num_threads()
        cycles(40)
        grown = (process.memory_info().rss - rss) / 2**20
        assert grown < 8, f"RSS +{grown:.1f} MiB after 40 unload/load cycles: a version is not freed"
        assert process.num_threads() == threads
        assert server.stop() == 0
    finally:
        server.close()
    assert "Traceback" not in server.log and " ERROR " not in server.log, server.log[-2000:]


def test_unloading_the_only_model_lets_calls_in_flight_finish_and_refuses_later_ones(
        repo: Path, predictor) -> None:
    with serving(repo, repository_api_open=True) as (server, kserve, classify):
        core = server.models.cores[0]
        with HeldRuns(core.batcher) as held:
            in_flight = [classify.Classify.future(pb.ClassifyRequest(texts=[t]), timeout=30) for t in TEXTS]
            assert held.wait_entered()
            unloading = threading.Thread(target=unload, args=(kserve, "m"))
            unloading.start()
            wait_until(lambda: server.models.names() == [], 10, what="the version taken off the list")
            assert index(server)[("m", "1")] == ("UNLOADING", "")
            later = refusal(classify.Classify, pb.ClassifyRequest(texts=TEXTS, model_name="m"), timeout=10)
            assert later.code() == grpc.StatusCode.UNAVAILABLE and "model 'm'" in later.details(), later
            unnamed = refusal(classify.Classify, pb.ClassifyRequest(texts=TEXTS), timeout=10)
            assert unnamed.code() == grpc.StatusCode.UNAVAILABLE and "repository index" in unnamed.details(), unnamed
            reply = call(server.http_port, "POST", "/v1/classify", {"texts": TEXTS, "model_name": "m"})
            assert reply.status == 503 and "model 'm'" in reply.json["error"], reply.body
            assert unloading.is_alive()  # waiting for the calls in flight
        unloading.join(30)
        assert not unloading.is_alive()
        for text, future in zip(TEXTS, in_flight, strict=True):
            (result,) = future.result(timeout=10).results
            np.testing.assert_allclose(result.probabilities, predictor.predict([text])[0].probabilities, atol=1e-5)
        assert index(server) == {("m", "1"): ("UNAVAILABLE", "unloaded")}
        assert core.batcher not in [c.batcher for c in server.models.cores]
        assert not kserve.ModelReady(kpb.ModelReadyRequest(name="m"), timeout=10).ready  # known, not ready
        load(kserve, "m")
        assert index(server) == {("m", "1"): ("READY", "")}
        assert classify.Classify(pb.ClassifyRequest(texts=TEXTS), timeout=10).model_version == "1"


def test_unloads_waiting_on_a_drain_do_not_hold_up_long_http_calls_to_another_model(
        repo: Path, tiny_bundle: Path) -> None:
    shutil.copytree(tiny_bundle, repo / "b" / "1")
    with serving(repo, repository_api_open=True, grace_s=5.0) as (server, _, _):
        (core,) = [c for c in server.models.cores if c.name == "m"]
        held = HeldRuns(core.batcher)
        try:
            stuck = threading.Thread(target=call, args=(server.http_port, "POST", "/v1/classify",
                                                        {"texts": TEXTS, "model_name": "m"}))
            stuck.start()
            assert held.wait_entered()
            unloads = [threading.Thread(target=rest, args=(server, "unload", "m"), kwargs={"timeout": 30})
                       for _ in range(min(32, (os.cpu_count() or 1) + 4) + 1)]  # asyncio's default executor, +1
            for t in unloads:
                t.start()
            wait_until(lambda: index(server)[("m", "1")][0] == "UNLOADING", 10, what="the unload draining")
            time.sleep(0.3)  # the other unloads waiting their turn
            long_text = "Un très bon livre, je le conseille à tous. " * 60  # past OFFLOAD_CHARS
            start = time.monotonic()
            try:
                reply = call(server.http_port, "POST", "/v1/classify", {"texts": [long_text], "model_name": "b"},
                             timeout=3)
            except TimeoutError:
                reply = None
            took = time.monotonic() - start
            assert reply is not None and reply.status == 200 and took < 2, f"model b answered after {took:.1f} s"
        finally:
            held.release()
            stuck.join(30)
            for t in unloads:
                t.join(30)


def test_an_unload_in_poll_mode_is_refused_or_stays_unloaded(repo: Path) -> None:
    with serving(repo, model_control="poll", repository_poll_s=POLL_S, repository_api_open=True) as (server, _, _):
        reply = rest(server, "unload", "m")
        if reply.status == 200:
            time.sleep(5 * POLL_S)
            assert server.models.names() == [], "unloaded, then loaded again by the poller"
        else:
            assert reply.json["code"] == "FAILED_PRECONDITION" and "poll" in reply.json["error"], reply.body
