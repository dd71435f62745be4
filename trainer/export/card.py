"""MODEL_CARD.md, the model card every bundle carries (contract/manifest.py, CARD_FILE), laid out as Hugging Face's
model card template: a metadata header (YAML; each value written as JSON, which YAML reads as is: language, license,
datasets, base_model, the model-index), then Model Details, Uses, Bias, Risks, and Limitations, How to Get Started
(curl, sentiment-client, grpcurl), Training Details (the data with its checksums, the recipe, hardware and wall time,
the commands that make it again), Evaluation (beside the TF-IDF baseline; over seeds where the run had them;
calibration), Environmental Impact, Technical Specifications, Citation, and the card's authors and contact. The
sections' text: trainer/export/card_sections.py and below.

`render(manifest)` is a function of the manifest alone (and of this code, and of the citation it finds): every figure
comes from the manifest's `evaluation`, `calibration`, labels, max_len, graphs and versions, which took them from the
source artifact. `python -m trainer.export.render_card BUNDLE` renders a bundle's card again with the current
code (docs/MODEL_CARD.example.md is the demo bundle's; tests/test_model_card.py holds its outline to this code's).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path, PurePath
from typing import Any

from contract.manifest import CARD_FILE, Manifest
from contract.version import DISTRIBUTION
from trainer.config import presets
from trainer.config.schema import RunConfig
from trainer.export import card_sections as sections
from trainer.export.card_sections import pct


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
        "pretrained_from": meta.get("pretrained_from"), "compute": meta.get("compute"),
        "max_len": cfg.tokenizer.max_len,  # the artifact's cut: the export command says --max-len where it differs
        "case_fold": cfg.tokenizer.case_fold,  # the tokenizer folds case (its spm.model's normalizer)
    }


def calibration_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest's "calibration": the artifact's fitted temperature, applied in every graph; T = 1 and method
    "none" for an artifact fine-tuned before temperatures were fitted."""
    cal = meta.get("calibration")
    if not cal:
        return {"method": "none", "temperature": 1.0, "applied_in_graphs": False}
    return {**cal, "applied_in_graphs": True}


def model_name(m: Manifest) -> str:
    """The card's title and model-index name: transfer-sentiment-PRESET."""
    return f"transfer-sentiment-{m.evaluation.get('preset') or 'model'}"


def base_model(m: Manifest) -> str | None:
    """The `base_model` of the metadata: the Hub takes a model id there (a name, or owner/name); the pretrained encoder
    is a local artifact, not on the Hub, so it is named as this card names its model, transfer-sentiment-PRESET-
    OBJECTIVE, a valid id for whoever uploads both (the body gives its path and weights' sha256). None: from scratch,
    and the key is left out, as the Hub's template says for a model with no base."""
    pre = m.evaluation.get("pretrained_from")
    if not pre:
        return None
    return "-".join(["transfer-sentiment", str(pre.get("preset") or "pretrained"), str(pre.get("objective") or "lm")])


def datasets(m: Manifest) -> list[str]:
    """The `datasets` of the metadata: the folders (under data.root) of the fine-tuning files, then of the pretraining
    corpus's; a file at the root gives its own name."""
    ev = m.evaluation
    files = [f["file"] for f in (ev.get("data_files") or {}).values()]
    files += [f["file"] for f in ((ev.get("pretrained_from") or {}).get("corpus") or {}).get("files", [])]
    names = [(PurePath(f).parent.name or PurePath(f).name) for f in files]
    return list(dict.fromkeys(n for n in names if n))


def front_matter(m: Manifest, cite: dict[str, Any]) -> list[str]:
    """The metadata header of Hugging Face's cards: one `key: value` line each, the value as JSON (which YAML reads as
    is), keys left out where there is nothing to say (`base_model` of a model trained from scratch)."""
    ev, test = m.evaluation, m.evaluation.get("test", {})
    metrics = [{"type": "accuracy", "value": round(test["accuracy"], 2)},
               {"type": "f1", "name": "macro-F1", "value": round(test["macro_f1"], 2)}] if test else []
    if m.calibration and "test" in m.calibration:
        metrics.append({"type": "expected_calibration_error", "name": "ECE (15 bins, calibrated)",
                        "value": round(m.calibration["test"]["ece_after"], 4)})
    data = (ev.get("data_files") or {}).get("test", {})
    index = [{"name": model_name(m),
              "results": [{"task": {"type": "text-classification", "name": "Sentiment classification"},
                           "dataset": {"name": data.get("file", ""), "type": "text", "split": "test"},
                           "metrics": metrics}]}]
    head = {"language": ev.get("language") or None, "license": cite["license"].lower(),
            "library_name": "onnxruntime", "pipeline_tag": "text-classification",
            "tags": ["sentiment-analysis", "onnx", "transfer-sentiment"], "datasets": datasets(m) or None,
            "base_model": base_model(m), "model-index": index}
    return ["---", *(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in head.items() if v is not None), "---"]


