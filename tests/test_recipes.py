"""Fine-tuning recipes and seeds, tiny preset, real DeepSpeed engines: `finetune --compare --seeds N` and its paired
test, layer-wise learning-rate decay, gradual unfreezing (trainer/tasks/lr_groups.py) and the task-text LM stage
(trainer/tasks/task_lm.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import procs
import pytest
from procs import REPO, env
from serving_fixtures import running_server, target

from contract.manifest import CARD_FILE
from serving.client import SentimentClient
from trainer.config.presets import tiny
from trainer.config.schema import ConfigError, override
from trainer.tasks import seeds

TINY = ["--preset", "tiny"]


def trainer(args: list[str], ok: bool = True, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    p = procs.run([sys.executable, "-m", "trainer", *args], timeout, cwd=REPO, env=env())
    if ok:
        assert p.returncode == 0, f"rc {p.returncode}\n{(p.stdout + p.stderr)[-4000:]}"
    return p


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def base(tiny_tokenizer_dir: Path, data_dir: Path) -> list[str]:
    return [*TINY, "--set", f"data.root={data_dir}", "--set", "finetune.tfidf_baseline=word"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path, data_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("recipes") / "pre"
    trainer(["pretrain", *TINY, "--tokenizer", str(tiny_tokenizer_dir), "--set", f"data.root={data_dir}",
             "--out", str(out)])
    return out / "artifact"


# ---------------------------------------------------------------------------------------------- the paired test


def test_a_steady_gain_exceeds_the_noise_and_a_noisy_one_does_not() -> None:
    steady = seeds.paired_test([76.0, 77.1, 75.9], [71.0, 72.0, 71.2])
    assert steady["exceeds_noise"] and steady["p"] < 0.05 and steady["ahead"] == 3
    assert steady["gain_mean"] == pytest.approx(4.933, abs=1e-3) and steady["ci95"][0] > 0
    noisy = seeds.paired_test([74.0, 71.0, 76.0], [72.0, 73.5, 71.0])
    assert not noisy["exceeds_noise"] and noisy["p"] > 0.05 and noisy["ci95"][0] < 0 < noisy["ci95"][1]
    assert "not distinguishable from the seed-to-seed noise" in seeds.verdict(noisy)
    assert "paired t-test over seeds" in seeds.verdict(steady)
    # every seed the same gain: nothing to test it against, but no division by zero either
    same = seeds.paired_test([75.0, 76.0], [70.0, 71.0])
    assert same["exceeds_noise"] and same["p"] == 0.0 and same["gain_sd"] == 0.0
    assert not seeds.paired_test([70.0, 71.0], [70.0, 71.0])["exceeds_noise"]


def test_recipe_options_are_checked() -> None:
    for bad, words in (({"finetune.layer_lr_decay": 0}, "finetune.layer_lr_decay must be > 0"),
                       ({"finetune.layer_lr_decay": 1.5}, "finetune.layer_lr_decay must be <= 1"),
                       ({"finetune.unfreeze_epochs": -1}, "finetune.unfreeze_epochs must be >= 0"),
                       ({"finetune.task_lm.seq_len": 1}, "finetune.task_lm.seq_len must be 0"),
                       ({"finetune.task_lm.seq_len": 65}, "finetune.task_lm.seq_len=65 exceeds model.max_positions")):
        with pytest.raises(ConfigError, match=words):
            override(tiny(), bad)


def test_seeds_go_with_compare(base: list[str], pretrained: Path, tmp_path: Path) -> None:
    p = trainer(["finetune", *base, "--pretrained", str(pretrained), "--seeds", "2", "--out", str(tmp_path / "r")],
                ok=False)
    assert p.returncode == 2 and "error: --seeds 2 goes with --compare" in p.stderr, p.stderr


# ---------------------------------------------------------------------------------------------- seeds


@pytest.fixture(scope="module")
def seeds_run(base: list[str], pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`finetune --compare --seeds 2` of the tiny preset: its folder and its stdout."""
    out = tmp_path_factory.mktemp("recipes") / "seeds"
    p = trainer(["finetune", *base, "--pretrained", str(pretrained), "--compare", "--seeds", "2", "--out", str(out)])
    return out, p.stdout


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 12 minutes on a host without AVX-512
def test_compare_over_seeds_reports_each_seed_its_mean_spread_and_a_paired_test(
        seeds_run: tuple[Path, str], base: list[str], pretrained: Path, tmp_path: Path) -> None:
    out, stdout = seeds_run
    md = (out / "compare.md").read_text()
    assert "2 seeds (0, 1:" in md and "**Verdict:** gain " in md and "paired t-test over seeds" in md
    for row in ("| 0 |", "| 1 |", "| **mean** |", "| sd (spread) |", "| TF-IDF + LR baseline"):
        assert row in md
    meta = json.loads((out / "artifact" / "artifact.json").read_text())
    summary = meta["seeds"]
    assert summary["seeds"] == [0, 1] and meta["seed"] == summary["exported_seed"]
    acc = summary["test_accuracy"]
    for arm in ("scratch", "pretrained"):  # each seed's own run, as its metrics.json says
        assert acc[arm] == [json.loads((out / f"seed{s}" / arm / "metrics.json").read_text())["test"]["accuracy"]
                            for s in range(2)]
    assert summary["paired"] == seeds.paired_test(acc["pretrained"], acc["scratch"])
    # the exported classifier is the exported seed's, byte for byte, chosen on validation
    e = summary["exported_seed"]
    assert sha(out / "artifact" / "model.safetensors") == sha(out / f"seed{e}" / "pretrained" / "artifact" /
                                                              "model.safetensors")
    valid = summary["valid_accuracy"]["pretrained"]
    assert valid[e] == max(valid) and valid.index(max(valid)) == e
    rows = (out / "compare.csv").read_text().splitlines()
    assert rows[0].startswith("seed,epoch,scratch_valid_accuracy") and rows[-2].startswith("mean,kept,")
    assert rows[-1].startswith("sd,kept,") and sum(r.split(",")[1] == "kept" for r in rows) == 4
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "finetune: gain " in stdout and "paired t-test" in stdout
    # The seeds differ (initial weights, data order) but not the splits, which the run's seed (0) made.
    hist = [json.loads((out / f"seed{s}" / "scratch" / "artifact" / "artifact.json").read_text())["history"]
            for s in range(2)]
    assert len({h[0]["data_order_sha256"] for h in hist}) == 2
    # Seed 0 of the comparison is the run one seed gives, weight for weight: --seeds 1 is the comparison of before.
    one = tmp_path / "one"
    trainer(["finetune", *base, "--pretrained", str(pretrained), "--compare", "--out", str(one)])
    assert sha(one / "artifact" / "model.safetensors") == sha(out / "seed0" / "pretrained" / "artifact" /
                                                              "model.safetensors")
    assert sha(one / "scratch" / "artifact" / "model.safetensors") == sha(out / "seed0" / "scratch" / "artifact" /
                                                                         "model.safetensors")
    assert not (one / "seed0").exists() and "| epoch | valid, scratch |" in (one / "compare.md").read_text()


