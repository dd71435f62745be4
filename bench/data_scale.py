"""Data at scale: prepare throughput, and pretraining's time to first step and anonymous memory per rank, against
corpus size (docs/BENCHMARKS.md, "Data at scale").

Builds corpora of at least each --sizes pieces from the shipped text (eltec-fr and IMDB unsup, each linked again and
again under --work: symlinks, no copies), prepares each with `python -m trainer prepare` (--workers; the largest
worker count for every size, each count for the sizes up to --throughput-max), then starts pretraining from each
prepared folder with 1 and 2 ranks (--ranks; 2 through the DeepSpeed launcher) and measures:
  - prepare: pieces/s (ids minus the two specials a document), wall time of the whole command;
  - time to first step: from the launch to the first row of metrics.csv (engine.log_every=1), imports included;
  - RssAnon: the peak, over samples every 0.1 s until that row, of /proc/PID/status RssAnon of each rank process
    (anonymous memory only: the pages of the memory-mapped shards are file-backed and shared, so they do not count).
The start-up check of the copy uses data.verify=size (presence and sizes; --verify sha256 hashes every shard, the
one cost that grows with the corpus by design, about 2 GB read at 1 B pieces).
Everything under --work is deleted at the end unless --keep. The model is --preset's (demo by default).

  .venv/bin/python bench/data_scale.py --work runs/data-scale --sizes 15e6,150e6,1e9 --json runs/data-scale.json
  .venv/bin/python bench/data_scale.py --work /tmp/ds --sizes 2e5,1e6 --preset tiny \
    --sources cls-books-fr/train.review.txt,cls-books-fr/valid.review.txt         # a quick check
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from trainer.config.presets import data_sets

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("eltec-fr/eltec_fra.txt.gz", "imdb/unsup.txt.gz")


def environment() -> dict[str, str]:
    """The venv's bin first on PATH (the DeepSpeed launcher), no inherited ranks (the trainer sets DeepSpeed's
    accelerator to the device it trains on)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def sh(cmd: list[str], log: Path) -> float:
    """Run a command to completion (output to `log`); its wall time in seconds. A failure ends the bench."""
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        p = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=environment())
    if p.returncode:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def trainer(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def pieces_of(folder: Path) -> int:
    m = json.loads((folder / "manifest.json").read_text())
    return int(m["tokens"]) - 2 * int(m["documents"])


def build(work: Path, data: Path, sources: list[str], per_source: list[int], size: float) -> tuple[Path, int]:
    """A folder of symlinks to the sources, repeated until the pieces reach `size`: (folder, estimated pieces)."""
    copies = max(1, math.ceil(size / sum(per_source)))
    folder = work / f"corpus-{size:.0e}"
    folder.mkdir(parents=True, exist_ok=True)
    for c in range(copies):
        for s, src in enumerate(sources):
            link = folder / f"part-{c:04d}-{s}-{Path(src).name}"
            if not link.exists():
                link.symlink_to(data / src)
    return folder, copies * sum(per_source)


def first_step(cmd: list[str], run: Path, log: Path, ranks: int) -> tuple[float, list[int]]:
    """Start a pretraining command; (seconds to its first metrics row, peak RssAnon in bytes of each rank)."""
    t0 = time.perf_counter()
    peaks: dict[int, int] = {}
    with open(log, "ab") as f:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=environment(),
                             start_new_session=True)
        try:
            while not (run / "metrics.csv").is_file() or len((run / "metrics.csv").read_text().splitlines()) < 2:
                if p.poll() is not None:
                    sys.exit(f"pretraining ended ({p.returncode}) before its first step: see {log}")
                for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
                    if ranks == 1 or "--local_rank" in " ".join(_cmdline(proc)):  # the rank processes
                        peaks[proc.pid] = max(peaks.get(proc.pid, 0), _rss_anon(proc.pid))
                time.sleep(0.1)
            seconds = time.perf_counter() - t0
        finally:
            os.killpg(p.pid, 9)
            p.wait()
    return seconds, sorted(peaks.values(), reverse=True)[:ranks]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="scratch folder (corpora, prepared folders, runs)")
    p.add_argument("--sizes", default="15e6,150e6,1e9", help="corpus sizes in pieces, comma-separated")
    p.add_argument("--workers", default="1,2", help="prepare worker counts")
    p.add_argument("--throughput-max", type=float, default=150e6,
                   help="every worker count is timed up to this size; above it only the largest")
    p.add_argument("--ranks", default="1,2", help="pretraining rank counts")
    p.add_argument("--preset", default="demo", help="config preset the runs use (default: demo)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: the preset's, built once)")
    p.add_argument("--data", type=Path, default=Path(data_sets()),
                   help="folder holding the --sources (default: $TS_DATA, else where `trainer data fetch` puts them)")
    p.add_argument("--sources", default=",".join(SOURCES), help="text files under --data, repeated to each size")
    p.add_argument("--verify", choices=["size", "sha256"], default="size", help="data.verify of the pretraining runs")
    p.add_argument("--keep", action="store_true", help="keep --work (default: deleted at the end)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    sources = args.sources.split(",")
    workers = sorted(int(w) for w in args.workers.split(","))
    ranks = sorted(int(r) for r in args.ranks.split(","))
    work, data = args.work.absolute(), args.data.absolute()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench.log"
    load0 = os.getloadavg()
    common = ["--preset", args.preset, "--set", f"data.root={data}"]
    try:
        tok = args.tokenizer or work / "tokenizer"
        if not args.tokenizer:
            sh(trainer("tokenizer", *common, "--out", str(tok)), log)
        per_source = []
        for src in sources:  # exact pieces of one copy of each source
            out = work / f"one-{len(per_source)}"
            sh(trainer("prepare", *common, "--tokenizer", str(tok), "--set", f"data.pretrain={data / src}",
                       "--out", str(out)), log)
            per_source.append(pieces_of(out))
        rows: list[dict[str, Any]] = []
        for size in sizes:
            corpus, _ = build(work, data, sources, per_source, size)
            folder = None
            for w in (workers if size <= args.throughput_max else workers[-1:]):
                folder = work / f"prepared-{size:.0e}-w{w}"
                secs = sh(trainer("prepare", *common, "--tokenizer", str(tok), "--workers", str(w),
                                  "--set", f"data.pretrain={corpus}/part-*", "--out", str(folder)), log)
                n = pieces_of(folder)
                rows.append({"what": "prepare", "size": size, "pieces": n, "workers": w, "seconds": secs,
                             "pieces_per_s": n / secs, "bytes": sum(f.stat().st_size for f in folder.iterdir()
                                                                     if f.is_file())})
                print(json.dumps(rows[-1]), flush=True)
            assert folder is not None
            for r in ranks:
                run = work / f"run-{size:.0e}-r{r}"
                stage = ["pretrain", *common, "--set", f"data.prepared={folder}", "--set", f"data.verify={args.verify}",
                         "--set", "engine.log_every=1", "--set", "pretrain.max_steps=1000", "--out", str(run)]
                cmd = trainer(*stage) if r == 1 else [
                    str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(r), "--master_port",
                    str(29500 + r + int(math.log10(size))), str(REPO / "launch" / "pretrain.sh"), *stage[1:]]
                secs, peaks = first_step(cmd, run, log, r)
                rows.append({"what": "first_step", "size": size, "pieces": pieces_of(folder), "ranks": r,
                             "seconds": secs, "rss_anon_mb": [round(b / 2**20, 1) for b in peaks]})
                print(json.dumps(rows[-1]), flush=True)
                shutil.rmtree(run, ignore_errors=True)
        meta = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "cores": len(os.sched_getaffinity(0)), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                "command": " ".join(sys.argv), "preset": args.preset, "verify": args.verify}
        print(markdown(rows, meta))
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    la = " ".join(f"{x:.2f}" for x in meta["loadavg_start"])
    out = [f"Data at scale, {meta['date']}, {meta['cores']} cores, load average {la} at start; preset "
           f"{meta['preset']}, data.verify={meta['verify']}.", "",
           "| corpus pieces | prepare workers | prepare s | pieces/s | bytes on disk |", "|---:|---:|---:|---:|---:|"]
    out += [f"| {r['pieces']:,} | {r['workers']} | {r['seconds']:.0f} | {r['pieces_per_s']:,.0f} | {r['bytes']:,} |"
            for r in rows if r["what"] == "prepare"]
    out += ["", "| corpus pieces | ranks | time to first step s | RssAnon per rank MB |", "|---:|---:|---:|---:|"]
    out += [f"| {r['pieces']:,} | {r['ranks']} | {r['seconds']:.1f} | {', '.join(map(str, r['rss_anon_mb']))} |"
            for r in rows if r["what"] == "first_step"]
    return "\n".join(out)


if __name__ == "__main__":
    main()
