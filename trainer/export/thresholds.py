"""`export --check` as a step of a CI pipeline: thresholds on the check's report, an exit code, and the report written
as JSON (`--json`) and as JUnit XML (`--junit`, which CI servers show as test results).

Exit codes (`python -m trainer export --check`):
  0  the bundle verified, every graph scored, every threshold met (none given: the check alone)
  1  a threshold was not met (the reports say which, on which graph)
  2  bad input: an unreadable or tampered bundle or baseline, a missing data file, a bad option (one line on stderr,
     no report written)

Thresholds, on every graph the bundle serves (manifest "serve": the CPU graph and the CUDA graph):
  --min-accuracy PCT     accuracy on --data >= PCT percent
  --min-agreement PCT    labels equal to the PyTorch model's on >= PCT percent of --data (needs the source
                         artifact: the manifest's, or --artifact)
  --baseline BUNDLE --max-drop POINTS
                         accuracy at most POINTS below BUNDLE's graph for the same device, on the same --data
The TF-IDF + logistic regression baseline (report key "tfidf_baseline", each graph's JUnit case: its accuracy and the
verdict) is reported, not held to a threshold: `--baseline` is the bundle in production.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from contract.manifest import DEVICES
from trainer.atomic import write_text_atomic
from trainer.export.errors import ExportError

EXIT_PASSED, EXIT_BELOW_THRESHOLD, EXIT_BAD_INPUT = 0, 1, 2
SUITE = "export-check"


@dataclass(frozen=True)
class Thresholds:
    """The limits a bundle must meet; None: not checked."""

    min_accuracy: float | None = None  # percent
    min_agreement: float | None = None  # percent of --data whose label equals PyTorch's
    baseline: Path | None = None  # a previous bundle, scored on the same data
    max_drop: float | None = None  # accuracy points the bundle may lose against the baseline

    def __post_init__(self) -> None:
        for name in ("min_accuracy", "min_agreement"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 <= value <= 100):
                raise ExportError(f"--{name.replace('_', '-')} {value}: a percentage in [0, 100]")
        if self.max_drop is not None and not (math.isfinite(self.max_drop) and self.max_drop >= 0):
            raise ExportError(f"--max-drop {self.max_drop}: accuracy points >= 0")
        if (self.baseline is None) != (self.max_drop is None):
            raise ExportError("--baseline BUNDLE and --max-drop POINTS go together")


@dataclass(frozen=True)
class ThresholdResult:
    threshold: str  # "min-accuracy", "min-agreement", "max-drop"
    graph: str  # the graph file checked
    serves: list[str]  # the devices the manifest serves it on
    value: float  # the measure (percent, or accuracy change in points for max-drop)
    limit: float
    passed: bool
    message: str


def evaluate(report: dict[str, Any], limits: Thresholds,
             baseline: dict[str, Any] | None = None) -> list[ThresholdResult]:
    """The thresholds on every served graph of a `check_bundle` report (and of the baseline's, for max-drop)."""
    served = {name: g for name, g in report["graphs"].items() if g["serves"]}
    results = []
    for name, g in served.items():
        where = f"{name} ({', '.join(g['serves'])})"
        if limits.min_accuracy is not None:
            acc = g["bundle_accuracy"]
            ok = acc >= limits.min_accuracy
            results.append(ThresholdResult("min-accuracy", name, g["serves"], acc, limits.min_accuracy, ok,
                                      f"{where}: accuracy {acc:.2f}% {'>=' if ok else '<'} {limits.min_accuracy:g}%"))
        if limits.min_agreement is not None:
            if "label_agreement" not in g:
                raise ExportError("--min-agreement compares with the PyTorch model, and none was found (the "
                                  "manifest's source artifact is not here): pass --artifact ARTIFACT")
            agree = 100.0 * g["label_agreement"]
            ok = agree >= limits.min_agreement
            results.append(ThresholdResult("min-agreement", name, g["serves"], agree, limits.min_agreement, ok,
                                      f"{where}: label agreement with PyTorch {agree:.2f}% "
                                      f"{'>=' if ok else '<'} {limits.min_agreement:g}%"))
    if baseline is not None and limits.max_drop is not None:
        pairs: dict[tuple[str, str], list[str]] = {}
        for device in DEVICES:
            new = next(n for n, g in report["graphs"].items() if device in g["serves"])
            old = next(n for n, g in baseline["graphs"].items() if device in g["serves"])
            pairs.setdefault((new, old), []).append(device)
        for (new, old), devices in pairs.items():
            now, before = report["graphs"][new]["bundle_accuracy"], baseline["graphs"][old]["bundle_accuracy"]
            change = round(now - before, 3)
            ok = -change <= limits.max_drop
            results.append(ThresholdResult(
                "max-drop", new, devices, change, -limits.max_drop, ok,
                f"{new} ({', '.join(devices)}): accuracy {now:.2f}% vs the baseline's {old} {before:.2f}% "
                f"({change:+.2f} points; allowed drop {limits.max_drop:g})"))
    return results


def full_report(report: dict[str, Any], results: list[ThresholdResult],
                baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The check's report with the thresholds, the verdict and the exit code: what --json writes."""
    passed = all(r.passed for r in results)
    return {**report, "baseline": baseline, "thresholds": [asdict(r) for r in results], "passed": passed,
            "exit_code": EXIT_PASSED if passed else EXIT_BELOW_THRESHOLD}


def write_json(path: Path, report: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(report, indent=2) + "\n")


def write_junit(path: Path, report: dict[str, Any]) -> None:
    """One test case per scored graph (its accuracy, as a property) and one per threshold, failed when not met."""
    thresholds = report["thresholds"]
    cases = len(report["graphs"]) + len(thresholds)
    failures = sum(not t["passed"] for t in thresholds)
    root = ET.Element("testsuites", name=SUITE, tests=str(cases), failures=str(failures), errors="0")
    suite = ET.SubElement(root, "testsuite", name=SUITE, tests=str(cases), failures=str(failures), errors="0",
                          skipped="0")
    props = ET.SubElement(suite, "properties")
    for key in ("bundle", "bundle_sha256", "file", "examples"):
        ET.SubElement(props, "property", name=key, value=str(report[key]))
    tfidf = report.get("tfidf_baseline") or {}
    for name, g in report["graphs"].items():
        case = ET.SubElement(suite, "testcase", classname=f"{SUITE}.{name}", name="verify and score")
        case_props = ET.SubElement(case, "properties")
        for key in ("precision", "provider", "bundle_accuracy", "label_agreement", "max_abs_diff"):
            if key in g:
                ET.SubElement(case_props, "property", name=key, value=str(g[key]))
        ET.SubElement(case_props, "property", name="serves", value=",".join(g["serves"]) or "-")
        if "accuracy" in tfidf:  # the baseline beside each graph, with its verdict
            ET.SubElement(case_props, "property", name="tfidf_baseline_accuracy", value=str(tfidf["accuracy"]))
            ET.SubElement(case, "system-out").text = tfidf["verdicts"][name]
        elif "skipped" in tfidf:
            ET.SubElement(case, "system-out").text = f"TF-IDF baseline not scored: {tfidf['skipped']}"
    for t in thresholds:
        case = ET.SubElement(suite, "testcase", classname=f"{SUITE}.{t['graph']}", name=t["threshold"])
        if not t["passed"]:
            ET.SubElement(case, "failure", message=t["message"], type=t["threshold"]).text = t["message"]
        else:
            ET.SubElement(case, "system-out").text = t["message"]
    ET.indent(root)
    write_text_atomic(path, '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n")
