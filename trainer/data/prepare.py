"""Tokenize the pretraining text (`data.pretrain`) once, in parallel, into a prepared folder of memory-mapped shards.

`pretrain --set data.prepared=DIR` then trains from DIR with no tokenizing at all, on any number of ranks and nodes
(each node may hold its own copy at the same path: every copy is checked against the manifest at start). The folder
also holds the tokenizer (DIR/tokenizer), which such a run uses unless --tokenizer names the same one.

Inputs: paths or globs (relative to data.root), any trainer/data/readers.py format, gzipped or not; globs are sorted and
documents keep the input order. One process reads the files in blocks of whole lines (a .parquet file by row group);
a pool of worker processes (--workers, all cores by default) parses and tokenizes the blocks, each on one thread;
the results are written in input order. So the bytes depend only on the inputs, the tokenizer and --shard-tokens,
never on the worker count, and a prepare killed at any point resumes after its last complete shard (run the same
command again) and ends with the bytes of an uninterrupted one. Format of the folder: trainer/data/corpus.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from trainer import cli
from trainer.atomic import write_bytes_atomic
from trainer.config.choice import add_config_args, config_choice
from trainer.config.schema import RunConfig
from trainer.data.blocks import block_texts, parquet_texts, read_blocks
from trainer.data.corpus import (
    FORMAT,
    MANIFEST,
    TOKENIZER_DIR,
    PreparedError,
    ShardWriter,
    encode_documents,
    files_of,
    read_manifest,
    token_dtype,
    tokenizer_entry,
    verify,
)
from trainer.data.readers import DataError, Example, expand_inputs, file_format
from trainer.data.tables import parquet_row_groups
from trainer.data.tokenizer import Tokenizer, build_tokenizer

EXAMPLES = """examples:
  python -m trainer prepare --preset demo --out runs/demo/prepared
  python -m trainer prepare --preset demo --set 'data.pretrain=/corpus/part-*.txt.gz' --out /data/prepared  # your text
  python -m trainer pretrain --preset demo --set data.prepared=runs/demo/prepared --out runs/demo/pretrain
"""

SHARD_TOKENS = 1 << 26  # 64 Mi ids a shard: 128 MiB as uint16; a node checks its shards in parallel, a share a rank
BLOCK_BYTES = 1 << 20  # raw input bytes a worker gets at a time
IN_FLIGHT = 4  # blocks queued per worker: enough to keep it busy, bounded so the reader never runs far ahead
LOG_EVERY_S = 10.0  # seconds between progress lines when stderr is not a terminal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, default_preset="demo")
    g = parser.add_argument_group("prepare")
    g.add_argument("--out", required=True, metavar="DIR", help="the prepared folder (created; resumed if incomplete)")
    g.add_argument("--tokenizer", metavar="DIR", help="use this tokenizer folder instead of building the config's")
    g.add_argument("--workers", type=int, default=0, metavar="N",
                   help="tokenizing processes (default 0: one per core this process may use)")
    g.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, metavar="N",
                   help=f"ids per shard, at least (a shard ends with a document; default {SHARD_TOKENS})")


def main(args: argparse.Namespace) -> int:
    if args.workers < 0 or args.shard_tokens < 1:
        raise DataError(f"--workers must be >= 0 and --shard-tokens >= 1, got {args.workers}, {args.shard_tokens}")
    cfg = config_choice(args).resolve()
    out = Path(args.out)
    cli.check_out(out)
    tok = Tokenizer.load(args.tokenizer, cfg.tokenizer.max_len) if args.tokenizer else build_tokenizer(cfg)
    t0 = time.perf_counter()
    m = prepare_config(cfg, tok, out, args.workers, args.shard_tokens)
    print(f"prepare: {out}: {m['documents']:,} documents, {m['tokens']:,} ids in {len(m['shards'])} shards "
          f"({m['dtype']}), {time.perf_counter() - t0:.0f} s this session; "
          f"train with --set data.prepared={out}", file=sys.stdout)
    return 0


# ---------------------------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class Job:
    """One unit of a worker's work: a block of whole lines of a text file, or one row group of a .parquet file."""

    file: int  # index of the input
    path: str
    first_line: int = 1  # text: the block's first line; parquet: unused
    data: bytes = b""
    header: bytes | None = None
    group: int = -1  # parquet: the row group
    after: int = 0  # resume: documents at or before this line (row) were written already
    progress: int = 0  # input bytes read once this job is done (all files before it included)


