"""deploy/train (Kubeflow Trainer TrainJob) and Containerfile.train, checked as the server's manifests are
(tests/test_deploy_manifests.py, same tools in .venv-deploy): Kubernetes' schemas and checkov on the native objects
and on the pods the controller makes (tests/train_pods.py), hadolint on the Containerfile, and the TrainJob and
TrainingRuntime against Kubeflow Trainer's own API models (kubeflow-trainer-api, generated from its OpenAPI spec:
every key must survive a round trip through them, so a misspelt field fails). The restart policy is checked by
replaying the Job controller's podFailurePolicy and JobSet's failurePolicy on each way a pod can end. Running the
pods' commands: tests/test_clusters.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from procs import REPO
from test_deploy_manifests import K8S_VERSIONS, _checkov, _docs, _kustomize, _run, _tool
from train_pods import container, one, trainjob_pods

TRAIN = REPO / "deploy" / "train"
APP_UID = 10001  # Containerfile.train's USER


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The rendered documents: deploy/train (CPU) and an overlay with the Component deploy/train/gpu."""
    out = tmp_path_factory.mktemp("train-rendered")
    overlay = out / "gpu-overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(TRAIN, overlay)}]\ncomponents: [{os.path.relpath(TRAIN / 'gpu', overlay)}]\n")
    return {"cpu": _docs(_kustomize(TRAIN, out / "cpu.yaml")), "gpu": _docs(_kustomize(overlay, out / "gpu.yaml"))}


def _native_and_pods(docs: list[dict], folder: Path) -> list[Path]:
    """One JSON file per object that Kubernetes' schemas and checkov know: the native ones and the TrainJob's pods."""
    objects = [d for d in docs if not d["apiVersion"].startswith("trainer.kubeflow.org/")] + trainjob_pods(docs)
    files = []
    for i, d in enumerate(objects):
        files.append(folder / f"{i:02d}-{d['kind'].lower()}-{d['metadata']['name']}.json")
        files[-1].write_text(json.dumps(d), encoding="utf-8")
    return files


def test_train_containerfile_passes_hadolint() -> None:
    out = _run([_tool("hadolint"), REPO / "Containerfile.train"])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_native_objects_and_pods_are_valid_kubernetes(version: str, variants: dict[str, list[dict]],
                                                      tmp_path: Path) -> None:
    for name, docs in variants.items():
        folder = tmp_path / name
        folder.mkdir()
        files = _native_and_pods(docs, folder)
        out = _run([_tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, *files])
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Couldn't find schema" not in out.stdout + out.stderr
        assert out.stdout.count(" passed ") == len(files) == 6, out.stdout  # 2 PVCs, NetworkPolicy, prepare Job, 2 pods


def test_trainjob_and_runtime_are_kubeflow_trainers_api(variants: dict[str, list[dict]], tmp_path: Path) -> None:
    """Every key of the TrainJob and the TrainingRuntime (its JobSet, Job and pod templates included) is a field of
    Kubeflow Trainer's API models: the generated models drop what they do not know, so a round trip must return
    the object unchanged. A misspelt key is caught (checked on a copy with one)."""
    script = """
import json, sys
from kubeflow_trainer_api import models as m
kinds = {"TrainJob": m.TrainerV1alpha1TrainJob, "TrainingRuntime": m.TrainerV1alpha1TrainingRuntime}
out = []
for doc in json.load(sys.stdin):
    back = kinds[doc["kind"]].from_dict(doc).to_dict()
    out.append(back == doc)
print(json.dumps(out))
"""
    for docs in variants.values():
        objects = [d for d in docs if d["kind"] in ("TrainJob", "TrainingRuntime")]
        assert {d["kind"] for d in objects} == {"TrainJob", "TrainingRuntime"}
        misspelt = json.loads(json.dumps(one(objects, "TrainingRuntime")))
        misspelt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["backofLimit"] = 0
        out = _run([_tool("python"), "-c", script], input=json.dumps([*objects, misspelt]))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [True, True, False]


