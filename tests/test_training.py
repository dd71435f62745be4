"""Training through the real DeepSpeed launcher on CPU (gloo), tiny preset: equivalence, resume, faults, artifacts.

Every run here is a real `deepspeed ... launch/pretrain.sh` (or `python -m trainer`) subprocess. Each launch costs
5-10 s; the first one on a fresh machine also compiles DeepSpeed's shm comm op (~30-90 s, cached in
TORCH_EXTENSIONS_DIR, the repo's .cache/torch_extensions as in the Makefile). Runs are shared through module fixtures.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import procs
import psutil
import pytest
import torch
from procs import BIN, REPO, env, free_port
from safetensors.torch import load_file

TINY = ["--preset", "tiny"]
# 2 ranks x 7 == 1 rank x 14 (odd sizes: shape bugs show)
ONE_STEP = ["--set", "pretrain.max_steps=1"]
# Resume runs: ZeRO-2, accumulation 2, dropout on, warmup + cosine: everything that could drift on resume.
RESUME = ["--set", "pretrain.micro_batch=7", "--set", "engine.zero_stage=2", "--set", "engine.grad_accum=2",
          "--set", "model.dropout=0.1", "--set", "pretrain.optim.schedule=cosine",
          "--set", "pretrain.optim.warmup_steps=3", "--set", "pretrain.max_steps=24",
          "--set", "engine.checkpoint_every=4", "--set", "engine.log_every=1", "--set", "engine.keep_checkpoints=3"]


def run(cmd: list[str], timeout: int = 300, ok: bool = True) -> subprocess.CompletedProcess[str]:
    p = procs.run(cmd, timeout, cwd=REPO, env=env())
    out = p.stdout + p.stderr
    if ok:
        assert p.returncode == 0, f"rc {p.returncode} for {' '.join(cmd)}\n{out[-4000:]}"
        assert "terminate called" not in out  # the gloo exit abort (engine.finish prevents it)
    return p


def deepspeed(args: list[str], ranks: int = 2, launcher: list[str] | None = None, script: str = "launch/pretrain.sh",
              **kw: object) -> subprocess.CompletedProcess[str]:
    return run([str(BIN / "deepspeed"), *(launcher or []), "--num_gpus", str(ranks),
                "--master_port", str(free_port()), script, *args], **kw)  # type: ignore[arg-type]


def trainer(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "trainer", *args], **kw)  # type: ignore[arg-type]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "artifact" / "model.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].detach() - b[k].detach()).abs().max()) for k in a)


def tree_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    return [float(r.split(",")[2]) for r in rows]


@pytest.fixture(scope="module")
def base(tiny_tokenizer_dir: Path, data_dir: Path) -> list[str]:
    return [*TINY, "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run folders shared by the tests of this module, created on first use."""
    return {"root": tmp_path_factory.mktemp("training")}


def once(runs: dict[str, Path], name: str, make: Callable[[Path], object]) -> Path:
    if name not in runs:
        out = runs["root"] / name
        make(out)
        runs[name] = out
    return runs[name]


def one_rank_14(runs: dict[str, Path], base: list[str], zero: int) -> Path:
    """The 1 x 2B reference, through the two other entry routes of the launch script."""
    args = [*base, *ONE_STEP, "--set", "pretrain.micro_batch=14", "--set", f"engine.zero_stage={zero}"]
    if zero == 0:  # `deepspeed --no_python` runs the file with bash
        return once(runs, "one0", lambda out: deepspeed([*args, "--out", str(out)], ranks=1, launcher=["--no_python"]))
    return once(runs, "one2", lambda out: run(["bash", "launch/pretrain.sh", *args, "--out", str(out)]))


def two_ranks_7(runs: dict[str, Path], base: list[str], zero: int) -> Path:
    args = [*base, *ONE_STEP, "--set", "pretrain.micro_batch=7", "--set", f"engine.zero_stage={zero}"]
    return once(runs, f"two{zero}", lambda out: deepspeed([*args, "--out", str(out)]))  # python -u launch/pretrain.sh


# ---------------------------------------------------------------------------------------------- equivalence


