"""The sections of MODEL_CARD.md (trainer/export/card.py puts them together), in the order of Hugging Face's model
card template: Model Details, Uses, Bias, Risks, and Limitations, How to Get Started, Training Details, Evaluation,
Environmental Impact, Technical Specifications, Citation, Model Card Authors and Contact.

Every section and sub-heading is written whatever the manifest holds (what it lacks is said in the text), so that
every card has the same outline: tests/test_model_card.py holds docs/MODEL_CARD.example.md to it. Each function takes
the manifest (and what card.py derived from it) and returns the section's lines.
"""

from __future__ import annotations

import json
import math
import shlex
from typing import Any

from contract.manifest import Manifest
from contract.version import DISTRIBUTION

ARMS = ("scratch", "pretrained")
# A review to try, in the model's language; the README's own example for French.
EXAMPLE_TEXT = {"fr": "Un livre magnifique.", "en": "A wonderful book."}
# What the "negation and sarcasm" limit shows, per language: a negated word and a sarcastic line.
HARD_CASES = {"fr": ("« pas mauvais du tout »", "« Génial, encore un roman de 900 pages sans intrigue. »"),
              "en": ('"not bad at all"', '"Great, another 900-page novel with no plot."')}


def pct(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def duration(seconds: float | None) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min: a wall time as a person reads it."""
    if seconds is None:
        return "not recorded"
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    return f"{s // 60} min {s % 60:02d} s" if s < 3600 else f"{s // 3600} h {s % 3600 // 60:02d} min"


def _overrides(values: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in values.items()) or "none"


def _value(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else "none" if v is None else str(v)


def _language(ev: dict[str, Any]) -> str:
    return ev.get("language") or "a language not stated (data.language)"


def _domain(ev: dict[str, Any]) -> str:
    return ev.get("domain") or "texts of a domain not stated (data.domain)"


# ---------------------------------------------------------------------------------------------- model details


def model_details(m: Manifest, name: str, cite: dict[str, Any], base_model: str | None) -> list[str]:
    ev, sa = m.evaluation, m.source_artifact
    model, pre = sa.get("model", {}), ev.get("pretrained_from")
    parameters = sa.get("parameters")
    version = m.versions.get(DISTRIBUTION) or "not recorded"
    finetuned = (f"`{base_model}`, an encoder pretrained as a language model ({pre.get('objective')}) by "
                 f"transfer-sentiment, not published on the Hub: its weights' sha256 is "
                 f"`{pre.get('weights_sha256')}` (Training Details)") if pre else "none: trained from scratch"
    size = f"{parameters:,} parameters" if isinstance(parameters, int) else "parameters not recorded"
    out = ["## Model Details", "", "### Model Description", "",
           f"A sentiment classifier for {_domain(ev)} in {_language(ev)}: a Transformer encoder (d "
           f"{model.get('d_model')}, {model.get('n_layers')} layers of {model.get('n_heads')} heads, "
           f"{model.get('vocab_size')} token ids, {model.get('pooling')} pooling) with a {len(m.label_names)}-way "
           f"head, {size}, {'fine-tuned from a pretrained encoder' if pre else 'trained from scratch'}; exported to "
           "ONNX and served by onnxruntime (`sentiment-server`)."]
    out += ["",
            f"- **Developed by:** whoever ran the commands under Training Details, with {DISTRIBUTION} {version} "
            f"(the code: {cite['authors']}, Citation)",
            f"- **Model type:** Transformer encoder with a classification head ({len(m.label_names)} labels); ONNX "
            "graphs " + ", ".join(f"`{f}` ({g.precision})" for f, g in m.graphs.items()),
            f"- **Language(s):** {ev.get('language') or 'not stated'}",
            f"- **License:** the code that made it, {cite['license']}; the weights were learnt from the data sets "
            "under Training Details, whose own terms apply to them",
            f"- **Finetuned from model:** {finetuned}",
            f"- **Version:** {DISTRIBUTION} {version}, bundle format {m.format}",
            f"- **Date:** classifier trained {str(sa.get('created') or 'not recorded')[:10]}, exported "
            f"{m.created[:10] or 'not recorded'}",
            "", "### Labels", "",
            "Every text gets exactly one of these labels, with a probability for each:", "",
            "| logit | value in the data | name served |", "|---:|---|---|",
            *(f"| {i} | `{v}` | {n} |" for i, (v, n) in enumerate(zip(m.label_values, m.label_names, strict=True))),
            ""]
    return out


# ---------------------------------------------------------------------------------------------- uses


def uses(m: Manifest) -> list[str]:
    ev, names = m.evaluation, ", ".join(m.label_names)
    return ["## Uses", "", "### Direct Use", "",
            f"Label the sentiment ({names}) of {_domain(ev)} written in {_language(ev)}, the population it was "
            "trained and tested on: sorting or counting reviews, routing the negative ones to a person, following "
            "the share of each label over time. The probabilities are "
            + ("calibrated on held-out data (Evaluation), so a threshold on them means what it says."
               if m.calibrated else "the raw softmax of the logits (not calibrated): rank by them, do not read "
               "them as frequencies."), "",
            "### Downstream Use", "",
            "- Aggregates over many texts (the share of negative reviews of a product or a month), where single "
            "errors average out; report them with the test accuracy's uncertainty (Evaluation).",
            "- A first pass that a person then checks, with a threshold on the probability chosen on labelled data "
            "of the place it is used.",
            "- Further fine-tuning on labelled texts of a neighbouring domain in the same language: the source "
            f"artifact ({m.source_artifact.get('path') or 'not recorded'}) or the pretrained encoder it started "
            "from is the `--pretrained` of `python -m trainer finetune`.", "",
            "### Out-of-Scope Use", "",
            f"- Texts in other languages than {ev.get('language') or 'the training data’s'} or of other domains "
            "(news, social media, support tickets, other products): not evaluated, expect lower accuracy.",
            f"- Neutral, mixed or aspect-level sentiment: the model knows only {names} and gives one of them to "
            "every text, however far from the training data.",
            "- Decisions about people (moderation of an author, hiring, credit, health) without a person reviewing "
            "each one.",
            f"- Texts longer than {m.max_len} token ids judged on their whole: only the beginning is read "
            "(Bias, Risks, and Limitations).", ""]


# ---------------------------------------------------------------------------------------------- limits


def risks(m: Manifest) -> list[str]:
    ev = m.evaluation
    base = (ev.get("tfidf_baseline") or {}).get("test_accuracy")
    test, train = ev.get("test", {}), (ev.get("data_files") or {}).get("train", {})
    domain = ev.get("domain") or ""
    lang = ev.get("language") or ""
    out = ["## Bias, Risks, and Limitations", "",
           f"- Language: {lang or 'not stated'}; domain: {domain or 'not stated'}. The model learnt how the people "
           "who wrote its training texts express sentiment: other writers, registers, dialects and topics were not "
           "evaluated; expect lower accuracy there."]
    if "CLS" in domain:
        out.append("- Population: the CLS corpus (Webis-CLS-10, Prettenhofer and Stein, 2010) holds Amazon "
                   "customer reviews, labelled from their star ratings (1-2 stars negative, 4-5 positive, 3 left "
                   "out), not by reading them: lukewarm and mixed reviews were never seen, a review whose words "
                   "and stars disagree taught that disagreement, and the reviewers are Amazon's customers of that "
                   "time, not a sample of all readers.")
    cases = HARD_CASES.get(lang)
    out.append(f"- Negation and sarcasm: a small encoder trained on {train.get('examples', 'a few thousand')} "
               "examples reads words in their order but has no reliable grasp of negation"
               + (f" ({cases[0]})" if cases else "") + ", concession or sarcasm"
               + (f" ({cases[1]})" if cases else "") + "; expect errors on them and test them on your own texts.")
    out.append(f"- Length: at most {m.max_len} token ids are read, `<sos>` and `<eos>` included; the rest of a "
               "longer text is cut (the server says truncated=true, or refuses it when started with "
               "`--long-text refuse`)"
               + (f"; {ev['truncated_train_share']:.1f}% of the training texts were cut."
                  if ev.get("truncated_train_share") is not None else "."))
    out.append(f"- Labels: only {', '.join(m.label_names)}; every text gets one of them, however far from the "
               "domain.")
    if test.get("accuracy") is not None and test.get("examples"):
        se = 100 * math.sqrt(max(test["accuracy"] * (100 - test["accuracy"]), 0.0) / 1e4 / test["examples"])
        out.append(f"- Measured on {test['examples']} test examples: the test accuracy is known to about "
                   f"±{1.96 * se:.2f} points (95%, binomial), before any shift of population.")
    if base is not None and test.get("accuracy") is not None and test["accuracy"] < base:
        out.append(f"- On this test set the TF-IDF + logistic regression baseline scores {base - test['accuracy']:.2f} "
                   "points higher: prefer it where its accuracy is what matters.")
    out += ["", "### Recommendations", "",
            "Score the bundle on a sample of your own texts, labelled by a person, before relying on it: `python -m "
            "trainer export --check BUNDLE --data FILE` reports its accuracy on a labelled file. Where the baseline "
            "is ahead, or the texts are not "
            f"{domain or 'of the training domain'}, prefer the better model for that data; keep a person in the "
            "loop of any decision about people; start the server with `--long-text refuse` where a cut text must "
            "not be judged on its beginning.", ""]
    return out


# ---------------------------------------------------------------------------------------------- get started


def get_started(m: Manifest) -> list[str]:
    text = EXAMPLE_TEXT.get(m.evaluation.get("language") or "", "a review")
    body = json.dumps({"texts": [text]}, ensure_ascii=False)
    n = len(m.label_names)
    return ["## How to Get Started with the Model", "",
            "Serve the bundle (gRPC on 127.0.0.1:50051, HTTP on 127.0.0.1:8000), then call it over HTTP, with the "
            "gRPC client, or with grpcurl (the server answers reflection):", "",
            "```",
            "sentiment-server BUNDLE",
            f"curl -H 'Content-Type: application/json' -d {shlex.quote(body)} localhost:8000/v1/classify",
            f"sentiment-client --target 127.0.0.1:50051 {shlex.quote(text)}",
            f"grpcurl -plaintext -d {shlex.quote(body)} 127.0.0.1:50051 sentiment.v1.SentimentService/Classify",
            "```", "",
            "Each text's answer: `label` (one of " + ", ".join(f"`{x}`" for x in m.label_names) + "), `label_index`, "
            f"`probabilities` ({n}, in the order of the labels, summing to 1), `token_count` and `truncated`. "
            "`sentiment-client --model-card` prints this card from a running server.", ""]


# ---------------------------------------------------------------------------------------------- training


def training(m: Manifest, reproduce: list[str]) -> list[str]:
    ev = m.evaluation
    pre, files = ev.get("pretrained_from"), ev.get("data_files") or {}
    out = ["## Training Details", "", "### Training Data", ""]
    if files:
        out += ["Fine-tuning (labelled):", "", "| split | file | sha256 | examples | source |",
                "|---|---|---|---:|---|"]
        out += [f"| {role} | `{f['file']}` | `{f['sha256']}` | {f['examples']} | {f['source']}"
                + (f"; capped by {f['cap']}" if f.get("cap") else "")
                + (f"; {f['crops']} of them its texts' first or last sentences (data.crops)" if f.get("crops") else "")
                + " |" for role, f in files.items()]
    else:
        out.append("Fine-tuning data: not recorded by the source artifact (fine-tuned before artifacts listed their "
                   "data).")
    corpus = (pre or {}).get("corpus")
    out.append("")
    if corpus:
        out += [f"Pretraining (unlabelled): {corpus.get('documents'):,} documents, {corpus.get('tokens'):,} tokens; "
                f"the prepared folder's manifest.json (every shard's sha256) has sha256 "
                f"`{corpus.get('manifest_sha256')}`.", "", "| file | read | bytes | sha256 |", "|---|---:|---:|---|"]
        times: dict[str, int] = {}  # a file listed N times (in-domain text weighed up) is one row, read N times
        for f in corpus.get("files", []):
            times[f["file"]] = times.get(f["file"], 0) + 1
        rows = {f["file"]: f for f in corpus.get("files", [])}
        out += [f"| `{name}` | {times[name]}x | {f['bytes']:,} | " + (f"`{f['sha256']}`" if f.get("sha256") else
                                                                     "not on the training machine") + " |"
                for name, f in rows.items()]
    else:
        out.append("Pretraining data: " + ("not recorded by the pretrained artifact (pretrained before artifacts "
                                           "listed their corpus)." if pre else "none (trained from scratch)."))
    out += ["", "### Training Procedure", "", "#### Preprocessing", "",
            f"Texts are {'case-folded and ' if m.evaluation.get('case_fold') else ''}cut into sentencepiece pieces "
            f"by the bundle's tokenizer (`tokenizer/`), framed as `<sos>` "
            f"pieces `<eos>` and cut at {m.max_len} token ids; the server applies the same tokenizer.", "",
            "#### Training Hyperparameters", "",
            f"- Fine-tuning: preset `{ev.get('preset')}`, overrides {_overrides(ev.get('overrides', {}))}; seed "
            f"{ev.get('seed')}; {ev.get('epochs')} epochs, the weights of epoch {ev.get('kept_epoch')} kept "
            f"({ev.get('selected_on')}); fp32 weights."]
    if pre and pre.get("preset"):
        loss = pre.get("eval_loss")
        out.append(f"- Pretraining: preset `{pre['preset']}`, overrides {_overrides(pre.get('overrides', {}))}; "
                   f"objective {pre.get('objective')}, {pre.get('steps')} steps, {pre.get('tokens')} tokens, "
                   f"held-out loss {'' if loss is None else f'{loss:.4f}'}; weights sha256 "
                   f"`{pre.get('weights_sha256')}`.")
    elif pre:
        out.append(f"- Pretraining: objective {pre.get('objective')}, weights sha256 `{pre.get('weights_sha256')}` "
                   "(its preset and schedule were not recorded by the source artifact).")
    if pre and pre.get("task_lm"):
        out.append("- Before the head was fitted the language model went on with its objective on the training "
                   "split's texts (finetune.task_lm); validation and test texts were never read.")
    out.append(f"- Source artifact weights sha256 `{m.source_artifact.get('weights_sha256')}`.")
    out += ["", "#### Speeds, Sizes, Times", ""]
    out += [f"- {stage}: {compute_line(c)}" for stage, c in
            (("Fine-tuning", ev.get("compute")), ("Pretraining", (pre or {}).get("compute") if pre else None))
            if stage == "Fine-tuning" or pre]
    # not the export's wall time (the manifest has it): the same artifact exports to the same card, byte for byte
    out += ["- Export: graphs " + ", ".join(f"`{f}`" for f in m.graphs) + "."]
    out += ["", "#### How to Reproduce", "", "From a checkout of transfer-sentiment with its data sets (TS_DATA):",
            "", "```", *reproduce, "```", ""]
    return out


def compute_line(c: dict[str, Any] | None) -> str:
    if not c:
        return "hardware and wall time not recorded by the artifact."
    nodes = f" on {c['nodes']} nodes" if c.get("nodes", 1) > 1 else ""
    return (f"{duration(c.get('wall_seconds'))} of wall time for {c.get('steps_timed')} optimizer steps, "
            f"{c.get('world_size')} rank(s){nodes} on {c.get('device')} ({c.get('device_name')}), "
            f"{c.get('threads_per_rank')} threads per rank.")


def reproduce_commands(m: Manifest, export_command: str) -> list[str]:
    ev = m.evaluation
    pre = ev.get("pretrained_from")
    cmds = []
    if pre and pre.get("preset"):
        sets = [x for k, v in (pre.get("overrides") or {}).items() for x in ("--set", f"{k}={_value(v)}")]
        cmds.append(shlex.join(["python", "-m", "trainer", "pretrain", "--preset", str(pre.get("preset")), *sets,
                                "--out", str(pre.get("path", "PRETRAIN")).removesuffix("/artifact")]))
    cmds.append(ev.get("command") or "python -m trainer finetune (the command was not recorded)")
    cmds.append(export_command)
    return cmds
