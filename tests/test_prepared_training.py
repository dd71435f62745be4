"""Pretraining from a prepared folder (trainer/data/prepare.py + trainer/tasks/pretrain.py), real processes and real
DeepSpeed: the same losses as the raw-text run of the same corpus, and the start-up check of per-node copies, where a
different copy on one node stops the ranks of every node with one line naming the node and the file.

The equivalences across world sizes and resume (2 ranks = 1 rank x 2B, resumed = uninterrupted) are in
test_training.py: a raw-text run prepares RUN/prepared first, so they run through this same reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import procs
import pytest
from procs import BIN, REPO, env, free_port
from safetensors.torch import load_file

STEPS = ["--set", "pretrain.max_steps=3", "--set", "engine.log_every=1", "--set", "pretrain.micro_batch=5"]


@pytest.fixture(scope="module")
def base(tiny_tokenizer_dir: Path, data_dir: Path) -> list[str]:
    return ["--preset", "tiny", "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}"]


def trainer(args: list[str], cwd: Path = REPO, ok: bool = True) -> subprocess.CompletedProcess[str]:
    p = procs.run([sys.executable, "-m", "trainer", *args], 300, cwd=cwd, env=env())
    if ok:
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


def losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    return [float(r.split(",")[2]) for r in rows]


def test_prepared_and_raw_text_runs_give_the_same_losses(base: list[str], tmp_path: Path) -> None:
    """The same stream whatever the shard size: a prepare into many small shards, then pretraining from it, equals
    the raw-text run (which prepares RUN/prepared with the default shard size) loss for loss and weight for weight."""
    prepared = tmp_path / "prepared"
    p = trainer(["prepare", *base, "--workers", "2", "--shard-tokens", "3001", "--out", str(prepared)])
    assert f"train with --set data.prepared={prepared}" in p.stdout
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 5
    raw, pre = tmp_path / "raw", tmp_path / "pre"
    trainer(["pretrain", *base, *STEPS, "--out", str(raw)])
    # No --tokenizer: a run from a prepared folder takes the folder's own.
    trainer(["pretrain", *base[:2], *base[4:], *STEPS, "--set", f"data.prepared={prepared}", "--out", str(pre)])
    raw_m = json.loads((raw / "prepared" / "manifest.json").read_text())
    assert len(raw_m["shards"]) == 1 and raw_m["tokens"] == manifest["tokens"]
    assert len(losses(raw)) == 3 and losses(pre) == losses(raw)
    a, b = (load_file(str(d / "artifact" / "model.safetensors")) for d in (raw, pre))
    assert all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow  # 16 s; the check itself runs by default in test_prepare.py (verify names a damaged file)
def test_a_different_copy_on_one_node_stops_every_rank(base: list[str], tmp_path: Path) -> None:
    """Two nodes without shared storage, simulated: two launchers of a hostfile (no ssh), each in its own folder
    holding its own copy of the prepared folder at the same (relative) path. Node 1's copy has one byte changed:
    both launchers fail with exit status 2, and every rank prints the same line naming node 1 and the file."""
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    trainer(["prepare", *base, "--workers", "1", "--shard-tokens", "20000", "--out", str(a / "prepared")])
    trainer(["prepare", *base, "--workers", "1", "--shard-tokens", "20000", "--out", str(b / "prepared")])
    shard = b / "prepared" / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    args = [*base[:2], *base[4:], *STEPS, "--set", "data.prepared=prepared", "--out", str(tmp_path / "run")]

    def node(k: int, cwd: Path) -> subprocess.Popen[str]:
        return procs.popen([str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k),
                            "--master_addr", "127.0.0.1", "--master_port", port, str(REPO / "launch" / "pretrain.sh"),
                            *args], cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    nodes = [node(0, a), node(1, b)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            procs.kill_group(p)
    assert [p.returncode for p in nodes] == [2, 2], outs[0][-3000:] + outs[1][-3000:]
    line = f"node 1 ({_host()}): {shard}: sha256 differs from the manifest's"
    for rank, out in enumerate(outs):
        assert f"error: [rank {rank}] {line}" in out, out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def _host() -> str:
    import socket

    return socket.gethostname()