# ---------------------------------------------------------------------------------------------- lr groups

# One rank, a real DeepSpeed engine over the tiny classifier with the recipe's groups: per step, each group's lr,
# and which groups' weights have moved from their initial values.
ENGINE_STEPS = """
import json, sys, torch
from contract.manifest import CARD_FILE
from trainer.config.presets import tiny
from trainer.config.schema import override
from trainer.engine import deepspeed_engine as eng
from trainer.tasks import lr_groups
from trainer.tasks.finetune import ClassifierObjective
cfg = override(tiny(), json.loads(sys.argv[1]))
steps, per_epoch = int(sys.argv[2]), 4
eng.init_distributed()
ds, _ = eng.ds_config(cfg, "finetune", 1)
torch.manual_seed(0)
model = ClassifierObjective(cfg.model)
groups = lr_groups.lr_groups(model, cfg.finetune, per_epoch, pretrained=True)
names = {id(p): n for n, p in model.named_parameters()}
member = {names[id(p)]: g.name for g in groups for p in g.params}
start = {n: p.detach().clone() for n, p in model.named_parameters()}
engine = eng.initialize(model, ds, cfg.finetune.optim, steps, cfg.engine, groups)
g = torch.Generator().manual_seed(1)
ids, labels = torch.randint(4, 99, (13, 11), generator=g), torch.randint(0, 2, (13,), generator=g)
pad = torch.zeros_like(ids, dtype=torch.bool)
rows = []
for step in range(steps):
    lrs = [pg["lr"] for pg in engine.optimizer.param_groups]
    engine.backward(engine(ids, pad, labels) / 13)
    engine.step()
    moved = sorted({member[n] for n, p in engine.module.named_parameters() if not torch.equal(p, start[n])})
    rows.append({"lrs": lrs, "moved": moved})
print(json.dumps({"groups": [x.name for x in groups], "rows": rows}))
eng.finish(0)
"""


