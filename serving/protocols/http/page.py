"""The try-it page (GET /, with --http-page): a person types reviews, one per line, and reads each one's label and
probabilities. One self-contained document: no external asset, its script and style allowed by their hashes in the
Content-Security-Policy and nothing else (no other script runs, no other origin is reached). It calls POST
/v1/classify on the same server, with the bearer token typed into its field when the server wants one, on the model
chosen in a list of the ready ones (the repository index), and says which version answered."""

from __future__ import annotations

import base64
import hashlib

STYLE = """
body { font: 15px/1.4 system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
h1 { font-size: 1.3rem; } textarea { width: 100%; box-sizing: border-box; font: inherit; }
input { font: inherit; width: 20rem; } button { font: inherit; padding: .3rem 1.2rem; margin: .5rem 0; }
table { border-collapse: collapse; width: 100%; margin-top: 1rem; }
td, th { border-bottom: 1px solid #ddd; padding: .35rem .5rem; text-align: left; vertical-align: top; }
.bar { display: inline-block; height: .7rem; background: #4a7bd1; margin-right: .4rem; }
.error { color: #a00; white-space: pre-wrap; } .small { color: #666; font-size: .85rem; }
"""

SCRIPT = """
const form = document.getElementById("form"), models = document.getElementById("model");
function authHeaders() {
  const headers = {"Content-Type": "application/json"};
  const token = document.getElementById("token").value.trim();
  if (token) headers["Authorization"] = "Bearer " + token;
  return headers;
}
async function listModels() {  /* the ready models, from the repository index */
  try {
    const response = await fetch("v2/repository/index", {method: "POST", headers: authHeaders(),
                                                          body: JSON.stringify({ready: true})});
    if (!response.ok) return;
    const names = [...new Set((await response.json()).map((m) => m.name))];
    models.replaceChildren(...names.map((n) => new Option(n, n)));
  } catch (e) { /* the page still works on a server of one model */ }
}
listModels();
document.getElementById("token").addEventListener("change", listModels);
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const texts = document.getElementById("texts").value.split("\\n").filter((t) => t.trim());
  const out = document.getElementById("out"), error = document.getElementById("error");
  out.replaceChildren(); error.textContent = "";
  if (!texts.length) { error.textContent = "Type at least one review."; return; }
  const headers = authHeaders();
  if (!models.options.length) await listModels();
  const model_name = models.value || "";
  let answer;
  try {
    const response = await fetch("v1/classify", {method: "POST", headers,
                                                 body: JSON.stringify({texts, model_name})});
    answer = await response.json();
    if (!response.ok) { error.textContent = response.status + " " + answer.code + ": " + answer.error; return; }
  } catch (e) { error.textContent = "no answer from the server: " + e; return; }
  const meta = "v1/metadata?model_name=" + encodeURIComponent(answer.model_name) +
               "&model_version=" + encodeURIComponent(answer.model_version);
  const names = (await (await fetch(meta, {headers})).json()).labels;
  document.getElementById("answered").textContent = "Answered by " + answer.model_name + ", version " +
    answer.model_version + ".";
  answer.results.forEach((r, i) => {
    const row = out.insertRow();
    row.insertCell().textContent = texts[i];
    const label = row.insertCell(); label.textContent = r.label; label.className = "label";
    const probs = row.insertCell();
    r.probabilities.forEach((p, j) => {
      const line = document.createElement("div"), bar = document.createElement("span");
      bar.className = "bar"; bar.style.width = Math.round(p * 8) + "rem";
      line.append(bar, names[j] + " " + p.toFixed(3)); probs.append(line);
    });
    row.insertCell().textContent = r.token_count + (r.truncated ? " (cut)" : "");
  });
});
"""

_BODY = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>sentiment-server</title><style>{style}</style></head>
<body><h1>Try the sentiment model</h1>
<form id="form"><label for="texts">Reviews, one per line:</label>
<textarea id="texts" rows="6">Un livre magnifique, je le recommande.
Ennuyeux du début à la fin.</textarea>
<label for="token">Bearer token (when the server asks for one):</label>
<input id="token" type="password" autocomplete="off">
<br><label for="model">Model:</label> <select id="model"></select>
<br><button type="submit">Classify</button></form>
<div id="error" class="error"></div>
<table><thead><tr><th>Review</th><th>Label</th><th>Probabilities</th><th>Tokens</th></tr></thead>
<tbody id="out"></tbody></table>
<p id="answered" class="small"></p>
<p class="small">POST /v1/classify; the API: <a href="openapi.json">openapi.json</a></p>
<script>{script}</script></body></html>
"""


def _hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


HTML = _BODY.format(style=STYLE, script=SCRIPT).encode()
HEADERS = [
    (b"content-security-policy", (f"default-src 'none'; script-src {_hash(SCRIPT)}; style-src {_hash(STYLE)}; "
                                  "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; "
                                  "base-uri 'none'").encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
