"""`export --check BUNDLE --behaviour`: a bundle's accuracy per capability on a small behavioural test set, in the
manner of CheckList's minimum functionality tests (Ribeiro et al. 2020, "Beyond Accuracy: Behavioral Testing of NLP
Models with CheckList", ACL): short labelled texts, each group testing one thing a sentiment classifier must get
right, scored by every graph of the bundle as the server runs it (trainer/export/served.py). A test split's accuracy
says how often a model is right on texts like its training data; this says what it gets wrong that a reader would
not (the try-it page's "Ennuyeux du début à la fin." among them).

The sets ship in the package, one per language: behaviour_sets/LANGUAGE_DOMAIN.tsv, columns `capability`, `label`
(0 negative, 1 positive) and `text`, read by the project's readers (trainer/data/readers.py). fr_books.tsv: French
book reviews (the demo's domain) written for this project, 24 per capability, 12 of each label:
  short             short unambiguous reviews, the try-it page's two examples among them
  negation          a negated positive is negative ("je n'ai pas aimé"), a negated negative positive ("pas mauvais
                    du tout")
  intensity         mild and strong sentiment, each label ("plutôt agréable" / "absolument génial")
  neutral_frame     one sentiment word or phrase after neutral sentences (delivery, setting, author)
  sentiment_change  the second clause turns the first round and decides ("démarre lentement mais la fin est superbe")
  reviewer_opinion  the reviewer's opinion against other people's ("tout le monde le trouve génial, moi je me suis
                    ennuyé")
Sarcasm is out of scope (the model card says so). A bundle gets the set of its manifest's language (evaluation.language,
data.language at training; a tag's first subtag: fr-CA reads fr); a set's 0 and 1 are the bundle's classes named
"negative" and "positive", else those whose values are "0" and "1". `--behaviour FILE` scores a set of the user's
own, in any labelled format, its labels the bundle's label values (as --data's).

Beside the graphs, the TF-IDF + logistic regression baseline fitted on the source artifact's training split
(trainer/export/check.py, as `--data` has it) scores the same set, so that a capability reads against a bar.
The report is printed and, with --json, written under "behaviour"; it is not held to a threshold.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from contract.bundle import verify_bundle
from contract.manifest import DEVICES, Manifest
from contract.tokens import PAD
from trainer.calibration import softmax
from trainer.data.readers import DataError, Example, read_labeled
from trainer.export.check import SourceBaseline, source_artifact, source_baseline
from trainer.export.score import graph_logits, predict
from trainer.export.served import bundle_tokenizer, served_graph

SETS = Path(__file__).with_name("behaviour_sets")
CAPABILITY_FIELD, TEXT_FIELD, LABEL_FIELD = "capability", "text", "label"
SET_LABELS = ("negative", "positive")  # what a packaged set's label values "0" and "1" mean
ALL = "all"  # the table's last row: every example of the set


def packaged_sets() -> dict[str, Path]:
    """Language (its primary subtag) -> the packaged set for it: behaviour_sets/LANGUAGE_DOMAIN.tsv."""
    return {p.stem.split("_")[0]: p for p in sorted(SETS.glob("*_*.tsv"))}


def read_set(path: Path, labels: list[str]) -> list[tuple[str, Example]]:
    """(capability, example) of each row of a behavioural set; `labels`: the label values, in the order their
    indices give `Example.label`. A blank text or capability is an error: every row of a set is a test."""
    blank: list[str] = []
    examples = read_labeled(path, labels, TEXT_FIELD, LABEL_FIELD, skipped=blank)
    # The same reader again, the capability column read as the text: both keyed by the line a row starts on.
    capabilities = {ex.source: ex.text or "" for ex in
                    read_labeled(path, labels, CAPABILITY_FIELD, LABEL_FIELD, skipped=blank)}
    if blank:
        raise DataError(f"{blank[0]}: blank text or capability; every row of a behavioural set is a test")
    out = [(capabilities[ex.source].strip(), ex) for ex in examples]
    texts = Counter((ex.text or "").strip() for _, ex in out)
    twice = [t for t, n in texts.items() if n > 1]
    if twice:
        raise DataError(f"{path}: the text {twice[0]!r} is in {texts[twice[0]]} rows; each test once")
    return out


def _choose(m: Manifest, file: str | Path | None) -> tuple[Path, str, list[str]] | str:
    """(set file, its name, its label values in the bundle's logit order), or why there is none for this bundle."""
    if file:
        path = Path(file)
        return path, path.name, list(m.label_values)
    language = str(m.evaluation.get("language") or "").strip().lower().replace("_", "-").split("-")[0]
    sets = packaged_sets()
    known = ", ".join(sets) or "none"
    if not language:
        return (f"no behavioural set: the bundle states no language (data.language at training; sets exist for "
                f"{known}); pass --behaviour FILE for a set of your own")
    if language not in sets:
        return (f"no behavioural set for language {language} (sets exist for {known}); pass --behaviour FILE for a "
                "set of your own")
    names = [n.casefold() for n in m.label_names]
    if all(n in names for n in SET_LABELS):
        order = [names.index(n) for n in SET_LABELS]
    elif {"0", "1"} <= set(m.label_values):
        order = [m.label_values.index(v) for v in ("0", "1")]
    else:
        return (f"behavioural set {sets[language].name} not scored: the bundle's classes {list(m.label_names)} "
                f"(values {list(m.label_values)}) name no negative and positive class, nor values 0 and 1")
    values = [f"\0unused {i}" for i in range(len(m.label_values))]  # a class the set has no rows of
    for set_value, logit in zip(("0", "1"), order, strict=True):
        values[logit] = set_value
    return sets[language], sets[language].name, values


def behaviour_report(bundle: str | Path, file: str | Path | None = None, prefer_gpu: bool = True, batch_size: int = 32,
                     tfidf: bool = True, artifact_dir: str | Path | None = None,
                     fitted: SourceBaseline | None = None) -> dict[str, Any]:
    """Each graph of a bundle scored on its language's behavioural set (or `file`): per capability the examples,
    those it labels right and the accuracy (percent), the same over the whole set ("all"), and every example it
    labels wrong with the class it answered and that class's probability as served.

    Returns {"bundle", "bundle_sha256", "set", "file", "examples", "capabilities" (names, in the file's order),
    "graphs": {graph file: {"precision", "serves", "provider", "capabilities": {name: {"examples", "correct",
    "accuracy"}}, "all": the same, "failed": [{"capability", "text", "label", "predicted", "probability",
    "source"}]}}, and with `tfidf` "tfidf_baseline": {"recipe", "C", "trained_on", "capabilities": the same tallies,
    "all"} or {"skipped": why}}, fitted on `artifact_dir`'s training split (default: the manifest's source artifact;
    `fitted`: that baseline already fitted, check.source_baseline);
    or {"bundle", "bundle_sha256", "skipped": why} when no set fits the bundle (a language without a set, classes
    that are not negative and positive)."""
    b = verify_bundle(bundle)
    m = b.manifest
    of = {"bundle": str(b.folder), "bundle_sha256": b.bundle_sha256}
    chosen = _choose(m, file)
    if isinstance(chosen, str):
        return {**of, "skipped": chosen}
    path, name, values = chosen
    rows = read_set(path, values)
    tok = bundle_tokenizer(b)
    seqs = [tok.encode_example(ex) for _, ex in rows]  # cut at the manifest's max_len, as served
    labels = np.array([ex.label for _, ex in rows], dtype=np.int64)
    capabilities = list(dict.fromkeys(cap for cap, _ in rows))
    graphs = {}
    for graph_file, graph in m.graphs.items():
        serves = [d for d in DEVICES if m.serve[d] == graph_file]
        served = served_graph(b, graph_file, prefer_gpu=prefer_gpu and "cuda" in serves)
        probs = softmax(predict(graph_logits(served.session, graph.per_row), seqs, PAD, batch_size))  # (N, C)
        answers = probs.argmax(axis=1)
        right = answers == labels
        per = {}
        for cap in capabilities:
            mask = np.array([c == cap for c, _ in rows])
            per[cap] = _tally(int(mask.sum()), int(right[mask].sum()))
        failed = [{"capability": cap, "text": ex.text, "label": m.label_names[ex.label],
                   "predicted": m.label_names[answers[i]], "probability": round(float(probs[i, answers[i]]), 4),
                   "source": ex.source} for i, (cap, ex) in enumerate(rows) if not right[i]]
        graphs[graph_file] = {"precision": graph.precision, "serves": serves, "provider": served.provider,
                              "capabilities": per, ALL: _tally(len(rows), int(right.sum())), "failed": failed}
    report = {**of, "set": name, "file": str(path), "examples": len(rows), "capabilities": capabilities,
              "graphs": graphs}
    if tfidf:
        report["tfidf_baseline"] = _baseline(fitted or source_baseline(source_artifact(m, artifact_dir)), rows,
                                             capabilities)
    return report


def _baseline(fitted: SourceBaseline, rows: list[tuple[str, Example]],
              capabilities: list[str]) -> dict[str, Any]:
    """The baseline's tallies per capability and over the set (its labels: the set's, mapped to the bundle's)."""
    sets = {cap: [ex for c, ex in rows if c == cap] for cap in capabilities}
    base = fitted.scores({**sets, ALL: [ex for _, ex in rows]})
    if "skipped" in base:
        return base

    def tally(scored: dict[str, Any]) -> dict[str, Any]:  # the right answers: the confusion matrix's diagonal
        return _tally(scored["examples"], int(np.trace(scored["confusion"])))

    return {"recipe": base["recipe"], "C": base["C"], "trained_on": base["trained_on"],
            "capabilities": {cap: tally(base[cap]) for cap in capabilities}, ALL: tally(base[ALL])}


def _tally(examples: int, correct: int) -> dict[str, Any]:
    return {"examples": examples, "correct": correct, "accuracy": round(100.0 * correct / examples, 3)}


def report_lines(report: dict[str, Any]) -> list[str]:
    """What `export --check --behaviour` prints: per graph, a table of the capabilities, then the failed examples."""
    if "skipped" in report:
        return [f"behaviour: {report['skipped']}"]
    caps = report["capabilities"]
    lines = [f"behaviour: {report['set']} ({report['examples']} examples in {len(caps)} capabilities: "
             f"{report['file']})"]
    width = max(len(c) for c in [*caps, "capability"])
    for graph_file, g in report["graphs"].items():
        lines.append(f"  {graph_file} ({g['precision']}, serves {', '.join(g['serves']) or 'no device'}, "
                     f"{g['provider']}):")
        lines.append(f"    {'capability':<{width}}  examples  correct  accuracy")
        for cap, t in [*g["capabilities"].items(), (ALL, g[ALL])]:
            lines.append(f"    {cap:<{width}}  {t['examples']:>8}  {t['correct']:>7}  {t['accuracy']:>7.2f}%")
        if g["failed"]:
            lines.append(f"    failed ({len(g['failed'])}: capability, label -> answered (its probability)):")
            lines += [f"      {f['capability']}, {f['label']} -> {f['predicted']} ({f['probability']:.2f}): "
                      f"{f['text']}" for f in g["failed"]]
        else:
            lines.append("    failed: none")
    base = report.get("tfidf_baseline")
    if base is not None and "skipped" in base:
        lines.append(f"  TF-IDF + logistic regression baseline not scored: {base['skipped']}")
    elif base is not None:
        per = ", ".join(f"{cap} {t['accuracy']:.2f}%" for cap, t in [*base["capabilities"].items(), (ALL, base[ALL])])
        lines.append(f"  TF-IDF + logistic regression baseline ({base['recipe']} n-grams, C={base['C']:g}, fitted on "
                     f"{base['trained_on']}): {per}")
    return lines