def engine_steps(settings: dict[str, object], steps: int) -> dict:
    p = procs.run([sys.executable, "-c", ENGINE_STEPS, json.dumps(settings), str(steps)], 300, cwd=REPO, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("zero", [0, 1])
def test_layer_lr_decay_gives_each_group_its_power_of_the_decay_at_every_step(zero: int) -> None:
    out = engine_steps({"finetune.layer_lr_decay": 0.5, "engine.zero_stage": zero, "finetune.optim.lr": 1e-3,
                        "finetune.optim.warmup_steps": 2, "finetune.optim.schedule": "cosine"}, 6)
    assert out["groups"] == ["head", "layer1", "layer0", "embedding"]
    for row in out["rows"]:  # the schedule moves every group's lr; the ratios stay those of the decay
        head = row["lrs"][0]
        assert [lr / head for lr in row["lrs"]] == pytest.approx([1, 0.5, 0.25, 0.125], rel=1e-12)
        assert row["moved"] == ["embedding", "head", "layer0", "layer1"]
    assert out["rows"][0]["lrs"][0] == pytest.approx(5e-4)  # warm-up: step 1 of 2


@pytest.mark.parametrize("zero", [0, 1])
def test_gradual_unfreezing_leaves_a_frozen_group_exactly_as_it_was(zero: int) -> None:
    # one group more every epoch of 4 steps: head from step 0, layer1 from 4, layer0 from 8, embedding from 12
    out = engine_steps({"finetune.unfreeze_epochs": 1, "engine.zero_stage": zero}, 13)
    order = ["head", "layer1", "layer0", "embedding"]
    for step, row in enumerate(out["rows"]):
        training = order[:step // 4 + 1]
        assert [lr > 0 for lr in row["lrs"]] == [name in training for name in order], step
        assert row["moved"] == sorted(training), step  # bit for bit unchanged until its first step


# ---------------------------------------------------------------------------------------------- task-text LM stage


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 10 minutes
def test_the_task_text_stage_reads_the_training_texts_only(base: list[str], pretrained: Path, data_dir: Path,
                                                          tmp_path: Path) -> None:
    """Two runs that differ only in their validation and test files adapt the encoder to the same weights, bit for
    bit: the stage never read those texts. It does act (the weights leave the pretrained ones), and the classifier
    records what it started from."""
    stage = ["--set", "finetune.task_lm.epochs=2", "--set", "finetune.max_steps=2", "--set", "engine.log_every=1"]
    files = {"a": ("cls-books-fr/valid.review.spm", "cls-books-fr/test.review.spm"),
             "b": ("cls-books-fr/test.review.txt", "cls-books-fr/valid.review.txt")}
    out = {}
    for key, (valid, test) in files.items():
        out[key] = tmp_path / key
        p = trainer(["finetune", *base, *stage, "--pretrained", str(pretrained), "--out", str(out[key]),
                     "--set", "data.train=cls-books-fr/train.review.spm", "--set", "data.max_train_examples=104",
                     "--set", f"data.valid={valid}", "--set", "data.max_valid_examples=39",
                     "--set", f"data.test={test}", "--set", "data.max_test_examples=39"])
        assert "task-text clm: 104 training texts" in p.stderr
    adapted = [o / "task_lm" / "artifact" for o in out.values()]
    assert sha(adapted[0] / "model.safetensors") == sha(adapted[1] / "model.safetensors")
    assert sha(adapted[0] / "model.safetensors") != sha(pretrained / "model.safetensors")
    meta = json.loads((adapted[0] / "artifact.json").read_text())
    assert meta["task"] == "lm" and meta["adapted_from"]["path"] == str(pretrained) and meta["steps"] > 0
    rows = (out["a"] / "task_lm" / "metrics.csv").read_text().splitlines()
    assert len(rows) - 1 == meta["steps"] and float(rows[-1].split(",")[2]) < float(rows[1].split(",")[2])
    clf = json.loads((out["a"] / "artifact" / "artifact.json").read_text())
    assert clf["pretrained_from"]["task_lm"] == str(adapted[0])


# ---------------------------------------------------------------------------------------------- the bundle of a run


@pytest.mark.slow  # in CI's slow suite: the default suite keeps to its 12 minutes on a host without AVX-512
def test_the_bundle_of_a_run_carries_its_card_and_calibration_to_the_server(seeds_run: tuple[Path, str],
                                                                            data_dir: Path, tmp_path: Path) -> None:
    """Fine-tuning fitted a temperature and recorded how the model was made; export puts both in the manifest and the
    model card (whose figures are the manifest's); the server says them in GetModelMetadata."""
    out, _ = seeds_run
    meta = json.loads((out / "artifact" / "artifact.json").read_text())
    cal = meta["calibration"]
    assert cal["temperature"] > 0 and cal["fitted_on"] == "the validation split (39 examples)"
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(meta["data_files"]) == {"train", "valid", "test"}
    assert meta["data_files"]["train"]["sha256"] == sha(data_dir / meta["data_files"]["train"]["file"])
    assert meta["command"].startswith("python -m trainer finetune --preset tiny --set data.root=") and \
        meta["command"].endswith(f"--compare --seeds 2 --out {out}")
    bundle = tmp_path / "bundle"
    trainer(["export", str(out / "artifact"), "--out", str(bundle)])
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["calibration"]["temperature"] == cal["temperature"] and m["files"][CARD_FILE] == sha(bundle / CARD_FILE)
    card = (bundle / CARD_FILE).read_text()
    head = dict(line.split(": ", 1) for line in card.split("---\n")[1].splitlines())
    metrics = {x["type"]: x["value"] for x in json.loads(head["model-index"])[0]["results"][0]["metrics"]}
    ev = m["evaluation"]
    assert json.loads(head["language"]) == "fr" == ev["language"]
    assert metrics == {"accuracy": round(ev["test"]["accuracy"], 2), "f1": round(ev["test"]["macro_f1"], 2),
                       "expected_calibration_error": round(m["calibration"]["test"]["ece_after"], 4)}
    assert ev["test"]["accuracy"] == meta["test_accuracy"] and ev["seed"] == meta["seeds"]["exported_seed"]
    base = ev["tfidf_baseline"]
    assert f"| test accuracy (%) | {ev['test']['accuracy']:.2f} | " \
           f"{ev['seeds']['test_accuracy_stats']['scratch']['mean']:.2f} | {base['test_accuracy']:.2f} |" in card
    assert f"| test macro-F1 (%) | {ev['test']['macro_f1']:.2f} |" in card
    assert f"T = {m['calibration']['temperature']:.4f}" in card
    for role, f in meta["data_files"].items():
        assert f"| {role} | `{f['file']}` | `{f['sha256']}` | {f['examples']} |" in card
    assert meta["command"] in card and f"python -m trainer export {out / 'artifact'} --out BUNDLE" in card
    assert f"at most {m['max_len']} token ids" in card and "Language: fr; domain: book reviews" in card
    assert "| 0 | `0` | negative |" in card and "| 1 | `1` | positive |" in card
    assert "Seeds 0, 1 (head initialisation, data order, dropout)" in card
    with running_server(bundle) as server, SentimentClient(target(server), timeout=30) as client:
        md = client.metadata()
    assert md["model_card"] == card and md["probabilities_calibrated"] is True
    assert md["calibration_temperature"] == pytest.approx(cal["temperature"], rel=1e-6)  # a float32 field