# ZeRO-0 is slow (25 s): ZeRO-2 shards more and holds the same equality.
@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_two_ranks_equal_one_rank_with_twice_the_batch(runs: dict[str, Path], base: list[str], zero: int) -> None:
    one, two = weights(one_rank_14(runs, base, zero)), weights(two_ranks_7(runs, base, zero))
    assert max_diff(one, two) < 1e-5
    from trainer.config.presets import tiny
    from trainer.model.encoder import LanguageModel

    torch.manual_seed(0)  # what pretrain builds before the engine: the step really moved the weights
    init = LanguageModel(tiny().model).state_dict()
    assert max_diff(one, init) > 1e-4
    assert json.loads((runs[f"two{zero}"] / "env.json").read_text())["world_size"] == 2


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 10 minutes
def test_zero3_partitions_every_weight_and_trains_like_zero2(runs: dict[str, Path], base: list[str],
                                                            tmp_path: Path) -> None:
    """ZeRO 3 on 2 ranks with every weight partitioned (persistence threshold 0: at this size DeepSpeed would keep them
    all whole): the same weights as ZeRO 2's 2 ranks after a step, and an artifact gathered whole (its writer's own
    check refused the empty shares before)."""
    ds = tmp_path / "z3.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}')
    out = tmp_path / "z3"
    p = deepspeed([*base, *ONE_STEP, "--set", "pretrain.micro_batch=7", "--deepspeed-config", str(ds), "--out",
                   str(out)])  # the JSON's stage alone
    assert "ZeRO 3," in p.stdout + p.stderr  # the stage that runs (the line named the config's 0)
    shares = torch.load(next((out / "checkpoints" / "step00000001").glob("*model_states.pt")), weights_only=False,
                        map_location="cpu")["module"]
    assert any(v.numel() == 0 for v in shares.values())  # the module held shares, not weights
    assert max_diff(weights(out), weights(two_ranks_7(runs, base, 2))) < 1e-5
    # Fine-tuning evaluates each epoch on every rank's share of the batches: 30 valid reviews are one batch, rank 1
    # has none. Each ZeRO 3 forward gathers its layers with a collective, so rank 0 waited for ever (before
    # deepspeed_engine.whole_weights); now the weights are whole during the evaluation.
    ft = tmp_path / "z3-finetune"
    p = deepspeed([*base, "--set", "engine.zero_stage=3", "--set", "finetune.epochs=1", "--set",
                   "data.max_train_examples=40", "--set", "data.max_valid_examples=30", "--set",
                   "data.max_test_examples=30", "--deepspeed-config", str(ds), "--pretrained", str(out / "artifact"),
                   "--out", str(ft)], script="launch/finetune.sh", timeout=240)
    assert "kept epoch 1 of 1" in p.stdout + p.stderr, p.stderr[-2000:]
    from trainer import artifact

    assert artifact.load(ft / "artifact").meta and all(v.numel() > 0 for v in weights(ft).values())



@pytest.mark.slow  # 2 launches of 2 ranks, about 30 s
def test_zero3_in_deepspeeds_bf16_mode_exports_the_fp32_masters(base: list[str], tmp_path: Path) -> None:
    """DeepSpeed's own bf16 mode (a user JSON) under ZeRO 3, every weight partitioned: the artifact is the fp32 master
    weights consolidated from the checkpoint's shares (zero_to_fp32 under the weights-only loader), not the bf16
    module's, and within two bf16 steps (2^-7, relative) of ZeRO 2's: bf16 sums in another order (by hand, 2 steps:
    0.0039, one step of a weight near 1). Was never run (the last notes: "ZeRO 3 + DeepSpeed's bf16 mode
    untested")."""
    runs = {}
    for stage, extra in ((3, ', "stage3_param_persistence_threshold": 0'), (2, "")):
        ds = tmp_path / f"z{stage}.json"
        ds.write_text(f'{{"bf16": {{"enabled": true}}, "zero_optimization": {{"stage": {stage}{extra}}}}}')
        runs[stage] = tmp_path / f"z{stage}"
        p = deepspeed([*base, "--set", "pretrain.max_steps=2", "--set", "pretrain.micro_batch=7",
                       "--deepspeed-config", str(ds), "--out", str(runs[stage])])
        assert f"ZeRO {stage}, bf16" in p.stdout + p.stderr
    z3 = weights(runs[3])
    assert all(v.dtype == torch.float32 for v in z3.values())
    assert any(not torch.equal(v.bfloat16().float(), v) for v in z3.values())  # masters, not bf16 weights
    assert max(float(((z3[k] - v) / v.abs().clamp(min=1)).abs().max()) for k, v in weights(runs[2]).items()) <= 2 ** -7

