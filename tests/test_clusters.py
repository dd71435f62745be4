"""Restart is resume, the way clusters run training: one command, `--resume auto`, for the first start and every
restart, under the DeepSpeed launcher, Kubeflow Trainer's pods (deploy/train) and a Slurm batch job
(launch/train.sbatch). Each run here is 2 ranks of the tiny preset on a prepared corpus, stopped half-way as its
scheduler stops it, then started again with the same command; each must end with the weights of one uninterrupted
2-rank `deepspeed` run (the sha256 of the artifact's model.safetensors: resume replays the same numbers bit for bit).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import procs
import psutil
import pytest
from procs import BIN, REPO, env, free_port
from test_interrupt import interrupted_at, started
from train_pods import container, env_of, trainjob_pods

from trainer.engine import checkpoint as ckpt
from trainer.engine.distributed import EngineConfigError, prepare_env

# ZeRO-2 (each rank its own optimizer shard), dropout (RNG per micro-step), a checkpoint every 5 steps.
SETTINGS = ["--preset=tiny", "--set=pretrain.micro_batch=7", "--set=engine.zero_stage=2", "--set=model.dropout=0.1",
            "--set=pretrain.max_steps=30", "--set=engine.checkpoint_every=5", "--set=engine.log_every=1"]


def sha256(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "artifact" / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_tokenizer_dir: Path) -> Path:
    """What deploy/train's volumes hold, in a local folder: data/raw (the data sets), data/prepared (the tiny
    corpus, prepared once as prepare-job.yaml does) and runs/ (run folders)."""
    root = tmp_path_factory.mktemp("volumes")
    (root / "data").mkdir()
    (root / "data" / "raw").symlink_to(data_dir)
    (root / "runs").mkdir()
    p = procs.run([sys.executable, "-m", "trainer", "prepare", "--preset=tiny", f"--set=data.root={root}/data/raw",
                   "--tokenizer", str(tiny_tokenizer_dir), "--out", str(root / "data" / "prepared")], 300,
                  cwd=REPO, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    return root


def run_args(volumes: Path, out: Path) -> list[str]:
    return [*SETTINGS, f"--set=data.root={volumes}/data/raw", f"--set=data.prepared={volumes}/data/prepared",
            "--resume=auto", f"--out={out}"]


def deepspeed(args: list[str], port: int) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), "launch/pretrain.sh", *args]


def finish(p: subprocess.Popen[str], timeout: float = 300) -> str:
    try:
        return p.communicate(timeout=timeout)[0]
    finally:
        procs.kill_group(p)


@pytest.fixture(scope="module")
def references(volumes: Path) -> Callable[[str], str]:
    """sha256 of the artifact of one uninterrupted 2-rank `deepspeed` run, by OMP_NUM_THREADS ("": unset, each rank
    then takes its share of the cores). Bits depend on the threads per rank (the order of a matmul's sums), so a
    run is compared with a reference of its own thread count."""
    done: dict[str, str] = {}

    def reference(threads: str = "") -> str:
        if threads not in done:
            out = volumes / "runs" / f"reference{threads}"
            extra = {"OMP_NUM_THREADS": threads} if threads else {}
            p = procs.run(deepspeed(run_args(volumes, out), free_port()), 300, cwd=REPO, env={**env(), **extra})
            assert p.returncode == 0, p.stderr[-3000:]
            assert "holds no run yet: starting one" in p.stderr  # --resume auto on a first start
            done[threads] = sha256(out)
        return done[threads]

    return reference


@pytest.fixture(scope="module")
def reference(references: Callable[[str], str]) -> str:
    return references("")


# ------------------------------------------------------------------------------------------ --resume auto


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 10 minutes
def test_deepspeed_run_stopped_by_sigterm_then_the_same_command_ends_as_uninterrupted(volumes: Path,
                                                                                     reference: str) -> None:
    """SIGTERM to every process of the job (a node shutting down, a spot instance reclaimed), then the identical
    command line again."""
    out = volumes / "runs" / "deepspeed"
    cmd = deepspeed(run_args(volumes, out), free_port())
    p = procs.popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started(out, p, rows=3)
    os.killpg(p.pid, signal.SIGTERM)
    output = finish(p)
    assert p.returncode != 0 and not (out / "artifact").exists(), output[-3000:]
    step, folder = interrupted_at(output, "SIGTERM", "run the same command again to continue (--resume auto)")
    assert folder == str(out / "checkpoints" / ckpt.tag_for(step)), folder
    again = procs.run(cmd, 300, cwd=REPO, env=env())
    assert again.returncode == 0 and f"resumed at step {step}" in again.stderr, again.stderr[-3000:]
    assert sha256(out) == reference
    # Once more after the end: nothing is trained or lost, the artifact is the same.
    done = procs.run(cmd, 300, cwd=REPO, env=env())
    assert done.returncode == 0 and "resumed at step 30" in done.stderr and sha256(out) == reference


# The shell a container's first process should be (README, Clusters): DeepSpeed's runner forwards a signal sent to it
# alone only to pdsh launches, so it forwards the signal to the process group itself.
FORWARDING_SHELL = 'trap "trap \\"\\" TERM; kill -TERM 0" TERM; "$@" & pid=$!; wait $pid; wait $pid'


@pytest.mark.slow  # 30 s: the DeepSpeed runner's behaviour and the README's way around it
def test_sigterm_to_the_deepspeed_command_alone_reaches_the_ranks_only_through_the_forwarding_shell(
        volumes: Path, tmp_path: Path) -> None:
    """A SIGTERM to the `deepspeed` command alone (a container runtime signals its first process; `kill PID`) ends
    the runner and leaves its ranks training; under the README's forwarding shell every rank checkpoints and the
    job exits 143."""
    assert f"sh -c '{FORWARDING_SHELL}' sh deepspeed" in (REPO / "README.md").read_text(encoding="utf-8")
    long = ["--set=pretrain.max_steps=100000"]  # after SETTINGS: the later --set wins
    bare = procs.popen(deepspeed([*run_args(volumes, tmp_path / "bare"), *long], free_port()), cwd=REPO, env=env(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        started(tmp_path / "bare", bare, rows=2)
        ranks = [c for c in psutil.Process(bare.pid).children(recursive=True)
                 if "--local_rank=" in " ".join(c.cmdline())]
        bare.send_signal(signal.SIGTERM)
        bare.wait(timeout=30)
        time.sleep(2)
        # DeepSpeed 0.19.8: the ranks train on, unseen (a rank that ended would be a zombie until reaped)
        assert ranks and all(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)
    finally:
        procs.kill_group(bare)
    out = tmp_path / "wrapped"
    p = procs.popen(["sh", "-c", FORWARDING_SHELL, "sh", *deepspeed([*run_args(volumes, out), *long], free_port())],
                    cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started(out, p, rows=2)
    p.send_signal(signal.SIGTERM)  # to the shell alone
    output = finish(p)
    assert p.returncode == 143 and "interrupted by SIGTERM after step " in output, output[-3000:]
    assert (out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "complete.json").is_file()


def test_resume_auto_never_starts_over_silently(volumes: Path, reference: str, tmp_path: Path) -> None:
    """A rerun that is not the same run, or whose latest checkpoint does not verify, stops with one line and
    changes nothing; a run stopped before its first checkpoint starts again at step 0 and says so."""
    import shutil

    src = volumes / "runs" / "reference"
    out = tmp_path / "copy"
    shutil.copytree(src, out, symlinks=True)

    def trainer(args: list[str]) -> subprocess.CompletedProcess[str]:
        return procs.run([sys.executable, "-m", "trainer", "pretrain", *args], 300, cwd=REPO, env=env())

    def files() -> list[tuple[Path, int, int]]:  # (name, bytes, mtime) of every file in the run folder
        return sorted((p.relative_to(out), p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*")
                      if p.is_file())

    before = files()
    p = trainer([*run_args(volumes, out), "--set=pretrain.max_steps=31"])
    assert p.returncode == 2 and "pretrain.max_steps: 30 -> 31" in p.stderr, p.stderr[-2000:]
    victim = out / "checkpoints" / ckpt.read_latest(out / "checkpoints") / "mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:-7])
    p = trainer(run_args(volumes, out))
    assert p.returncode == 2 and f"{victim}: corrupt" in p.stderr, p.stderr[-2000:]
    victim.unlink()
    shutil.copy(src / victim.relative_to(out), victim)
    assert [f for f in files() if out / f[0] != victim] == [f for f in before if out / f[0] != victim]

    # Stopped before its first checkpoint: config.json and metrics.csv, no checkpoint. Starts again at step 0.
    early = tmp_path / "early"
    early.mkdir()
    shutil.copy(src / "config.json", early / "config.json")
    (early / "metrics.csv").write_text("step,epoch,loss\n1,0,4.6\n")
    p = trainer([*run_args(volumes, early), "--set=pretrain.max_steps=2"])
    assert p.returncode == 2 and "pretrain.max_steps: 30 -> 2" in p.stderr  # still its own config only
    p = trainer([*run_args(volumes, early), "--stop-at=1"])
    assert p.returncode == 0 and "no complete checkpoint (it stopped before its first one): training again from " \
        "step 0" in p.stderr, p.stderr[-2000:]


# ------------------------------------------------------------------------------- Kubernetes (deploy/train)


def test_prepare_env_maps_a_trainjob_pod_to_one_rank() -> None:
    pod = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "job-node-0-0.job",
           "PET_MASTER_PORT": "29500"}
    e = dict(pod)
    prepare_env(e)
    assert {k: e[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "MASTER_ADDR": "job-node-0-0.job",
        "MASTER_PORT": "29500"}
    under_torchrun = {**pod, "PET_NPROC_PER_NODE": "8", "RANK": "13", "WORLD_SIZE": "32", "LOCAL_RANK": "5",
                      "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "job-node-0-0.job", "MASTER_PORT": "29500"}
    prepare_env(under_torchrun)  # torchrun's own variables win
    assert (under_torchrun["RANK"], under_torchrun["LOCAL_SIZE"]) == ("13", "8")
    with pytest.raises(EngineConfigError, match=r"PET_NPROC_PER_NODE=auto: a pod of several ranks needs a launcher"):
        prepare_env({**pod, "PET_NPROC_PER_NODE": "auto"})


@pytest.fixture(scope="module")
def trainjob_docs() -> list[dict]:
    from test_deploy_manifests import _docs, _tool

    rendered = procs.run([str(_tool("kubectl")), "kustomize", str(REPO / "deploy" / "train")], 120)
    assert rendered.returncode == 0, rendered.stderr
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    path = folder / f"train-rendered-{os.getpid()}.yaml"
    path.write_text(rendered.stdout)
    try:
        return _docs(path)
    finally:
        path.unlink()


@pytest.mark.slow  # 49 s; restart-is-resume runs by default under deepspeed (the SIGTERM test above)
def test_trainjob_pods_as_local_processes_preempted_then_restarted(trainjob_docs: list[dict], volumes: Path,
                                                                   references: Callable[[str], str]) -> None:
    """The rendered TrainJob's pods (tests/train_pods.py: what Kubeflow Trainer, JobSet and the Job controller add)
    run as 2 local processes with their containers' command and environment. Differences from a cluster: the
    image's interpreter is this venv's, the volumes' mount paths point into a local folder, the tiny settings are
    appended to the args, and pod 0's DNS name and fixed port 29500 become 127.0.0.1 and a free port.
    Pod 1 is preempted (SIGTERM to its process, the kubelet's signal to the container): both pods must exit 143,
    the code deploy/train/runtime.yaml's podFailurePolicy restarts without counting; then JobSet starts both pods
    again with the same commands. The reference `deepspeed` run has the pods' OMP_NUM_THREADS (their CPU limit)."""
    pods = trainjob_pods(trainjob_docs)
    assert len(pods) == 2
    port = free_port()
    mounts = {m["mountPath"]: m for m in container(pods[0])["volumeMounts"]}
    local = {"/runs": str(volumes / "runs"), "/data": str(volumes / "data")}
    assert set(local) <= set(mounts)

    def start(pod: dict) -> subprocess.Popen[str]:
        pod_env = env_of(pod)
        assert pod_env["PET_MASTER_ADDR"] == "pretrain-demo-node-0-0.pretrain-demo"
        assert pod_env["PET_MASTER_PORT"] == "29500" and pod_env["PET_NPROC_PER_NODE"] == "1"
        pod_env.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
        c = container(pod)
        args = []
        for a in c["args"]:
            for mount, path in local.items():
                a = a.replace(f"={mount}/", f"={path}/")
            args.append(a)
        assert c["command"][0] == "/opt/venv/bin/python"
        return procs.popen([sys.executable, *c["command"][1:], *args, *SETTINGS], cwd=REPO,
                           env={**env(), **pod_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    out = volumes / "runs" / "pretrain-demo"
    first = [start(pod) for pod in pods]
    started(out, first[0], rows=3)
    first[1].send_signal(signal.SIGTERM)
    outputs = [finish(p) for p in first]
    assert [p.returncode for p in first] == [143, 143], outputs[0][-2000:] + outputs[1][-2000:]
    assert ckpt.find(out / "checkpoints") and not (out / "artifact").exists()

    again = [start(pod) for pod in pods]
    outputs = [finish(p) for p in again]
    assert [p.returncode for p in again] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "resumed at step" in outputs[0]
    assert sha256(out) == references(env_of(pods[0])["OMP_NUM_THREADS"])


@pytest.mark.slow  # 11 s; torchrun's rank environment, beside the deepspeed route that runs by default
def test_a_whole_node_pod_under_torchrun(volumes: Path, reference: str) -> None:
    """A pod of 2 ranks (PET_NPROC_PER_NODE=2) needs a launcher: `torchrun --module trainer` reads the PET_*
    variables itself and the ranks take torchrun's RANK, LOCAL_RANK, LOCAL_WORLD_SIZE (deploy/train/README.md)."""
    out = volumes / "runs" / "torchrun"
    pet = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": str(free_port())}
    p = procs.run([str(BIN / "torchrun"), "--module", "trainer", "pretrain", *run_args(volumes, out)], 300, cwd=REPO,
                  env={**env(), **pet})
    assert p.returncode == 0, p.stderr[-3000:]
    assert sha256(out) == reference


# ----------------------------------------------------------------------------------- Slurm (launch/train.sbatch)


def test_slurm_batch_script_asks_for_what_restart_needs() -> None:
    text = (REPO / "launch" / "train.sbatch").read_text(encoding="utf-8")
    options = {line.split()[1].split("=")[0] for line in text.splitlines() if line.startswith("#SBATCH ")}
    assert {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--requeue", "--signal", "--time",
            "--open-mode"} <= options
    assert "#SBATCH --signal=B:USR1@" in text  # to the batch shell, which stops the ranks and requeues
    assert procs.run(["bash", "-n", str(REPO / "launch" / "train.sbatch")], 60).returncode == 0
    p = procs.run(["bash", str(REPO / "launch" / "train.sbatch"), "export", "x"], 60, env=env())
    assert p.returncode == 2 and "usage: sbatch launch/train.sbatch pretrain|finetune" in p.stderr




def _slurm_job_id() -> int:
    """A job id whose derived MASTER_PORT (20000 + id % 20000, trainer/engine/distributed.py) is free here."""
    for _ in range(100):
        port = free_port()
        if 20000 <= port < 40000:
            return 100000 + port - 20000
    raise AssertionError("no free port between 20000 and 40000")


@pytest.mark.slow  # 22 s; as above, for the Slurm payload
def test_slurm_batch_script_at_its_time_limit_requeues_and_continues(volumes: Path, reference: str,
                                                                      tmp_path: Path) -> None:
    """launch/train.sbatch run as the batch step of a one-node, 2-task job, with srun and scontrol stand-ins
    (tests/slurm_standin.py: each task gets the SLURM_* variables srun gives it). Near the time limit Slurm sends
    USR1 to the batch shell (--signal=B:USR1@300): the script stops the ranks through srun, they checkpoint and
    exit 143, the script requeues the job. The requeued job (the same script, SLURM_RESTART_COUNT=1) continues.
    Bad input is not requeued (with --kill-on-bad-exit srun may report the 143 of the task it stopped: the script
    requeues only after its own stop)."""
    standin = tmp_path / "bin"
    standin.mkdir()
    for name in ("srun", "scontrol"):
        (standin / name).symlink_to(REPO / "tests" / "slurm_standin.py")
    log = tmp_path / "slurm.log"
    log.touch()
    job = _slurm_job_id()
    job_env = {**env(), "PATH": f"{standin}{os.pathsep}{env()['PATH']}", "SLURM_STANDIN_LOG": str(log),
               "SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_JOB_NAME": "transfer-sentiment",
               "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost", "SLURM_NNODES": "1",
               "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_NTASKS_PER_NODE": "2",
               "SLURM_TASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1", "SLURM_SUBMIT_DIR": str(REPO),
               "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # the batch step's own
    out = volumes / "runs" / "slurm"
    args = [a for a in run_args(volumes, out) if a != "--resume=auto"]  # the script adds it
    cmd = ["bash", str(REPO / "launch" / "train.sbatch"), "pretrain", *args]

    batch = procs.popen(cmd, cwd=tmp_path, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started(out, batch, rows=3)
    tasks = [c for c in psutil.Process(batch.pid).children(recursive=True)
             if "trainer" in c.cmdline() and "pretrain" in c.cmdline()]
    assert len(tasks) == 2, tasks
    assert sorted(t.environ()["SLURM_PROCID"] for t in tasks) == ["0", "1"]
    os.kill(batch.pid, signal.SIGUSR1)
    output = finish(batch)
    assert batch.returncode == 143, output[-3000:]
    assert "time limit near: stopping the ranks (SIGTERM)" in output
    assert "interrupted by SIGTERM after step" in output and not (out / "artifact").exists()
    assert log.read_text() == f"requeue {job}\n"

    requeued = procs.run(cmd, 300, cwd=tmp_path, env={**job_env, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"job {job} start 2 on localhost" in requeued.stderr and "resumed at step" in requeued.stderr
    assert sha256(out) == reference and log.read_text() == f"requeue {job}\n"

    bad = procs.run([*cmd, "--set=pretrain.no_such_key=1"], 300, cwd=tmp_path, env=job_env)
    assert bad.returncode in (2, 143) and "unknown config key 'pretrain.no_such_key'" in bad.stderr, bad.stderr[-2000:]
    assert log.read_text() == f"requeue {job}\n"  # not requeued: the same input would fail again