_worker: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, max_len: int, text_field: str) -> None:
    _worker["tok"], _worker["text_field"] = Tokenizer.load(tokenizer_dir, max_len), text_field


def _work(job: Job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A job -> (framed ids in the folder's dtype, framed lengths (n,), input line or row of each document (n,))."""
    tok: Tokenizer = _worker["tok"]
    docs: list[Example] = list(
        parquet_texts(job.path, job.group, _worker["text_field"], after_row=job.after) if job.group >= 0
        else block_texts(job.path, job.first_line, job.data, job.header, _worker["text_field"], after_line=job.after))
    lines = np.array([int(ex.source.rsplit(":", 1)[1]) for ex in docs], dtype=np.int64)  # source is "path:line"
    if not docs:
        return np.zeros(0, token_dtype(tok.vocab_size)), np.zeros(0, np.int64), lines
    ids, lengths = encode_documents(docs, tok, threads=1)  # one thread: the pool is the parallelism
    return ids.astype(token_dtype(tok.vocab_size)), lengths, lines


def _jobs(files: list[Path], start: tuple[int, int], block_bytes: int) -> Iterator[Job]:
    """Every job from input position `start` = (file index, line) on; earlier files are not opened."""
    done = sum(p.stat().st_size for p in files[:start[0]])
    for fi in range(start[0], len(files)):
        path, after = files[fi], start[1] if fi == start[0] else 0
        size = path.stat().st_size
        if file_format(path) == ".parquet":
            groups = parquet_row_groups(path)
            rows = 0
            for g, n in enumerate(groups):
                rows += n
                if rows > after:
                    yield Job(fi, str(path), group=g, after=after, progress=done + size * rows // max(1, sum(groups)))
        else:
            for b in read_blocks(path, block_bytes):
                if b.last_line > after:
                    yield Job(fi, str(path), b.first_line, b.data, b.header, after=after,
                              progress=done + min(size, b.read_bytes))
        done += size


# ---------------------------------------------------------------------------------------------- prepare


def prepare(files: list[Path], tokenizer: Tokenizer, out: Path, workers: int = 0, shard_tokens: int = SHARD_TOKENS,
            text_field: str = "text", block_bytes: int = BLOCK_BYTES, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Tokenize `files` into the prepared folder `out`; returns its manifest.

    `workers`: tokenizing processes (0: one per core this process may use). A folder left by a killed prepare of the
    same inputs, tokenizer and shard_tokens resumes after its last complete shard; a complete one is returned as it is
    (after its files' sizes are checked); one made from anything else is refused."""
    workers = workers or len(os.sched_getaffinity(0))
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    header = {"format": FORMAT, "tokenizer": {"fingerprint": tokenizer.fingerprint}, "vocab_size":
              tokenizer.vocab_size, "dtype": dtype.name, "shard_tokens": shard_tokens, "text_field": text_field,
              "inputs": [{"path": str(p), "bytes": p.stat().st_size} for p in files]}
    manifest = _resume_point(out, header)
    if manifest.get("complete"):
        return manifest
    if not (out / TOKENIZER_DIR).is_dir():
        tokenizer.save(out / TOKENIZER_DIR)
    header["tokenizer"] = tokenizer_entry(out / TOKENIZER_DIR, tokenizer)
    shards: list[dict[str, Any]] = manifest.get("shards", [])

    def save(complete: bool) -> dict[str, Any]:
        body = {**header, "complete": complete, "documents": sum(s["documents"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards), "shards": shards}
        write_bytes_atomic(out / MANIFEST, (json.dumps(body, indent=1) + "\n").encode())
        return body

    save(False)
    writer = ShardWriter(out, len(shards), dtype)

    def write(ids: np.ndarray, lengths: np.ndarray, where: np.ndarray) -> None:
        """Append framed documents ((n, 2) input positions); close the shard at the first document end at or past
        shard_tokens, then list it in the manifest (a listed shard is always complete on disk)."""
        nonlocal writer
        while len(lengths):
            ends = np.cumsum(lengths)
            k = int(np.searchsorted(ends, shard_tokens - writer.tokens))  # first document reaching the limit
            if k == len(lengths):
                writer.add(ids, lengths, tuple(where[-1].tolist()))
                return
            writer.add(ids[:ends[k]], lengths[:k + 1], tuple(where[k].tolist()))
            shards.append(writer.close())
            save(False)
            writer = ShardWriter(out, len(shards), dtype)
            ids, lengths, where = ids[ends[k]:], lengths[k + 1:], where[k + 1:]

    start = tuple(shards[-1]["end"]) if shards else (0, 0)
    seen = {i for i in range(start[0] + (start[1] > 0))}  # inputs that gave documents (before the resume point: all)
    progress = Progress(sum(p.stat().st_size for p in files), log)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["trainer.data.prepare"])  # the workers import this module once, not the caller's script
    init = (str(out / TOKENIZER_DIR), tokenizer.max_len, text_field)
    with ctx.Pool(workers, initializer=_init_worker, initargs=init) as pool:
        pending: collections.deque = collections.deque()  # (job, result) in input order
        for job in _with_end(_jobs(files, start, block_bytes)):
            if job is not None:
                pending.append((job, pool.apply_async(_work, (job,))))
            while pending and (job is None or len(pending) >= IN_FLIGHT * workers):
                done, res = pending.popleft()
                ids, lengths, lines = res.get()
                if len(lines):
                    seen.add(done.file)
                    write(ids, lengths, np.stack([np.full(len(lines), done.file), lines], axis=1))
                progress.update(done.progress, len(shards), sum(s["tokens"] for s in shards) + writer.tokens)
    progress.close()
    empty = [str(files[i]) for i in range(len(files)) if i not in seen]
    if empty:
        writer.discard()
        raise DataError(f"{empty[0]}: file is empty (no non-blank documents)")
    if writer.tokens:
        shards.append(writer.close())
    else:
        writer.discard()
    return save(True)


def prepare_config(cfg: RunConfig, tokenizer: Tokenizer, out: Path, workers: int = 0,
                   shard_tokens: int = SHARD_TOKENS) -> dict[str, Any]:
    """`prepare` of the text a config names: data.pretrain's files (relative to data.root, globs expanded), each
    document read from data.text_field. The prepare command and a pretrain run without data.prepared both call it."""
    files = expand_inputs([cfg.data.path(p) for p in cfg.data.pretrain])
    return prepare(files, tokenizer, out, workers, shard_tokens, cfg.data.text_field)


def _with_end(jobs: Iterator[Job]) -> Iterator[Job | None]:
    yield from jobs
    yield None  # drain what is still in flight


def _resume_point(out: Path, header: dict[str, Any]) -> dict[str, Any]:
    """The manifest to continue from: none yet, or a killed prepare's (its listed shards checked, strays removed)."""
    # A kill while a shard or the manifest was written leaves its temporary sibling (write_bytes_atomic's name).
    for stray in [*out.glob(".shard-*.tmp"), *out.glob(f".{MANIFEST}.*.tmp")]:
        stray.unlink()
    if not (out / MANIFEST).exists():
        if any(out.glob("shard-*")):
            raise PreparedError(f"{out}: holds shard files but no {MANIFEST}; prepare into an empty folder")
        return {}
    old = read_manifest(out)
    changed = [k for k in header if k != "tokenizer" and old.get(k) != header[k]]
    if old["tokenizer"]["fingerprint"] != header["tokenizer"]["fingerprint"]:
        changed.insert(0, "tokenizer")
    if changed:
        raise PreparedError(f"{out}: prepared with other {', '.join(changed)}; prepare these inputs into a new folder")
    listed = {n for s in old["shards"] for n in (s["bin"], s["idx"])}
    for f in out.glob("shard-*"):
        if f.name not in listed:  # written after the last manifest update: made again
            f.unlink()
    problems = verify(out, files_of(old), full=False)
    if problems:
        raise PreparedError(problems[0])
    return old


class Progress:
    """A tqdm bar in input bytes on a terminal; else a plain line every LOG_EVERY_S seconds (a log file gets lines,
    not a bar redrawn into one endless line)."""

    def __init__(self, total: int, log: TextIO) -> None:
        self.total, self.log, self.done = total, log, 0
        self.t0 = self.t_log = time.perf_counter()
        self.bar = None
        if log.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=log)

    def update(self, done: int, shards: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
            self.bar.set_postfix_str(f"{shards} shards, {tokens:,} ids", refresh=False)
        elif time.perf_counter() - self.t_log >= LOG_EVERY_S:
            self.t_log = time.perf_counter()
            elapsed = self.t_log - self.t0
            rate = tokens / max(elapsed, 1e-9)
            left = (self.total - done) * elapsed / max(done, 1)
            print(f"prepare: {100 * done / max(1, self.total):.0f}% of {self.total / 1e6:,.0f} MB of input, "
                  f"{shards} shards, {tokens:,} ids, {rate:,.0f} ids/s, about {left:.0f} s left",
                  file=self.log, flush=True)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
