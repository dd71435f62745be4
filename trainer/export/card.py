"""MODEL_CARD.md, the model card every bundle carries (contract/manifest.py, CARD_FILE), laid out as Hugging Face's:
a metadata header (YAML; each value written as JSON, which YAML reads as is), then what the model is, its results
beside the TF-IDF baseline and training from scratch, calibration, labels, the data with its checksums, how it was
trained (preset, overrides, seeds), its limits, and the commands that make it again.

Every figure comes from the manifest being written (its `evaluation`, `calibration`, labels, max_len, graphs), which
took them from the source artifact: the card says what the manifest says (tests/test_model_card.py holds them equal).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from contract.manifest import CARD_FILE, Manifest
from trainer.config import presets
from trainer.config.schema import RunConfig

ARMS = ("scratch", "pretrained")


def evaluation(meta: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """The manifest's "evaluation": what a classifier artifact's artifact.json says of its scores and making (the
    scores without their confusion matrices; the baseline's beside them)."""
    metrics, base = meta.get("metrics") or {}, meta.get("tfidf_baseline") or {}

    def brief(s: dict[str, Any] | None) -> dict[str, Any]:
        return {k: s[k] for k in ("examples", "accuracy", "macro_f1", "majority_baseline") if k in s} if s else {}

    ok = base and "skipped" not in base
    return {
        "run": meta.get("run"), "seed": meta.get("seed"), "preset": cfg.preset, "overrides": presets.overrides(cfg),
        "language": cfg.data.language, "domain": cfg.data.domain, "selected_on": meta.get("selected_on"),
        "kept_epoch": meta.get("kept_epoch"), "epochs": meta.get("epochs"),
        "valid": brief(metrics.get("valid")), "test": brief(metrics.get("test")),
        "extra_accuracy": meta.get("extra_accuracy") or {},
        "tfidf_baseline": {"recipe": base["recipe"], "C": base["C"], "valid_accuracy": base["valid"]["accuracy"],
                           "test_accuracy": base["test"]["accuracy"], "test_macro_f1": base["test"]["macro_f1"],
                           "extra_accuracy": {f: base[f]["accuracy"] for f in meta.get("extra_accuracy") or {}
                                              if f in base}} if ok else None,
        "seeds": meta.get("seeds"), "data_files": meta.get("data_files") or {},
        "truncated_train_share": meta.get("truncated_train_share"), "command": meta.get("command"),
        "pretrained_from": meta.get("pretrained_from"),
    }


def calibration_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest's "calibration": the artifact's fitted temperature, applied in every graph; T = 1 and method
    "none" for an artifact fine-tuned before temperatures were fitted."""
    cal = meta.get("calibration")
    if not cal:
        return {"method": "none", "temperature": 1.0, "applied_in_graphs": False}
    return {**cal, "applied_in_graphs": True}


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def front_matter(m: Manifest, name: str) -> list[str]:
    """The metadata header: language, pipeline, tags and the model-index of Hugging Face's cards."""
    ev, test = m.evaluation, m.evaluation.get("test", {})
    metrics = [{"type": "accuracy", "value": round(test["accuracy"], 2)},
               {"type": "f1", "name": "macro-F1", "value": round(test["macro_f1"], 2)}] if test else []
    if m.calibration and "test" in m.calibration:
        metrics.append({"type": "expected_calibration_error", "name": "ECE (15 bins, calibrated)",
                        "value": round(m.calibration["test"]["ece_after"], 4)})
    data = ev.get("data_files", {}).get("test", {})
    index = [{"name": name, "results": [{"task": {"type": "text-classification", "name": "Sentiment classification"},
                                         "dataset": {"name": data.get("file", ""), "type": "text", "split": "test"},
                                         "metrics": metrics}]}]
    head = {"language": ev.get("language") or None, "library_name": "onnxruntime",
            "pipeline_tag": "text-classification", "tags": ["sentiment-analysis", "onnx", "transfer-sentiment"],
            "model-index": index}
    return ["---", *(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in head.items() if v is not None), "---"]


def render(m: Manifest, export_command: str) -> str:
    """The card's text for a manifest about to be written (its files need not hold the card yet)."""
    ev, sa = m.evaluation, m.source_artifact
    model = sa.get("model", {})
    pre = ev.get("pretrained_from")
    name = f"transfer-sentiment-{ev.get('preset') or 'model'}"
    how = (f"fine-tuned from an encoder pretrained as a language model ({pre.get('objective')}"
           + (f", preset `{pre['preset']}`" if pre.get("preset") else "") + ")" if pre
           else "trained from scratch (no pretraining)")
    lines = [*front_matter(m, name), "", f"# {name}", "",
             f"A sentiment classifier: a Transformer encoder (d {model.get('d_model')}, {model.get('n_layers')} layers "
             f"of {model.get('n_heads')} heads, {model.get('vocab_size')} token ids, {model.get('pooling')} pooling) "
             f"with a {len(m.label_names)}-way head, {sa.get('parameters'):,} parameters, {how}; exported to ONNX and "
             f"served by onnxruntime. Texts are {ev.get('domain') or 'of a domain not stated (data.domain)'}, in "
             f"{ev.get('language') or 'a language not stated (data.language)'}.", ""]
    lines += results(m) + calibration(m) + labels(m) + data(m) + training(m) + limits(m)
    lines += reproduce(m, export_command) + files(m)
    return "\n".join(lines) + "\n"


def results(m: Manifest) -> list[str]:
    ev = m.evaluation
    test, valid, base = ev.get("test", {}), ev.get("valid", {}), ev.get("tfidf_baseline") or {}
    seeds = ev.get("seeds")
    scratch = seeds["test_accuracy_stats"]["scratch"]["mean"] if seeds else None
    scratch_f1 = seeds["test_macro_f1_stats"]["scratch"]["mean"] if seeds else None
    out = ["## Results", "",
           f"The weights of the epoch with the best {ev.get('selected_on', 'validation score')} "
           f"(epoch {ev.get('kept_epoch')} of {ev.get('epochs')}), scored on the whole test set "
           f"({test.get('examples')} examples); the baseline is TF-IDF + logistic regression fitted on the same "
           f"training split, C chosen on the same validation split.", "",
           "| | this model | " + ("from scratch, mean over seeds | " if seeds else "") + "TF-IDF + LR baseline |",
           "|---|---:|" + ("---:|" if seeds else "") + "---:|"]

    def row(label: str, mine: float | None, s: float | None, b: float | None) -> str:
        return f"| {label} | {_pct(mine)} | " + (f"{_pct(s)} | " if seeds else "") + f"{_pct(b)} |"

    out += [row("validation accuracy (%)", valid.get("accuracy"), None, base.get("valid_accuracy")),
            row("test accuracy (%)", test.get("accuracy"), scratch, base.get("test_accuracy")),
            row("test macro-F1 (%)", test.get("macro_f1"), scratch_f1, base.get("test_macro_f1"))]
    out += [row(f"`{f}` accuracy (%)", acc, None, base.get("extra_accuracy", {}).get(f))
            for f, acc in ev.get("extra_accuracy", {}).items()]
    if seeds:
        t, acc = seeds["paired"], seeds["test_accuracy"]
        out += ["", f"Seeds {', '.join(map(str, seeds['seeds']))} (head initialisation, data order, dropout) were "
                    f"trained from scratch and from the pretrained encoder; this bundle holds seed "
                    f"{seeds['exported_seed']}, the best on validation. Test accuracy per seed: "
                    + "; ".join(f"{arm} {', '.join(_pct(x) for x in acc[arm])} (mean "
                                f"{_pct(seeds['test_accuracy_stats'][arm]['mean'])}, sd "
                                f"{seeds['test_accuracy_stats'][arm]['sd']:.2f})" for arm in ARMS)
                    + f". Gain {t['gain_mean']:+.2f} points (sd {t['gain_sd']:.2f}, 95% CI {t['ci95'][0]:+.2f} to "
                      f"{t['ci95'][1]:+.2f}); {t['test']}: p = {t['p']:.3g}."]
    return [*out, ""]


def calibration(m: Manifest) -> list[str]:
    c = m.calibration
    if not c or c.get("method") != "temperature scaling":
        return ["## Calibration", "", "Not calibrated: the probabilities are the raw softmax of the logits (the "
                "source artifact has no fitted temperature).", ""]
    out = ["## Calibration", "",
           f"Temperature scaling: every graph divides its logits by T = {c['temperature']:.4f}, fitted on "
           f"{c['fitted_on']} by minimising the negative log-likelihood; the served probabilities (a softmax of the "
           "graph's output) are the calibrated ones, and no prediction changes. Expected calibration error "
           f"({c.get('bins', 15)} equal-width confidence bins) and negative log-likelihood, before and after:", "",
           "| set | ECE before | ECE after | NLL before | NLL after |", "|---|---:|---:|---:|---:|"]
    for where in ("valid", "test"):
        if where in c:
            s = c[where]
            out.append(f"| {where} ({s['examples']} examples) | {s['ece_before']:.4f} | {s['ece_after']:.4f} | "
                       f"{s['nll_before']:.4f} | {s['nll_after']:.4f} |")
    return [*out, ""]


def labels(m: Manifest) -> list[str]:
    return ["## Labels", "", "| logit | value in the data | name served |", "|---:|---|---|",
            *(f"| {i} | `{v}` | {n} |" for i, (v, n) in enumerate(zip(m.label_values, m.label_names, strict=True))),
            ""]


def data(m: Manifest) -> list[str]:
    files = m.evaluation.get("data_files") or {}
    if not files:
        return ["## Training data", "", "Not recorded by the source artifact (fine-tuned before artifacts listed "
                "their data).", ""]
    out = ["## Training data", "", "| split | file | sha256 | examples | source |", "|---|---|---|---:|---|"]
    out += [f"| {role} | `{f['file']}` | `{f['sha256']}` | {f['examples']} | {f['source']}"
            + (f"; capped by {f['cap']}" if f.get("cap") else "") + " |" for role, f in files.items()]
    return [*out, ""]


def _overrides(values: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in values.items()) or "none"


def training(m: Manifest) -> list[str]:
    ev = m.evaluation
    pre = ev.get("pretrained_from")
    out = ["## Training procedure", "",
           f"- Fine-tuning: preset `{ev.get('preset')}`, overrides {_overrides(ev.get('overrides', {}))}; seed "
           f"{ev.get('seed')}; {ev.get('epochs')} epochs, the weights of epoch {ev.get('kept_epoch')} kept "
           f"({ev.get('selected_on')})."]
    if pre and pre.get("preset"):
        loss = pre.get("eval_loss")
        out.append(f"- Pretraining: preset `{pre['preset']}`, overrides {_overrides(pre.get('overrides', {}))}; "
                   f"objective {pre.get('objective')}, {pre.get('steps')} steps, {pre.get('tokens')} tokens, "
                   f"held-out loss {'' if loss is None else f'{loss:.4f}'}; weights sha256 "
                   f"`{pre.get('weights_sha256')}`.")
    elif pre:
        out.append(f"- Pretraining: objective {pre.get('objective')}, weights sha256 `{pre.get('weights_sha256')}` "
                   "(its preset and schedule were not recorded by the source artifact).")
        if pre.get("task_lm"):
            out.append("- Before the head was fitted the language model went on with its objective on the "
                       "training split's texts (finetune.task_lm); validation and test texts were never read.")
    out.append(f"- Source artifact weights sha256 `{m.source_artifact.get('weights_sha256')}`.")
    return [*out, ""]


def limits(m: Manifest) -> list[str]:
    ev = m.evaluation
    base = (ev.get("tfidf_baseline") or {}).get("test_accuracy")
    test = ev.get("test", {}).get("accuracy")
    out = ["## Limits", "",
           f"- Language: {ev.get('language') or 'not stated'}; domain: {ev.get('domain') or 'not stated'}. Other "
           "languages and domains were not evaluated; expect lower accuracy there.",
           f"- Length: at most {m.max_len} token ids are read, `<sos>` and `<eos>` included; the rest of a longer text "
           "is cut (the server says truncated=true, or refuses it when started with the refuse policy)"
           + (f"; {ev['truncated_train_share']:.1f}% of the training texts were cut." if
              ev.get("truncated_train_share") is not None else "."),
           f"- Labels: only {', '.join(m.label_names)}; every text gets one of them, however far from the domain."]
    if base is not None and test is not None and test < base:
        out.append(f"- On this test set the TF-IDF + logistic regression baseline scores {base - test:.2f} points "
                   "higher: prefer it where its accuracy is what matters.")
    return [*out, ""]


def reproduce(m: Manifest, export_command: str) -> list[str]:
    ev = m.evaluation
    pre = ev.get("pretrained_from")
    cmds = []
    if pre and pre.get("preset"):
        sets = [x for k, v in (pre.get("overrides") or {}).items() for x in ("--set", f"{k}={_value(v)}")]
        cmds.append(shlex.join(["python", "-m", "trainer", "pretrain", "--preset", str(pre.get("preset")), *sets,
                                "--out", str(pre.get("path", "PRETRAIN")).removesuffix("/artifact")]))
    cmds.append(ev.get("command") or "python -m trainer finetune (the command was not recorded)")
    cmds.append(export_command)
    return ["## How to reproduce", "", "From a checkout of transfer-sentiment with its data sets (TS_DATA):", "",
            "```", *cmds, "```", ""]


def _value(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else "none" if v is None else str(v)


def files(m: Manifest) -> list[str]:
    out = ["## Files", "", "| file | precision | serves | sha256 |", "|---|---|---|---|"]
    for name, g in m.graphs.items():
        serves = ", ".join(d for d, f in m.serve.items() if f == name) or "none"
        out.append(f"| `{name}` | {g.precision} | {serves} | `{m.files[name]}` |")
    out += ["", f"`manifest.json` lists every file with its sha256 ({CARD_FILE} included); its `bundle_sha256`, which "
                "the server reports in GetModelMetadata, covers them all."]
    return out
