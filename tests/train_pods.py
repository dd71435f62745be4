"""The pods Kubeflow Trainer makes of deploy/train's TrainJob, as its controllers would: for the manifest checks
(kubernetes-validate and checkov know Pods, not TrainJobs) and for running those pods' commands as local processes.

What each controller adds, from their sources (Kubeflow Trainer's Torch plugin, pkg/runtime/framework/plugins/torch/
torch.go; JobSet; Kubernetes' Indexed Job):
- the TrainJob's trainer fields (image, command, args, env, resourcesPerNode) onto the container named "node" of
  the runtime's replicated job labelled trainer.kubeflow.org/trainjob-ancestor-step=trainer;
- PET_NNODES (numNodes), PET_NPROC_PER_NODE (numProcPerNode, "auto" when unset), PET_NODE_RANK (the pod's
  completion index, through the annotation batch.kubernetes.io/job-completion-index), PET_MASTER_ADDR
  (<trainjob>-node-0-0.<trainjob>: pod 0 by JobSet's stable host name), PET_MASTER_PORT (29500), and that port;
- JOB_COMPLETION_INDEX (the same annotation), the host name <jobset>-<replicated job>-<job index>-<completion
  index> and the subdomain <jobset> (JobSet's headless Service).
"""

from __future__ import annotations

import copy
from typing import Any

ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
TRAINER_PORT = 29500


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def _upsert(items: list[dict], item: dict, key: str = "name") -> None:
    for i, old in enumerate(items):
        if old[key] == item[key]:
            items[i] = item
            return
    items.append(item)


def trainjob_pods(docs: list[dict]) -> list[dict]:
    """The Pods of the (one) TrainJob in `docs`, in completion-index order."""
    job = one(docs, "TrainJob")
    runtime = one(docs, job["spec"]["runtimeRef"]["kind"], job["spec"]["runtimeRef"]["name"])
    (rjob,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
               if r["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR) == "trainer"]
    trainer = job["spec"].get("trainer", {})
    policy = runtime["spec"]["mlPolicy"]
    nodes = trainer.get("numNodes", policy.get("numNodes", 1))
    nproc = trainer.get("numProcPerNode", "auto")
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    pods = []
    for index in range(nodes):
        template = copy.deepcopy(rjob["template"]["spec"]["template"])
        (node,) = [c for c in template["spec"]["containers"] if c["name"] == "node"]
        for key in ("image", "command", "args"):
            if key in trainer:
                node[key] = trainer[key]
        if "resourcesPerNode" in trainer:
            node["resources"] = trainer["resourcesPerNode"]
        env = node.setdefault("env", [])
        index_ref = {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}
        for item in [*trainer.get("env", []),
                     {"name": "PET_NNODES", "value": str(nodes)},
                     {"name": "PET_NPROC_PER_NODE", "value": str(nproc)},
                     {"name": "PET_NODE_RANK", "valueFrom": index_ref},
                     {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
                     {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
                     {"name": "JOB_COMPLETION_INDEX", "valueFrom": index_ref}]:
            _upsert(env, item)
        _upsert(node.setdefault("ports", []), {"containerPort": TRAINER_PORT}, key="containerPort")
        meta = template.get("metadata", {})
        pods.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-node-0-{index}", "namespace": namespace,
                         "labels": {**meta.get("labels", {}), "jobset.sigs.k8s.io/jobset-name": name},
                         "annotations": {**meta.get("annotations", {}), INDEX_ANNOTATION: str(index)}},
            "spec": {**template["spec"], "hostname": f"{name}-node-0-{index}", "subdomain": name},
        })
    return pods


def container(pod: dict, name: str = "node") -> dict:
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return c


def env_of(pod: dict, name: str = "node") -> dict[str, str]:
    """The container's environment as the kubelet resolves it: values, the pod's annotations, resource limits."""
    c = container(pod, name)
    out: dict[str, str] = {}
    for item in c.get("env", []):
        if "value" in item:
            out[item["name"]] = item["value"]
            continue
        source: dict[str, Any] = item["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            prefix = "metadata.annotations['"
            assert path.startswith(prefix) and path.endswith("']"), path
            out[item["name"]] = pod["metadata"]["annotations"][path[len(prefix):-2]]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            section, resource = ref["resource"].split(".")
            value = c["resources"][section][resource]
            assert resource == "cpu" and ref.get("divisor", "1") == "1" and str(value).isdigit(), ref
            out[item["name"]] = str(value)
        else:
            raise AssertionError(f"{item['name']}: a source this helper does not resolve: {source}")
    return out