def render(m: Manifest, export_command: str) -> str:
    """The card's text for a manifest (its files need not hold the card yet). `export_command`: the command that
    wrote the bundle (trainer/export/render_card.py makes it again from a manifest)."""
    cite = citation(m)
    command = export_command
    ev, pre = m.evaluation, m.evaluation.get("pretrained_from")
    how = "fine-tuned from an encoder pretrained as a language model" if pre else "trained from scratch"
    lines = [*front_matter(m, cite), "", f"# {model_name(m)}", "",
             f"A {len(m.label_names)}-label sentiment classifier ({', '.join(m.label_names)}) of "
             f"{ev.get('domain') or 'texts'} in {ev.get('language') or 'a language not stated'}"
             f", {how}, exported by {DISTRIBUTION} as an ONNX bundle that `sentiment-server` serves over gRPC and "
             "HTTP. Every figure below comes from the bundle's manifest.json.", ""]
    lines += sections.model_details(m, model_name(m), cite, base_model(m)) + sections.uses(m) + sections.risks(m)
    lines += sections.get_started(m) + sections.training(m, sections.reproduce_commands(m, command))
    lines += evaluation_section(m) + environment(m) + technical(m) + citation_section(cite) + authors(cite)
    return "\n".join(lines).rstrip("\n") + "\n"


# ---------------------------------------------------------------------------------------------- evaluation


def evaluation_section(m: Manifest) -> list[str]:
    ev = m.evaluation
    test, valid, base = ev.get("test", {}), ev.get("valid", {}), ev.get("tfidf_baseline") or {}
    files, seeds = ev.get("data_files") or {}, ev.get("seeds")
    t = files.get("test")
    out = ["## Evaluation", "", "### Testing Data, Factors & Metrics", "", "#### Testing Data", "",
           (f"The test split, `{t['file']}` (sha256 `{t['sha256']}`), {t['examples']} examples, never used for "
            "training or for choosing the kept epoch" if t else "The source artifact's test split (its file was not "
            "recorded)") + "".join(f"; also `{f}`" for f in ev.get("extra_accuracy", {})) + ".", "",
           "#### Factors", "",
           "The test split as a whole: the scores are not broken down by review length, topic or author. "
           + ("Seeds (head initialisation, data order, dropout) are the factor varied: each was trained from scratch "
              "and from the pretrained encoder." if seeds else "One seed was trained: the spread over seeds of this "
              "run is not known (`python -m trainer finetune --compare --seeds N` measures it)."), "",
           "#### Metrics", "",
           "Accuracy and macro-F1 (the mean of the labels' F1, which a model that always answers one label cannot "
           "inflate), beside the majority class's share and a TF-IDF + logistic regression baseline; the "
           "probabilities' expected calibration error (ECE) and negative log-likelihood (NLL).", "",
           "### Results", "",
           f"The weights of the epoch with the best {ev.get('selected_on', 'validation score')} "
           f"(epoch {ev.get('kept_epoch')} of {ev.get('epochs')}), scored on the whole test set "
           f"({test.get('examples')} examples; the majority class is {pct(test.get('majority_baseline'))}% of it); "
           "the baseline is TF-IDF + logistic regression fitted on the same training split, C chosen on the same "
           "validation split.", "",
           "| | this model | " + ("from scratch, mean over seeds | " if seeds else "") + "TF-IDF + LR baseline |",
           "|---|---:|" + ("---:|" if seeds else "") + "---:|"]

    def row(label: str, mine: float | None, s: float | None, b: float | None) -> str:
        return f"| {label} | {pct(mine)} | " + (f"{pct(s)} | " if seeds else "") + f"{pct(b)} |"

    scratch = seeds["test_accuracy_stats"]["scratch"]["mean"] if seeds else None
    scratch_f1 = seeds["test_macro_f1_stats"]["scratch"]["mean"] if seeds else None
    out += [row("validation accuracy (%)", valid.get("accuracy"), None, base.get("valid_accuracy")),
            row("test accuracy (%)", test.get("accuracy"), scratch, base.get("test_accuracy")),
            row("test macro-F1 (%)", test.get("macro_f1"), scratch_f1, base.get("test_macro_f1"))]
    out += [row(f"`{f}` accuracy (%)", acc, None, base.get("extra_accuracy", {}).get(f))
            for f, acc in ev.get("extra_accuracy", {}).items()]
    if seeds:
        p, acc = seeds["paired"], seeds["test_accuracy"]
        out += ["", f"Seeds {', '.join(map(str, seeds['seeds']))} (head initialisation, data order, dropout) were "
                    f"trained from scratch and from the pretrained encoder; this bundle holds seed "
                    f"{seeds['exported_seed']}, the best on validation. Test accuracy per seed: "
                    + "; ".join(f"{arm} {', '.join(pct(x) for x in acc[arm])} (mean "
                                f"{pct(seeds['test_accuracy_stats'][arm]['mean'])}, sd "
                                f"{seeds['test_accuracy_stats'][arm]['sd']:.2f})" for arm in sections.ARMS)
                    + f". Gain {p['gain_mean']:+.2f} points (sd {p['gain_sd']:.2f}, 95% CI {p['ci95'][0]:+.2f} to "
                      f"{p['ci95'][1]:+.2f}); {p['test']}: p = {p['p']:.3g}."]
    return [*out, "", *calibration(m)]