def test_checkov_passes_or_each_skip_is_justified(variants: dict[str, list[dict]], tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"  # checkov recognises container files by this name only
    dockerfile.write_text((REPO / "Containerfile.train").read_text(encoding="utf-8"), encoding="utf-8")
    files = [dockerfile]
    for name, docs in variants.items():
        (tmp_path / name).mkdir()
        files += _native_and_pods(docs, tmp_path / name)
    by_type = _checkov(files, ["kubernetes", "dockerfile"], tmp_path)
    assert by_type["kubernetes"]["summary"]["passed"] >= 100


# ------------------------------------------------------------------------------------ what the objects say


def _parse(subcommand: str, args: list[str]) -> object:
    import argparse
    import importlib

    from trainer.__main__ import SUBCOMMANDS

    parser = argparse.ArgumentParser(prog=f"python -m trainer {subcommand}", exit_on_error=False)
    importlib.import_module(SUBCOMMANDS[subcommand][0]).add_arguments(parser)
    return parser.parse_args(args)


def _mounts(c: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in c["volumeMounts"]}


def test_the_pods_run_the_trainer_as_its_image_user_writing_only_the_run_folder(
        variants: dict[str, list[dict]]) -> None:
    text = (REPO / "Containerfile.train").read_text(encoding="utf-8")
    assert re.search(r"^USER (\d+):(\d+)$", text, re.M).groups() == (str(APP_UID), str(APP_UID))
    for variant, docs in variants.items():
        pods = trainjob_pods(docs)
        assert len(pods) == one(docs, "TrainJob")["spec"]["trainer"]["numNodes"] == 2
        for pod in pods:
            spec, c = pod["spec"], container(pod)
            assert c["command"][:3] == ["/opt/venv/bin/python", "-m", "trainer"]
            args = _parse(c["command"][3], c["args"])
            assert args.resume == "auto", "restart is resume: the same command continues after any restart"
            mounts = _mounts(c)
            assert Path(args.out).parent.as_posix() in mounts and not mounts["/runs"].get("readOnly")
            prepared = next(a.split("=", 1)[1] for a in args.overrides if a.startswith("data.prepared="))
            assert Path(prepared).parent.as_posix() in mounts and mounts["/data"]["readOnly"] is True
            assert spec["securityContext"]["runAsUser"] == APP_UID and spec["securityContext"]["runAsNonRoot"]
            assert c["securityContext"]["readOnlyRootFilesystem"] is True and "/tmp" in mounts  # HOME, JIT cache
            assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
            assert spec["terminationGracePeriodSeconds"] >= 120  # one step and one checkpoint after SIGTERM
            limits = c["resources"]["limits"]
            assert limits["memory"] == c["resources"]["requests"]["memory"]
            assert ("nvidia.com/gpu" in limits) == (variant == "gpu")
            name, digest = c["image"].split("@")  # by digest: a tag can be moved to another image
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest)
            assert name.endswith("transfer-sentiment-train-cuda13" if variant == "gpu" else "transfer-sentiment-train")
    # The prepare Job writes the folder the TrainJob reads.
    prepare = one(variants["cpu"], "Job")["spec"]["template"]["spec"]
    (pc,) = prepare["containers"]
    args = _parse(pc["command"][3], pc["args"])
    assert args.out == prepared and not _mounts(pc)["/data"].get("readOnly")


# The Job controller's podFailurePolicy and JobSet's failurePolicy, replayed (their rules: first match wins).


def _job_failure(job_spec: dict, pod: str, exit_code: int | None, condition: str | None) -> tuple[str, str]:
    """(reason, message) of the Job when one of its pods ends so (exit code of container "node", or a pod
    condition), as Kubernetes' job controller words them (pkg/controller/job/pod_failure_policy.go)."""
    for index, rule in enumerate(job_spec["podFailurePolicy"]["rules"]):
        codes = rule.get("onExitCodes")
        if codes and exit_code and codes.get("containerName", "node") == "node" \
                and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            if rule["action"] == "FailJob":
                return "PodFailurePolicy", (f"Container node for pod ns/{pod} failed with exit code {exit_code} "
                                            f"matching FailJob rule at index {index}")
            break
        conditions = rule.get("onPodConditions")
        if conditions and any(c["type"] == condition and c.get("status", "True") == "True" for c in conditions):
            if rule["action"] == "FailJob":
                return "PodFailurePolicy", (f"Pod ns/{pod} has condition {condition} matching FailJob rule at "
                                            f"index {index}")
            break
    assert job_spec["backoffLimit"] == 0
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _jobset_action(policy: dict, reason: str, message: str) -> str:
    for rule in policy.get("rules", []):
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return rule["action"]
    return "RestartJobSet"  # JobSet's default: counted against maxRestarts


@pytest.mark.parametrize("exit_code, condition, action", [
    (2, None, "FailJobSet"),  # bad input: the same command would fail again
    (143, None, "RestartJobSetAndIgnoreMaxRestarts"),  # SIGTERM, checkpoint written: every pod ends so
    (130, None, "RestartJobSetAndIgnoreMaxRestarts"),
    (143, "DisruptionTarget", "RestartJobSetAndIgnoreMaxRestarts"),  # the preempted pod itself
    (137, "DisruptionTarget", "RestartJobSetAndIgnoreMaxRestarts"),  # killed at the end of the grace period
    (1, None, "RestartJobSet"),  # a crash: retried, at most maxRestarts times
    (137, None, "RestartJobSet"),  # the OOM killer
    (12, None, "RestartJobSet"),  # 2 inside another code is not bad input
])
def test_restart_policy(variants: dict[str, list[dict]], exit_code: int, condition: str | None,
                        action: str) -> None:
    runtime = one(variants["cpu"], "TrainingRuntime")["spec"]["template"]["spec"]
    (rjob,) = runtime["replicatedJobs"]
    reason, message = _job_failure(rjob["template"]["spec"], "pretrain-demo-node-0-1-x7k2p", exit_code, condition)
    assert _jobset_action(runtime["failurePolicy"], reason, message) == action, (reason, message)
    assert 1 <= runtime["failurePolicy"]["maxRestarts"] <= 10