def test_every_rank_says_its_error_on_a_line_of_its_own(base: list[str], tmp_path: Path) -> None:
    """Both ranks refuse the same input at once (the launcher may kill the second before it speaks): each line that
    gets out is whole (two ranks' lines once ran into one: "...jsonerror: [rank 1] ...")."""
    p = deepspeed([*base, "--deepspeed-config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "run")],
                  ok=False)
    lines = [ln for ln in p.stderr.splitlines() + p.stdout.splitlines() if "error:" in ln and "missing.json" in ln]
    assert p.returncode != 0 and lines and all(re.fullmatch(r"error: \[rank [01]\] DeepSpeed config file not found: "
                                                            r"\S+missing\.json", ln) for ln in lines), lines


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 12 minutes on a host without AVX-512
def test_simulated_two_nodes_equal_one_node(runs: dict[str, Path], base: list[str], tmp_path: Path) -> None:
    """Two launchers, one per 'node' of a hostfile, started without ssh: the path a cluster takes minus ssh."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    out, port = runs["root"] / "two-nodes", str(free_port())
    args = [*base, *ONE_STEP, "--set", "pretrain.micro_batch=7", "--set", "engine.zero_stage=2", "--out", str(out)]

    def node(k: int) -> subprocess.Popen[str]:
        return procs.popen([str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k),
                            "--master_addr", "127.0.0.1", "--master_port", port, "launch/pretrain.sh", *args],
                           cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    nodes = [node(0), node(1)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            procs.kill_group(p)
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "'node-a': [0], 'node-b': [0]" in outs[0]
    assert json.loads((out / "env.json").read_text())["world_size"] == 2
    assert max_diff(weights(out), weights(two_ranks_7(runs, base, 2))) < 1e-6


# ---------------------------------------------------------------------------------------------- resume


def uninterrupted(runs: dict[str, Path], base: list[str]) -> Path:
    return once(runs, "full", lambda out: deepspeed([*base, *RESUME, "--out", str(out)]))


# 51 s; in the default suite, tests/test_clusters.py's SIGTERM-then-same-command test holds the same property
# (2 ranks, ZeRO-2).
@pytest.mark.slow
def test_resume_equals_uninterrupted(runs: dict[str, Path], base: list[str]) -> None:
    full = uninterrupted(runs, base)
    out = runs["root"] / "halves"
    deepspeed([*base, *RESUME, "--out", str(out), "--stop-at", "12"])
    assert not (out / "artifact").exists() and (out / "checkpoints" / "latest").read_text().strip() == "step00000012"
    p = deepspeed([*base, *RESUME, "--out", str(out), "--resume"])
    assert "resumed at step 12" in p.stderr
    assert len(losses(full)) == 24 and np.allclose(losses(out), losses(full), rtol=0, atol=1e-6)
    assert max_diff(weights(out), weights(full)) < 1e-6
    # old checkpoints pruned; latest is the end
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))
    assert tags == ["step00000016", "step00000020", "step00000024"]


# 35 s; a killed rank: tests/test_reliability_training.py's SIGKILL of rank 0 during a save runs by default.
@pytest.mark.slow
def test_sigkill_of_a_rank_then_resume_finishes(runs: dict[str, Path], base: list[str]) -> None:
    full = uninterrupted(runs, base)
    out = runs["root"] / "killed"
    args = [*base, *RESUME, "--out", str(out)]
    launcher = procs.popen([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                            "launch/pretrain.sh", *args], cwd=REPO, env=env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed_at = None
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and launcher.poll() is None:
            latest = out / "checkpoints" / "latest"
            if latest.exists():  # the first checkpoint is done: kill rank 1 in the middle of training
                rank1 = [c for c in psutil.Process(launcher.pid).children(recursive=True)
                         if "--local_rank=1" in c.cmdline()]
                if rank1:
                    killed_at = latest.read_text().strip()
                    os.kill(rank1[0].pid, signal.SIGKILL)
                    break
            time.sleep(0.01)
        output = launcher.communicate(timeout=120)[0]
    finally:
        procs.kill_group(launcher)
    assert killed_at is not None, "the run finished before a rank could be killed"
    assert launcher.returncode != 0, output[-2000:]
    assert not (out / "artifact").exists()
    p = deepspeed([*args, "--resume"])
    assert "resumed at step" in p.stderr
    assert max_diff(weights(out), weights(full)) < 1e-6


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 12 minutes on a host without AVX-512
def test_corrupt_checkpoint_is_refused_and_left_untouched(runs: dict[str, Path], base: list[str],
                                                          tmp_path: Path) -> None:
    src = uninterrupted(runs, base)
    out = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(src), str(out)], check=True)
    victim = out / "checkpoints" / "step00000024" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:-100])  # truncated, as by a full disk
    before = tree_hashes(out / "checkpoints")
    p = trainer(["pretrain", *base, *RESUME, "--out", str(out), "--resume"], ok=False)
    assert p.returncode == 2 and str(victim) in p.stderr and "corrupt" in p.stderr, p.stderr[-2000:]
    assert tree_hashes(out / "checkpoints") == before
    p = trainer(["pretrain", *base, *RESUME, "--out", str(out), "--resume", "step00000016"], ok=False)
    assert p.returncode == 2 and "written by 2 ranks, this run has 1" in p.stderr  # a good one, wrong world size
    p = trainer(["pretrain", *base, *RESUME, "--out", str(out)], ok=False)  # a fresh run into an old run's folder
    assert p.returncode == 2 and f"{out} holds a run" in p.stderr and "--resume" in p.stderr, p.stderr[-2000:]
    assert tree_hashes(out / "checkpoints") == before


def test_missing_resume_folder(base: list[str], tmp_path: Path) -> None:
    p = trainer(["pretrain", *base, "--out", str(tmp_path / "never-ran"), "--resume"], ok=False)
    assert p.returncode == 2 and f"nothing to resume: {tmp_path / 'never-ran' / 'config.json'} not found" in p.stderr
    assert not (tmp_path / "never-ran").exists()


def test_a_setting_pretrained_would_replace_is_refused(base: list[str], tmp_path: Path) -> None:
    """--pretrained fixes the tokenizer and the encoder's shape: a --set of one of them is an error, not dropped."""
    from trainer.config.presets import tiny

    art = tmp_path / "lm"  # only its config.json is read before the refusal
    art.mkdir()
    (art / "config.json").write_text(tiny().to_json())
    p = trainer(["finetune", *base, "--pretrained", str(art), "--set", "tokenizer.max_len=40", "--out",
                 str(tmp_path / "run")], ok=False)
    assert p.returncode == 2 and p.stderr.strip() == (f"error: tokenizer.max_len=40 would be ignored: "
                                                      f"--pretrained {art} fixes it to 48; remove the setting")
    assert not (tmp_path / "run").exists()


def test_a_model_dropout_that_finetune_dropout_replaces_is_refused() -> None:
    from trainer.config.choice import Choice
    from trainer.config.schema import ConfigError
    from trainer.tasks.finetune import resolve_config

    assert resolve_config(Choice("demo"), None).model.dropout == 0.3  # finetune.dropout while fine-tuning
    assert resolve_config(Choice("english"), None).model.dropout == 0.1  # what its results were measured with
    with pytest.raises(ConfigError, match=r"--set model.dropout=0.2 would be ignored: finetune.dropout=0.3"):
        resolve_config(Choice("demo", None, ("model.dropout=0.2",)), None)
    assert resolve_config(Choice("demo", None, ("model.dropout=0.2", "finetune.dropout=none")), None).model.dropout \
        == 0.2


@pytest.mark.parametrize("data, word", [({"gradient_clippping": 1.0}, "'gradient_clippping'"),
                                        ({"train_batch_size": 27}, "train_batch_size=27 is not divisible")])
def test_bad_deepspeed_json_on_the_command_line(base: list[str], tmp_path: Path, data: dict, word: str) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(data))
    args = [*base, "--set", "engine.grad_accum=2", "--out", str(tmp_path / "run"), "--deepspeed_config", str(ds)]
    p = trainer(["pretrain", *args], ok=False)
    assert p.returncode == 2 and str(ds) in p.stderr and word in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------- artifacts