def calibration(m: Manifest) -> list[str]:
    c = m.calibration
    if not c or c.get("method") != "temperature scaling":
        return ["### Calibration", "", "Not calibrated: the probabilities are the raw softmax of the logits (the "
                "source artifact has no fitted temperature).", ""]
    out = ["### Calibration", "",
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


# ---------------------------------------------------------------------------------------------- compute, files


def _stages(m: Manifest) -> list[tuple[str, dict[str, Any] | None]]:
    pre = m.evaluation.get("pretrained_from")
    return [("fine-tuning", m.evaluation.get("compute"))] + ([("pretraining", pre.get("compute"))] if pre else [])


def environment(m: Manifest) -> list[str]:
    stages = _stages(m)
    known = [c for _, c in stages if c]
    hours = sum(c.get("wall_seconds") or 0.0 for c in known) / 3600
    kinds = sorted({f"{c.get('world_size')} x {c.get('device_name')}" for c in known})
    return ["## Environmental Impact", "",
            "- **Hardware Type:** " + ("; ".join(kinds) if kinds else "not recorded by the artifacts"),
            "- **Hours used:** " + (f"{hours:.2f} h of wall time (" if known else "not recorded (") + ", ".join(
                f"{name} {sections.duration((c or {}).get('wall_seconds'))}" for name, c in stages) + ")",
            "- **Cloud Provider:** not recorded", "- **Compute Region:** not recorded",
            "- **Carbon Emitted:** not measured; the hardware and hours above give an estimate with the Machine "
            "Learning Impact calculator (Lacoste et al., 2019)", ""]


def technical(m: Manifest) -> list[str]:
    model, pre = m.source_artifact.get("model", {}), m.evaluation.get("pretrained_from")
    out = ["## Technical Specifications", "", "### Model Architecture and Objective", "",
           f"A pre-norm Transformer encoder: {model.get('n_layers')} layers, width {model.get('d_model')}, "
           f"{model.get('n_heads')} heads, feed-forward {model.get('d_ff')}, {model.get('max_positions')} positions, "
           f"{model.get('vocab_size')} token ids; "
           + ("a causal mask, " if model.get("classifier_causal") else "no causal mask, ")
           + f"{model.get('pooling')} pooling into a {model.get('num_classes')}-way linear head. Objective: "
           "cross-entropy over the labels" + (f", after pretraining with the {pre.get('objective')} objective "
                                              "(clm: the next token; mlm: masked tokens)" if pre else "") + ".", "",
           "### Compute Infrastructure", "", "#### Hardware", ""]
    out += [f"- {name.capitalize()}: {sections.compute_line(c)}" for name, c in _stages(m)]
    out += ["", "#### Software", "", "Exported with " + ", ".join(f"{k} {v}" for k, v in m.versions.items())
            + f"; served by onnxruntime at graph optimisation level `{m.runtime.graph_optimization_level}`.", "",
            "### Bundle Files", "", "| file | precision | serves | sha256 |", "|---|---|---|---|"]
    for name, g in m.graphs.items():
        serves = ", ".join(d for d, f in m.serve.items() if f == name) or "none"
        out.append(f"| `{name}` | {g.precision} | {serves} | `{m.files.get(name, '')}` |")
    out += ["", f"`manifest.json` lists every file with its sha256 ({CARD_FILE} included); its `bundle_sha256`, which "
                "the server reports in GetModelMetadata, covers them all.", ""]
    return out


# ---------------------------------------------------------------------------------------------- citation


CITATION_CFF = Path(__file__).resolve().parents[2] / "CITATION.cff"  # in a checkout; an installed wheel has none


def citation(m: Manifest, cff: Path = CITATION_CFF) -> dict[str, Any]:
    """The project's citation: `cff` (CITATION.cff of the checkout the code runs from), else the installed package's
    metadata (name, summary, license), else the name alone; the version is the one that exported the bundle."""
    fields: dict[str, Any] = {}
    try:
        fields = read_cff(cff.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        pass
    if not fields.get("title"):
        try:
            meta = metadata.metadata(DISTRIBUTION)
            fields = {"title": f"{meta['Name']}: {meta['Summary']}", "license": meta.get("License-Expression")}
        except metadata.PackageNotFoundError:
            fields = {"title": DISTRIBUTION}
    version = m.versions.get(DISTRIBUTION)
    return {"title": fields["title"], "authors": fields.get("authors") or f"the {DISTRIBUTION} authors",
            "license": fields.get("license") or "Apache-2.0",
            "version": version if version and version != "absent" else fields.get("version"),
            "year": (m.created or "")[:4] or None, "url": fields.get("url") or fields.get("repository-code")}


def read_cff(text: str) -> dict[str, str]:
    """The top-level text fields of a CITATION.cff (title, version, license, url, ...) and its authors' names, joined
    with "and"; enough of YAML for the file this project writes, and no YAML library in the training install."""
    out: dict[str, str] = {}
    names: list[str] = []
    in_authors = False
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not line.startswith((" ", "-", "#")) and sep:
            in_authors = key == "authors"
            if value.strip() and value.strip() not in (">-", "|", ">"):
                out[key.strip()] = value.strip().strip('"').strip("'")
        elif in_authors and key.strip().lstrip("- ").strip() in ("name", "family-names") and sep:
            names.append(value.strip().strip('"').strip("'"))
    if names:
        out["authors"] = " and ".join(names)
    return out


def citation_section(cite: dict[str, Any]) -> list[str]:
    key = f"{DISTRIBUTION.replace('-', '_')}_{cite['year'] or 'nd'}"
    bib = [f"@software{{{key},", f"  title = {{{cite['title']}}},", f"  author = {{{{{cite['authors']}}}}},"]
    bib += [f"  {k} = {{{cite[k]}}}," for k in ("version", "year", "url") if cite.get(k)]
    bib += [f"  license = {{{cite['license']}}}", "}"]
    apa = (f"{cite['authors'][0].upper() + cite['authors'][1:]}. ({cite['year'] or 'n.d.'}). {cite['title']}"
           + (f" (Version {cite['version']})" if cite.get("version") else "") + " [Computer software]."
           + (f" {cite['url']}" if cite.get("url") else ""))
    return ["## Citation", "", "The code that trained and exported this model (CITATION.cff):", "", "**BibTeX:**", "",
            "```bibtex", *bib, "```", "", "**APA:**", "", apa, ""]


def authors(cite: dict[str, Any]) -> list[str]:
    return ["## Model Card Authors", "",
            f"Written by {DISTRIBUTION}'s exporter (trainer/export/card.py) from the bundle's manifest.json, which "
            "took every figure from the classifier artifact and its run; the prose is the code's, by "
            f"{cite['authors']}.", "",
            "## Model Card Contact", "",
            "Whoever published this bundle answers for the model and its data; questions about the code go to "
            f"{cite['authors']}" + (f" ({cite['url']})" if cite.get("url") else " (CITATION.cff)") + "."]
