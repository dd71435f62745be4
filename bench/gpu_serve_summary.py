"""One summary of what bench/gpu_serve_check.sh wrote into its output folder: steps, machine, CUDA tests, serving
rows, the comparisons the GPU serving goals name, IO binding, memory, worker scaling. Prints markdown and writes it to
FOLDER/summary.md. A file a step did not write is reported as missing, not guessed.

    python bench/gpu_serve_summary.py runs/gpu-serve-check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BATCHING_TARGET = 3.0  # batching on / off, one text per call, on the GPU
WORKERS_TARGET = 6.0  # requests/s of 8 workers / 1 worker
FLOOR_TARGET = 0.95  # serving/ / the bare grpcio floor, at every worker count


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _last_json(path: Path) -> dict | None:
    """The last line of a log that is a JSON object (measure_rss prints one among the server's log lines)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _machine(path: Path) -> dict | None:
    """machine.txt: the JSON object the `machine` step printed (possibly after other lines)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        return None


def steps(folder: Path) -> list[str]:
    out = ["## Steps", "", "| step | status | seconds |", "|---|---|---:|"]
    try:
        rows = [line.split("\t") for line in (folder / "steps.tsv").read_text().splitlines()[1:] if line]
    except OSError:
        return out + ["| (steps.tsv missing) | | |"]
    return out + [f"| {r[0]} | {r[1]} | {r[2] if len(r) > 2 else ''} |" for r in rows]


def machine(folder: Path) -> list[str]:
    m = _machine(folder / "machine.txt")
    device = (folder / "device.txt").read_text().strip() if (folder / "device.txt").exists() else "?"
    if m is None:
        return ["## Machine", "", f"device used: {device}; machine.txt missing"]
    return ["## Machine", "", f"device used: {device}; GPU: {m.get('gpu')}; {m.get('cores')} cores; torch "
            f"{m.get('torch')} (CUDA {m.get('torch_cuda')}); onnxruntime {m.get('onnxruntime')} (built for CUDA "
            f"{m.get('onnxruntime_cuda') or 'none'}), providers {m.get('providers')}; CUDA provider's libraries: "
            f"{m.get('cuda_library_problem') or 'all load'}"]


def tests(folder: Path) -> list[str]:
    try:
        lines = [x for x in (folder / "tests.txt").read_text().splitlines() if x.strip()]
    except OSError:
        return ["## CUDA tests", "", "tests.txt missing (see steps)"]
    verdict = next((x for x in reversed(lines) if " passed" in x or " failed" in x or " skipped" in x
                    or " error" in x), lines[-1] if lines else "(empty)")
    skipped = [x for x in lines if x.startswith("SKIPPED")]
    return ["## CUDA tests", "", verdict.strip("= "), *[f"- {x}" for x in skipped]]


def serving(folder: Path) -> tuple[list[str], list[dict]]:
    rows, notes = [], []
    for name in ("serve-fp32.json", "serve-fp16.json"):
        data = _json(folder / name)
        rows += data["rows"] if data else []
        if data and data.get("in_process_skipped"):
            notes.append(f"{name}: in-process and eager rows skipped (too many texts at once on the device): "
                         + ", ".join(data["in_process_skipped"]))
    out = ["## Serving", "", "| mode | device, graph | texts per call | concurrency | texts/s | p50 ms | p99 ms | "
           "mean texts per ORT run | refused |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        batch = f"{r['mean_batch']:.1f}" if "mean_batch" in r else str(r["per_call"])
        refused = sum((r.get("errors") or {}).values())
        out.append(f"| {r['mode']} | {r.get('device')}, {r.get('precision')} | {r['per_call']} | {r['concurrency']} "
                   f"| {r['texts_per_s']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {batch} | {refused} |")
    if not rows:
        out.append("| (serve-fp32.json and serve-fp16.json missing) | | | | | | | | |")
    return out + ([""] + notes if notes else []), rows


def comparisons(rows: list[dict]) -> list[str]:
    by = {(r["mode"], r.get("precision"), r["per_call"], r["concurrency"]): r for r in rows}
    out = ["## Against the goals", ""]

    def ratio(a: tuple, b: tuple) -> float | None:
        x, y = by.get(a), by.get(b)
        return x["texts_per_s"] / y["texts_per_s"] if x and y and y["texts_per_s"] > 0 else None

    points = sorted({(r.get("precision"), r["per_call"], r["concurrency"]) for r in rows})
    gains = [(c, ratio(("server, batching on", p, k, c), ("server, batching off", p, k, c)))
             for p, k, c in points if k == 1]
    gains = [(c, g) for c, g in gains if g is not None]
    if gains:
        best_c, best = max(gains, key=lambda x: x[1])
        verdict = "meets" if best >= BATCHING_TARGET else "misses"
        out.append(f"- batching on / off, 1 text per call: {', '.join(f'c={c} {g:.2f}x' for c, g in gains)}; best "
                   f"{best:.2f}x at c={best_c}: {verdict} the {BATCHING_TARGET:.0f}x goal")
    for p, k, c in points:
        parts = []
        served = ratio(("server, batching on", p, k, c), ("in-process predictor", p, k, c))
        if served is not None:
            parts.append(f"server / in-process {served:.2f}x")
        dtype = "fp16" if p == "fp16" else "fp32"  # the eager run beside this graph (the CPU's int8: fp32)
        eager = ratio(("in-process predictor", p, k, c), (f"PyTorch eager {dtype}", dtype, k, c))
        if eager is not None:
            parts.append(f"ONNX Runtime / PyTorch eager {dtype} {eager:.2f}x")
        half = ratio(("server, batching on", "fp16", k, c), ("server, batching on", "fp32", k, c))
        if half is not None and p == "fp16":
            parts.append(f"fp16 / fp32 server {half:.2f}x")
        if parts:
            out.append(f"- {p}, {k} per call, c={c}: " + "; ".join(parts))
    drift = {r["mode"]: r["max_prob_diff_vs_bundle"] for r in rows if "max_prob_diff_vs_bundle" in r}
    out += [f"- {mode}: largest probability difference from the bundle's graph on 8 texts {d:.2e}"
            for mode, d in drift.items()]
    return out if len(out) > 2 else out + ["(no serving rows)"]


def iobinding(folder: Path) -> list[str]:
    data = _json(folder / "iobinding.json")
    if data is None:
        return ["## IO binding", "", "iobinding.json missing (see steps)"]
    out = ["## IO binding", "", f"{data.get('provider')}, {data.get('precision')}; MatMul peak "
           f"{data['peak_gflop_s']:.0f} GFLOP/s", "",
           "| ids per text | texts per run | run(): ms per text | IO binding, host inputs | IO binding, inputs on the "
           "GPU | run() / IO binding on the GPU |", "|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        device = r.get("iobinding_device_ms_per_text")
        gain = f"{r['ms_per_text'] / device:.2f}x" if device else ""
        out.append(f"| {r['length']} | {r['batch']} | {r['ms_per_text']:.4f} | "
                   f"{r.get('iobinding_host_ms_per_text', float('nan')):.4f} | {device or float('nan'):.4f} | "
                   f"{gain} |")
    graph = data.get("cuda_graph")
    if graph:
        replay = f"{graph['cuda_graph_ms_per_text']:.4f} ms per text" if "cuda_graph_ms_per_text" in graph \
            else f"refused: {graph.get('cuda_graph_error')}"
        out += ["", f"CUDA graph, {graph['batch']} x {graph['length']} ids, inputs on the GPU: {replay} (without: "
                f"{graph['device_ms_per_text']:.4f} ms per text)"]
    return out


def memory(folder: Path) -> list[str]:
    data = _last_json(folder / "rss.txt")
    if data is None:
        return ["## Memory", "", "rss.txt holds no measurement (see steps)"]
    return ["## Memory", "", "deploy/measure_rss.py: " + ", ".join(f"{k} {v}" for k, v in data.items())]


def workers(folder: Path) -> list[str]:
    data = _json(folder / "workers.json")
    if data is None:
        return ["## Workers", "", "workers.json missing (see steps)"]
    rows, floors = data["rows"], {f["workers"]: f for f in data.get("floor", [])}
    base = rows[0]["requests_per_s"]
    out = ["## Workers (CPU provider)", "",
           "| workers | requests/s | vs 1 worker | floor requests/s | serving/ / floor |", "|---:|---:|---:|---:|---:|"]
    shares = []
    for r in rows:
        f = floors.get(r["workers"])
        share = r["requests_per_s"] / f["requests_per_s"] if f and f["requests_per_s"] > 0 else None
        if share is not None:
            shares.append(share)
        out.append(f"| {r['workers']} | {r['requests_per_s']:.0f} | {r['requests_per_s'] / base:.2f}x | "
                   f"{f['requests_per_s'] if f else float('nan'):.0f} | "
                   f"{'' if share is None else f'{100 * share:.0f}%'} |")
    last = rows[-1]
    scale = last["requests_per_s"] / base
    out.append(f"- {last['workers']} workers / {rows[0]['workers']}: {scale:.2f}x "
               f"({'meets' if scale >= WORKERS_TARGET else 'misses'} the {WORKERS_TARGET:.0f}x goal at 8)")
    if shares:
        out.append(f"- serving/ at {100 * min(shares):.0f}% of the floor at worst "
                   f"({'meets' if min(shares) >= FLOOR_TARGET else 'misses'} the {100 * FLOOR_TARGET:.0f}% goal)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="bench/gpu_serve_check.sh's output folder")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        ap.error(f"{args.folder} is not a folder")
    serve, rows = serving(args.folder)
    parts = [steps(args.folder), machine(args.folder), tests(args.folder), serve, comparisons(rows),
             iobinding(args.folder), memory(args.folder), workers(args.folder)]
    text = "\n\n".join("\n".join(p) for p in parts) + "\n"
    (args.folder / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
