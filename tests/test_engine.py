"""trainer/engine/deepspeed_engine.py and the data side of trainer/tasks/pretrain.py, in-process and fast: the derived
DeepSpeed JSON and the checks on a user's JSON, the learning-rate schedule, the distributed environment (Slurm, plain
python), windows,
MLM masking and the cut of a global batch into micro-batches. Launcher-level behaviour is in test_training.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import REPO

from trainer.config.presets import lab, tiny
from trainer.config.schema import ConfigError, OptimConfig, override
from trainer.data.corpus import FORMAT, MANIFEST, PreparedCorpus, ShardWriter, token_dtype
from trainer.data.windows import Windows
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop
from trainer.tasks.pretrain import WindowBatcher


def write(tmp_path: Path, data: object, name: str = "ds.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return str(p)


# ---------------------------------------------------------------------------------------------- DeepSpeed JSON


def test_derived_config_follows_run_config() -> None:
    cfg = override(tiny(), {"engine.zero_stage": 2, "engine.grad_accum": 3, "engine.precision": "bf16"})
    ds, plan = eng.ds_config(cfg, "pretrain", world=2, cuda=False)
    assert ds["train_micro_batch_size_per_gpu"] == 13 and ds["gradient_accumulation_steps"] == 3
    assert "train_batch_size" not in ds  # DeepSpeed infers it
    assert plan == eng.BatchPlan(13, 3, 2) and plan.global_batch == 78
    # ZeRO 1/2 without DeepSpeed's per-gradient copies into a contiguous buffer (tests/test_step_work.py counts them)
    assert ds["zero_optimization"] == {"stage": 2, "contiguous_gradients": False}
    # bf16: autocast over fp32 weights (DeepSpeed's torch_autocast), not DeepSpeed's bf16 weights
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not ds["bf16"]["enabled"]
    assert eng.precision_of(ds) == "bf16-autocast"
    fp32, _ = eng.ds_config(override(cfg, {"engine.precision": "fp32"}), "pretrain", world=2, cuda=False)
    assert not fp32["torch_autocast"]["enabled"] and eng.precision_of(fp32) == "fp32"
    params = ds["optimizer"]["params"]
    # DeepSpeed's "Adam" silently means AdamW unless adam_w_mode is false; torch_adam avoids FusedAdam's JIT on CPU.
    assert ds["optimizer"]["type"] == "Adam" and params["adam_w_mode"] is False and params["torch_adam"] is True
    assert params["lr"] == cfg.pretrain.optim.lr and ds["gradient_clipping"] == 0.5
    assert ds["timers"] == {"throughput": {"enabled": False}}  # DeepSpeed's timer syncs the device twice a step

    ft, _ = eng.ds_config(override(lab(), {"finetune.optim.name": "adamw"}), "finetune", world=1, cuda=True)
    assert ft["train_micro_batch_size_per_gpu"] == 8 and ft["optimizer"]["type"] == "AdamW"
    assert ft["optimizer"]["params"]["adam_w_mode"] is True and "torch_adam" not in ft["optimizer"]["params"]
    assert ft["optimizer"]["params"]["lr"] == 1e-4


def test_user_json_overrides_keys(tmp_path: Path) -> None:
    user = write(tmp_path, {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "train_batch_size": 52})
    ds, plan = eng.ds_config(tiny(), "pretrain", world=2, user_json=user, cuda=False)
    assert ds["gradient_clipping"] == 1.0 and ds["zero_optimization"] == {"stage": 1, "contiguous_gradients": False}
    for zero, kept in (({"stage": 2, "contiguous_gradients": True}, True), ({"stage": 3}, None), ({"stage": 0}, None)):
        ds, _ = eng.ds_config(tiny(), "pretrain", 1, user_json=write(tmp_path, {"zero_optimization": zero}), cuda=False)
        assert ds["zero_optimization"].get("contiguous_gradients") is kept, zero  # the user's, or DeepSpeed's default
    assert ds["optimizer"]["type"] == "Adam"  # untouched keys keep the derived values
    assert plan.micro_batch == 26 and plan.global_batch == 52  # the global batch fixed the micro-batch
    # DeepSpeed's own bf16 or fp16 mode, asked for by the user's JSON, replaces our autocast (never both)
    bf16 = override(tiny(), {"engine.precision": "bf16"})
    for mode in ("bf16", "fp16"):
        ds, _ = eng.ds_config(bf16, "pretrain", 1, user_json=write(tmp_path, {mode: {"enabled": True}}), cuda=False)
        assert ds[mode]["enabled"] and not ds["torch_autocast"]["enabled"] and eng.precision_of(ds) == mode
    ds, _ = eng.ds_config(bf16, "pretrain", 1, user_json=write(tmp_path, {"bf16": {"enabled": False}}), cuda=False)
    assert ds["torch_autocast"]["enabled"] and eng.precision_of(ds) == "bf16-autocast"
    half = write(tmp_path, {"torch_autocast": {"enabled": True, "dtype": "float16"}})
    assert eng.precision_of(eng.ds_config(bf16, "pretrain", 1, user_json=half, cuda=False)[0]) == "fp16-autocast"
    both = write(tmp_path, {"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}})
    with pytest.raises(eng.EngineConfigError, match=r"ds\.json: bf16 and torch_autocast are both enabled: choose one"):
        eng.ds_config(bf16, "pretrain", 1, user_json=both, cuda=False)


@pytest.mark.parametrize(
    "data, words",
    [
        ({"gradient_clippping": 1.0}, ["gradient_clippping", "unknown"]),
        ({"train_batch_size": 27}, ["train_batch_size=27", "not divisible"]),
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 7}, ["train_batch_size=30", "(= 14)"]),
        ({"zero_optimization": {"stagee": 2}}, ["stagee"]),
        ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps", ">= 1"]),
        ("{\n  \"bf16\": {\n", ["invalid JSON", "line"]),
        ([1, 2], ["JSON object"]),
    ],
)
def test_bad_user_json_names_file_and_key(tmp_path: Path, data: object, words: list[str]) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:  # read_json's errors (the one JSON reader), or EngineConfigError's
        eng.ds_config(tiny(), "pretrain", world=2, user_json=path, cuda=False)
    assert path in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_missing_user_json() -> None:
    with pytest.raises(ConfigError, match="DeepSpeed config file not found: /nonexistent/ds.json"):
        eng.ds_config(tiny(), "pretrain", world=1, user_json="/nonexistent/ds.json", cuda=False)


def test_known_keys_come_from_deepspeed() -> None:
    keys = eng.known_keys()
    assert {"optimizer", "scheduler", "zero_optimization", "bf16", "gradient_clipping",
            "train_micro_batch_size_per_gpu", "flops_profiler", "activation_checkpointing"} <= keys
    assert "gradient_clippping" not in keys


# ---------------------------------------------------------------------------------------------- schedule


def test_lr_schedule_warmup_never_zero_and_decay_ends_at_a_tenth() -> None:
    total = 100
    cos = OptimConfig(warmup_steps=10, schedule="cosine")
    f = [eng.lr_factor(s, cos, total) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[0] > 0  # not DeepSpeed WarmupLR's lr 0 at step 1
    assert f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    lin = [eng.lr_factor(s, OptimConfig(schedule="linear"), total) for s in range(total)]
    assert lin[0] == 1.0 and lin[-1] == pytest.approx(0.1) and lin[50] == pytest.approx(1 - 0.9 * 50 / 99)
    assert {eng.lr_factor(s, OptimConfig(), total) for s in range(total)} == {1.0}


# ---------------------------------------------------------------------------------------------- environment


def test_slurm_variables_become_torch_distributed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the node list is parsed here
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "123456"}
    eng.prepare_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"]) == ("5", "8", "1", "4")
    assert env["MASTER_ADDR"] == "gpu07"
    assert env["MASTER_PORT"] == str(20000 + 123456 % 20000)  # the same on every rank without talking


def test_launcher_variables_are_kept() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "SLURM_PROCID": "7", "SLURM_NTASKS": "9", "LOCAL_SIZE": "2"}
    before = dict(env)
    assert eng.prepare_env(env) == []
    assert env == before


def test_importing_the_engine_leaves_the_environment_alone(tmp_path: Path) -> None:
    """Only DS_ACCELERATOR (read by DeepSpeed's own import) is set at import, to the device the process group will
    serve; PATH and the JIT cache folder are set by init_distributed, through process_defaults."""
    code = ("import os, json; before = dict(os.environ); import trainer.engine.deepspeed_engine as e; "
            "after = dict(os.environ); "
            "changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)); "
            "accel = [after['DS_ACCELERATOR'], e.get_accelerator().device_name(), e.dist_info().device.type]; "
            "env = {'PATH': '/usr/bin:/bin'}; print(json.dumps([changed, accel, e.process_defaults(env), env]))")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")}
    env["PATH"] = "/usr/bin:/bin"  # the venv's bin (with ninja) is not first
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    changed, accel, set_, env_after = json.loads(p.stdout.strip().splitlines()[-1])
    assert changed == ["DS_ACCELERATOR"]
    assert accel == ["cuda" if torch.cuda.is_available() else "cpu"] * 3  # DeepSpeed and our group: one device
    here = Path(sys.executable).parent
    path = {"PATH": f"{here}:/usr/bin:/bin"} if (here / "ninja").exists() else {}  # pip's ninja, in the venv
    assert set_ == {"TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"), **path}
    assert env_after["PATH"] == path.get("PATH", "/usr/bin:/bin")


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_a_ds_accelerator_naming_another_device_stops_with_one_line(tmp_path: Path, stage: str) -> None:
    """DS_ACCELERATOR=cuda without a usable GPU (cpu on a GPU machine) would put DeepSpeed and the process group on
    different devices: one line naming both, exit 2, before anything is written. Before, the Makefile, the tests and
    launch/demo.sh set cpu for every run, GPU nodes included, and deepspeed.initialize broadcast CPU tensors over
    NCCL ("No backend type associated with device type cpu")."""
    cuda = torch.cuda.is_available()
    other, ours = ("cpu", "cuda") if cuda else ("cuda", "cpu")
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": other}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "TS_TRACEBACK"):
        env.pop(k, None)  # one process on loopback; TS_TRACEBACK would add the traceback behind the line
    p = subprocess.run([sys.executable, "-m", "trainer", stage, "--preset", "tiny", "--out", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"error: DeepSpeed's accelerator is {other} (DS_ACCELERATOR={other}) but "
                               f"this rank's process group is {eng.BACKENDS[ours]} on {ours}"), lines[0]
    assert not out.exists()


def test_a_ds_accelerator_deepspeed_refuses_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TS_TRACEBACK"} | {"DS_ACCELERATOR": "tpu"}
    p = subprocess.run([sys.executable, "-m", "trainer", "pretrain", "--preset", "tiny", "--out", str(tmp_path / "r")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: DS_ACCELERATOR=tpu: DS_ACCELERATOR must be one of")


def test_one_device_decision() -> None:
    """The process group follows the device: gloo on a CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU ones
    (an NCCL-only group refuses CPU tensors since PyTorch 2.7)."""
    info = eng.dist_info()
    assert info.device.type == eng.device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert info.backend == eng.BACKENDS[info.device.type]
    assert eng.BACKENDS == {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}


def test_plain_python_is_one_process_on_loopback() -> None:
    env: dict[str, str] = {}
    eng.prepare_env(env)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert 0 < int(env["MASTER_PORT"]) < 65536
    with pytest.raises(eng.EngineConfigError, match="MASTER_PORT is not set for a world of 4"):
        eng.prepare_env({"RANK": "0", "WORLD_SIZE": "4"})


# ---------------------------------------------------------------------------------------------- windows, masks


def corpus_of(tmp_path: Path, lengths: list[int], vocab: int = 99, seed: int = 0) -> tuple[PreparedCorpus, np.ndarray]:
    """A prepared folder of random documents of `lengths` pieces (one shard) -> (corpus, its stream as int64)."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[0], rng.integers(4, vocab, size=n), [2]]) for n in lengths]  # <sos> pieces <eos>
    stream = np.concatenate(docs).astype(np.int64)
    w = ShardWriter(tmp_path, 0, token_dtype(vocab))
    w.add(stream, np.array([len(d) for d in docs]), (0, len(docs)))
    shard = w.close()
    (tmp_path / MANIFEST).write_text(json.dumps({
        "format": FORMAT, "complete": True, "tokenizer": {"fingerprint": "f" * 64, "files": {}}, "vocab_size": vocab,
        "dtype": "uint16", "documents": len(docs), "tokens": len(stream), "shards": [shard]}))
    return PreparedCorpus(tmp_path), stream


def test_clm_windows_predict_every_token_once(tmp_path: Path) -> None:
    c, stream = corpus_of(tmp_path, [0, 1, 5, 6, 7, 30, 100])
    w = Windows(c, 0, c.n_tokens, seq_len=7, overlap=1)
    assert len(w) == (len(stream) - 1) // 7
    b = WindowBatcher(w, "clm", 0.15, 99, seed=0)
    every = list(range(len(w)))
    assert b.n_predicted(every) == 7 * len(w)
    ids, pad, pos, tgt = b.make(every, epoch=0)
    assert ids.shape == (len(w), 7) and not pad.any() and pos.tolist() == list(range(7 * len(w)))
    # Inputs tile the stream; each target is the token after its input, across document boundaries too.
    assert ids.reshape(-1).tolist() == stream[:7 * len(w)].tolist()
    assert tgt.tolist() == stream[1:7 * len(w) + 1].tolist()
    assert b.make(every[::-1], epoch=3)[3].reshape(len(w), 7).flip(0).tolist() == tgt.reshape(len(w), 7).tolist()


def test_mlm_masks_are_bert_style_and_seeded_per_window(tmp_path: Path) -> None:
    c, stream = corpus_of(tmp_path, [200] * 60 + [0, 3])
    w = Windows(c, 0, c.n_tokens, seq_len=24, overlap=0)
    b = WindowBatcher(w, "mlm", 0.15, 99, seed=3)
    batch = list(range(len(w)))
    ids, pad, pos, tgt = b.make(batch, epoch=1)
    assert len(tgt) == b.n_predicted(batch) == len(batch) * round(0.15 * 24) and not pad.any()
    originals = stream[:24 * len(w)]
    assert (originals[pos.numpy()] == tgt.numpy()).all()  # targets are the original tokens
    assert not np.isin(tgt.numpy(), [0, 1, 2]).any()  # never <sos>, <pad> or <eos> (every window has 4+ pieces)
    shown = ids.reshape(-1).numpy()[pos.numpy()]
    frac_mask = float((shown == 3).mean())
    frac_keep = float((shown == tgt.numpy()).mean())
    assert 0.74 < frac_mask < 0.86 and 0.05 < frac_keep < 0.16, (frac_mask, frac_keep)
    untouched = np.ones(ids.numel(), dtype=bool)
    untouched[pos.numpy()] = False
    assert (ids.reshape(-1).numpy()[untouched] == originals[untouched]).all()
    again = b.make(batch[::-1], epoch=1)[3].numpy()  # same windows, other order / other rank: same targets
    assert sorted(again.tolist()) == sorted(tgt.numpy().tolist())
    assert not np.array_equal(b.make(batch, epoch=2)[2].numpy(), pos.numpy())  # a new epoch masks anew


def test_global_batch_cut_is_independent_of_world_size() -> None:
    batch = list(range(100, 126))
    two = loop.micro_batches(batch, eng.BatchPlan(13, 1, 2))
    one = loop.micro_batches(batch, eng.BatchPlan(26, 1, 1))
    assert one == [batch] and two[0] + two[1] == batch
    accum = loop.micro_batches(batch, eng.BatchPlan(4, 3, 2))  # micro-step a of rank r is slot a * W + r
    assert sorted(sum(accum, [])) == batch and len(accum) == 6
    assert loop.full_batches([[1, 2, 3], [4]], eng.BatchPlan(1, 1, 2)) == [[1, 2, 3]]



# ---------------------------------------------------------------------------------------------- precision


def test_precision_auto_reads_the_cpu_flags(tmp_path: Path) -> None:
    from trainer.engine import precision

    with_bf16, without = tmp_path / "bf16", tmp_path / "plain"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert precision.cpu_has_bf16(str(with_bf16)) and not precision.cpu_has_bf16(str(without))
    assert not precision.cpu_has_bf16(str(tmp_path / "none"))  # no /proc/cpuinfo: no claim of bf16 units
    here = precision.cpu_has_bf16()
    assert precision.resolve("auto", cuda=False) == ("bf16" if here else "fp32")
    assert precision.resolve("fp32", cuda=False) == "fp32" and precision.resolve("bf16", cuda=False) == "bf16"
    with pytest.raises(ValueError, match="engine.precision must be fp32, bf16 or auto"):
        precision.resolve("fp16", cuda=False)
    ds, _ = eng.ds_config(override(tiny(), {"engine.precision": "auto"}), "pretrain", 1, cuda=False)
    assert ds["torch_autocast"]["enabled"] is here