def test_artifact_is_the_engines_fp32_weights_and_loads_without_pickle(runs: dict[str, Path], base: list[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from trainer import artifact
    from trainer.model.encoder import load_encoder
    from trainer.tasks.finetune import ClassifierObjective

    full = uninterrupted(runs, base)
    zero = get_fp32_state_dict_from_zero_checkpoint(str(full / "checkpoints"), tag="step00000024")
    saved = weights(full)
    assert max_diff(saved, {k: zero[k] for k in saved}) == 0.0  # ZeRO-2 shards consolidated independently

    def no_pickle(*a: object, **k: object) -> None:
        raise AssertionError("artifact loading must not unpickle")

    monkeypatch.setattr(torch, "load", no_pickle)
    art = artifact.load(full / "artifact")
    assert art.task == "lm" and art.meta["objective"] == "clm" and art.meta["steps"] == 24
    assert not [p for p in (full / "artifact").rglob("*") if p.suffix in (".pt", ".bin", ".pkl")]
    clf = ClassifierObjective(art.cfg.model)
    load_encoder(clf, art.state)
    for k, v in clf.state_dict().items():
        if k.startswith("encoder."):
            assert torch.equal(v, saved[k]), k


@pytest.mark.parametrize("zero", [0, pytest.param(2, marks=pytest.mark.slow)])  # ZeRO-2: slow suite
def test_bf16_is_autocast_over_fp32_weights_and_deepspeeds_bf16_mode_stays_a_json_away(base: list[str], tmp_path: Path,
                                                                                        zero: int) -> None:
    """engine.precision=bf16 trains under torch.autocast with fp32 weights in the module (DeepSpeed's torch_autocast):
    the artifact is those weights, exactly. A DeepSpeed JSON enabling "bf16" gets DeepSpeed's own mode (bf16 module
    weights, fp32 masters in its optimizer): the artifact holds the masters. A checkpoint of one mode refuses to
    resume in the other with one line that says how."""
    bf16 = [*base, *ONE_STEP, "--set", "engine.precision=bf16", "--set", f"engine.zero_stage={zero}"]

    def module_weights(run: Path) -> dict[str, torch.Tensor]:
        return torch.load(run / "checkpoints" / "step00000001" / "mp_rank_00_model_states.pt", weights_only=False,
                          map_location="cpu")["module"]

    ours = tmp_path / f"autocast-{zero}"
    p = trainer(["pretrain", *bf16, "--out", str(ours)])
    assert ", bf16-autocast" in p.stderr
    ds = json.loads((ours / "deepspeed_config.json").read_text())
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not ds["bf16"]["enabled"]
    art, module = weights(ours), module_weights(ours)
    k = next(k for k in art if k.endswith("linear1.weight"))
    assert module[k].dtype == torch.float32 and torch.equal(art[k], module[k])

    theirs = tmp_path / f"ds-bf16-{zero}"
    user = tmp_path / "bf16.json"
    user.write_text('{"bf16": {"enabled": true}}')
    p = trainer(["pretrain", *bf16, "--deepspeed-config", str(user), "--out", str(theirs)])
    assert ", bf16" in p.stderr and "bf16-autocast" not in p.stderr
    art, module = weights(theirs), module_weights(theirs)
    assert module[k].dtype == torch.bfloat16
    assert torch.equal(art[k].bfloat16(), module[k]) and not torch.equal(art[k], module[k].float())

    p = trainer(["pretrain", *bf16, "--out", str(theirs), "--resume"], ok=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].endswith(
        'written in bf16, this run trains in bf16-autocast; pass --deepspeed-config with {"bf16": {"enabled": true}} '
        "(DeepSpeed's own bf16 mode, which wrote it) to resume it"), p.stderr


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 10 minutes
def test_finetune_compare_two_ranks(runs: dict[str, Path], base: list[str]) -> None:
    from trainer import artifact
    from trainer.data.batching import bucket_batches
    from trainer.tasks.finetune import load_split

    pre = uninterrupted(runs, base) / "artifact"
    out = runs["root"] / "finetune"
    # The test file itself, whole, among the extra sets: its end-of-run score must equal the kept epoch's. Naming
    # a data file makes the data section the user's own: every file and cap is named here.
    extra = ["cls-books-fr/valid.review.txt", "cls-books-fr/test.review.txt"]
    args = [*base, "--pretrained", str(pre), "--compare", "--out", str(out),
            "--set", "finetune.micro_batch=5", "--set", "engine.zero_stage=1",
            "--set", "data.train=cls-books-fr/train.review.spm", "--set", "data.max_train_examples=104",
            "--set", "data.valid=cls-books-fr/valid.review.spm", "--set", "data.max_valid_examples=39",
            "--set", "data.test=cls-books-fr/test.review.txt", "--set", "data.max_test_examples=0",
            "--set", f"data.extra_test={','.join(extra)}"]
    p = deepspeed(args, script="launch/finetune.sh")
    rows = (out / "compare.csv").read_text().splitlines()
    assert rows[0] == ("epoch,scratch_valid_accuracy,pretrained_valid_accuracy,scratch_test_accuracy,"
                       "pretrained_test_accuracy,test_difference,tfidf_valid_accuracy,tfidf_test_accuracy") \
        and len(rows) == 3
    md = (out / "compare.md").read_text()
    assert "| epoch | valid, scratch | valid, pretrained | test, scratch | test, pretrained | test difference |" in md
    # the TF-IDF + logistic regression baseline of the same splits, beside both runs (one fit for both)
    base = json.loads((out / "pretrained" / "metrics.json").read_text())["tfidf_baseline"]
    assert base == json.loads((out / "scratch" / "metrics.json").read_text())["tfidf_baseline"]
    assert all(r.endswith(f",{base['valid']['accuracy']:.2f},{base['test']['accuracy']:.2f}") for r in rows[1:])
    assert "| test accuracy (%) | " in md and f" | {base['test']['accuracy']:.2f} |" in md
    assert "- pretrained: test accuracy " in md and "- from scratch: test accuracy " in md
    assert "finetune pretrained: test accuracy " in p.stdout and "logistic regression baseline" in p.stdout
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    clf = artifact.load(out / "artifact")
    assert clf.task == "classifier" and clf.meta["run"] == "pretrained"
    assert clf.meta["pretrained_from"]["weights_sha256"] == artifact.load(pre).meta["weights_sha256"]
    assert artifact.load(out / "scratch" / "artifact").meta["pretrained_from"] is None
    assert len(clf.meta["history"]) == 2 and "classifier artifact:" in p.stdout
    assert list(clf.meta["extra_accuracy"]) == extra
    kept = next(h for h in clf.meta["history"] if h["epoch"] == clf.meta["kept_epoch"])
    assert clf.meta["extra_accuracy"][extra[1]] == kept["test_accuracy"] == clf.meta["test_accuracy"]
    assert f"| `{extra[0]}` accuracy (%) |" in (out / "compare.md").read_text() and extra[0] in p.stdout
    # The extra set's score is the artifact's own accuracy on it, recomputed here in plain PyTorch (up to one
    # review whose two logits tie within float noise, as batches pad differently).
    valid = load_split(clf.cfg, extra[0], clf.tokenizer(), 0)
    model = clf.model()
    with torch.no_grad():
        right = sum(int((model(*valid.batch(list(range(i, min(i + 50, len(valid.ids)))))[:2]).argmax(-1)
                         == torch.from_numpy(valid.labels[i:i + 50])).sum()) for i in range(0, len(valid.ids), 50))
    assert abs(clf.meta["extra_accuracy"][extra[0]] - 100 * right / len(valid.ids)) <= 100 / len(valid.ids)
    # Both runs trained on the same examples in the same order, epoch by epoch: the seeded order of (seed, epoch)
    # over the training set in global batches of 5 x 2 ranks, reshuffled each epoch.
    scratch = artifact.load(out / "scratch" / "artifact").meta["history"]
    train = load_split(clf.cfg, clf.cfg.data.train, clf.tokenizer(), clf.cfg.data.max_train_examples)
    want = []
    for epoch in range(2):
        batches = bucket_batches(train.lengths, 10, clf.cfg.seed, epoch)
        text = ";".join(",".join(str(i) for i in b) for b in batches if len(b) >= 2)
        want.append(hashlib.sha256(text.encode()).hexdigest())
    assert [h["data_order_sha256"] for h in scratch] == [h["data_order_sha256"] for h in clf.meta["history"]] == want
    assert want[0] != want[1]


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 12 minutes on a host without AVX-512
def test_mlm_pretraining_and_generation(runs: dict[str, Path], base: list[str], tmp_path: Path) -> None:
    from trainer import artifact
    from trainer.data.tokenizer import Tokenizer
    from trainer.tasks.generate import complete

    out = tmp_path / "mlm"
    trainer(["pretrain", *base, "--set", "pretrain.objective=mlm", "--out", str(out)])
    art = artifact.load(out / "artifact")
    assert art.meta["objective"] == "mlm" and art.meta["eval_loss"] > 0
    p = trainer(["generate", str(out / "artifact"), "bonjour"], ok=False)
    assert p.returncode == 2 and "objective mlm" in p.stderr

    clm = one_rank_14(runs, base, 2)
    lm = artifact.load(clm / "artifact")
    tok = lm.tokenizer()
    prompt, new = complete(lm.model(), tok, "Ce livre", max_new_tokens=9)
    assert prompt[0] == Tokenizer.SOS and Tokenizer.EOS not in prompt
    assert len(new) == 9 or new[-1] == Tokenizer.EOS
    assert complete(lm.model(), tok, "Ce livre", max_new_tokens=9) == (prompt, new)  # greedy: deterministic
    p = trainer(["generate", str(clm / "artifact"), "Ce livre", "--max-new-tokens", "9"])
    assert p.stdout.startswith("Ce livre \u2192 ")


# On a GPU: bf16, ZeRO 1 and 2, deterministic kernels (else atomics in the backward make two runs differ), eager (the
# compiled path is bench/gpu_check.sh's), 12 steps with accumulation, a checkpoint every 4.
GPU = ["--set", "engine.precision=bf16", "--set", "engine.deterministic=true", "--set", "engine.compile=off",
       "--set", "engine.grad_accum=2", "--set", "pretrain.micro_batch=7", "--set", "pretrain.max_steps=12",
       "--set", "engine.checkpoint_every=4", "--set", "engine.log_every=1"]


def resumed_equals(full: Path, halves: Path, args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """`args` run into `halves`, stopped at step 4, then resumed there, equals `full` (the same run uninterrupted):
    losses to 1e-6 at each of its 12 steps, weights to 1e-6. Returns the resumed launch."""
    deepspeed([*args, "--out", str(halves), "--stop-at", "4"], **kw)
    assert (halves / "checkpoints" / "latest").read_text().strip() == "step00000004"
    p = deepspeed([*args, "--out", str(halves), "--resume"], **kw)
    assert "resumed at step 4" in p.stderr
    assert len(losses(full)) == 12 and np.allclose(losses(halves), losses(full), rtol=0, atol=1e-6), \
        (losses(halves), losses(full))
    assert max_diff(weights(halves), weights(full)) < 1e-6
    return p


@pytest.mark.slow  # 150-200 s each on 2 cores: deterministic kernels and bf16 on a CPU
@pytest.mark.parametrize("zero", [1, 2])
def test_bf16_autocast_on_two_cpu_ranks_resumes_exactly(base: list[str], tmp_path: Path, zero: int) -> None:
    """The GPU test's run on 2 CPU ranks over gloo: bf16 as autocast over fp32 weights under ZeRO 1 and 2, stopped at
    step 4 and resumed, equals the uninterrupted run."""
    args = [*base, *GPU, "--set", f"engine.zero_stage={zero}"]
    full, halves = tmp_path / "full", tmp_path / "halves"
    deepspeed([*args, "--out", str(full)], timeout=600)
    assert json.loads((full / "deepspeed_config.json").read_text())["torch_autocast"]["enabled"]
    assert ", bf16-autocast" in resumed_equals(full, halves, args, timeout=600).stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_gpu_bf16_two_ranks_nccl(base: list[str], tmp_path: Path, zero: int) -> None:
    """On a GPU machine (2 ranks where it has 2 GPUs): NCCL for CUDA tensors beside gloo for CPU ones, DeepSpeed's
    accelerator on CUDA, bf16 (autocast over fp32 weights) with FusedAdam (no torch_adam), ZeRO 1, 2 and 3; a run
    stopped at step 4 and resumed equals the uninterrupted one, and both write the artifact contract (fp32 weights).
    (The same on 2 CPU ranks: test_bf16_autocast_on_two_cpu_ranks_resumes_exactly, in make test-slow.)"""
    ranks = min(2, torch.cuda.device_count())
    args = [*base, *GPU, "--set", f"engine.zero_stage={zero}"]
    full, halves = tmp_path / "full", tmp_path / "halves"
    deepspeed([*args, "--out", str(full)], ranks=ranks)
    info = json.loads((full / "env.json").read_text())
    assert info["backend"] == "cpu:gloo,cuda:nccl" and info["device"].startswith("cuda"), info
    ds = json.loads((full / "deepspeed_config.json").read_text())
    assert "torch_adam" not in ds["optimizer"]["params"] and ds["torch_autocast"]["enabled"]
    assert ds["zero_optimization"]["stage"] == zero
    assert all(v.dtype == torch.float32 for v in weights(full).values())
    resumed_equals(full, halves, args, ranks=ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_training_follows_eager_and_resumes_exactly(base: list[str], tmp_path: Path) -> None:
    """engine.compile=auto compiles on CUDA (DeepSpeed's engine.compile(): inductor). Compiled, the same run's losses
    stay within 2% of eager's at every step (inductor fuses and reorders bf16 arithmetic: close, not equal), and a
    compiled run stopped at step 4 and resumed equals the uninterrupted compiled one (1e-6)."""
    args = [*base, *GPU, "--set", "engine.zero_stage=1"]
    compiled = [*args, "--set", "engine.compile=auto"]  # after GPU's compile=off: the later --set wins
    eager, full, halves = tmp_path / "eager", tmp_path / "compiled", tmp_path / "halves"
    deepspeed([*args, "--out", str(eager)], ranks=1)
    deepspeed([*compiled, "--out", str(full)], ranks=1)
    assert len(losses(full)) == 12 and np.allclose(losses(full), losses(eager), rtol=2e-2, atol=0), \
        (losses(full), losses(eager))
    resumed_equals(full, halves, compiled, ranks=1)


def test_a_test_sample_taken_from_an_encoded_extra_set_equals_the_one_loaded_alone(tiny_tokenizer, data_dir) -> None:
    """finetune encodes a file once when it is both data.test (sampled) and in data.extra_test (whole)."""
    from trainer.config.presets import tiny
    from trainer.config.schema import override
    from trainer.tasks.finetune import load_split, sample_split

    cfg = override(tiny(), {"data.root": str(data_dir)})
    name = "cls-books-fr/test.review.txt"
    whole = load_split(cfg, name, tiny_tokenizer, 0)
    alone, sampled = load_split(cfg, name, tiny_tokenizer, 39), sample_split(whole, cfg.seed, 39)
    assert len(whole.ids) == 2000 and len(sampled.ids) == 39
    assert sampled.ids == alone.ids and np.array_equal(sampled.labels, alone.labels)
    assert set(sampled.labels.tolist()) == {0, 1}  # a shuffled sample, not the file's first (sorted) lines


def test_an_extra_set_that_is_the_test_file_is_scored_once(tiny_tokenizer, data_dir, monkeypatch) -> None:
    """The kept weights score each split once: the test file among data.extra_test (the `english` preset's 25,000
    IMDB reviews) takes the test set's scores, the same as scoring it again; another extra set is scored."""
    from trainer.config.presets import tiny
    from trainer.config.schema import override
    from trainer.engine.distributed import DistInfo
    from trainer.metrics import summarize
    from trainer.model.encoder import Classifier
    from trainer.tasks import finetune
    from trainer.tasks.classifier_task import Sets, confusion, logits_of

    cfg = override(tiny(), {"data.root": str(data_dir)})
    torch.manual_seed(3)
    clf, names = Classifier(cfg.model), cfg.data.names
    test = finetune.load_split(cfg, "cls-books-fr/test.review.txt", tiny_tokenizer, 41)
    valid = finetune.load_split(cfg, "cls-books-fr/valid.review.txt", tiny_tokenizer, 23)
    sets = Sets(valid, valid, test, test, {"test.review.txt": test, "valid.review.txt": valid})
    info = DistInfo(0, 1, 0, 1, "gloo", torch.device("cpu"))
    scored: list[int] = []
    monkeypatch.setattr(finetune, "logits_of",
                        lambda m, split, i: scored.append(len(split.ids)) or logits_of(m, split, i))
    raw, final = finetune.final_scores(clf, sets, info, names)
    assert scored == [23, 41, 23]  # valid, test, then the extra valid set; not the test file again
    again = summarize(confusion(*logits_of(clf, test, info), len(names)), names)
    assert final["extra"]["test.review.txt"] == final["test"] == again
    assert final["extra"]["valid.review.txt"] == final["valid"] and len(raw["test"][1]) == 41
    assert final["extra"]["test.review.txt"] is not final["test"]  # a copy: a report that edits one keeps the other
