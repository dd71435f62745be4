"""bench/bench_texts.py: the one place the serving benchmarks read their test texts from (the fetched cls-books-fr
split): the same sample at every run, blank lines left out, and a missing folder one line naming the fetch command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from procs import REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_texts


def test_the_sample_is_the_same_at_every_run_and_holds_no_blank_line(tmp_path: Path) -> None:
    (tmp_path / "cls-books-fr").mkdir()
    (tmp_path / "cls-books-fr" / "test.review.txt").write_text("".join(f"review {i}\n\n" for i in range(37)))
    ap = argparse.ArgumentParser()
    first, again = bench_texts.test_texts(ap, tmp_path, 11), bench_texts.test_texts(ap, tmp_path, 11)
    assert first == again and len(set(first)) == 11 and all(t.startswith("review ") for t in first)
    assert bench_texts.reviews(ap, tmp_path) == [f"review {i}" for i in range(37)]


def test_a_missing_split_exits_2_naming_the_file_and_the_fetch_command(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_texts.test_texts(argparse.ArgumentParser(prog="x"), tmp_path, 3)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{tmp_path}/cls-books-fr/test.review.txt not found" in err
    assert "python -m trainer data fetch" in err


def test_no_other_benchmark_reads_the_test_split_its_own_way() -> None:
    # (a docstring may name the file; bench/batch_invariance.py takes any file of texts by --data)
    readers = [p.name for p in sorted((REPO / "bench").glob("*.py")) if '"test.review.txt"' in p.read_text()]
    assert readers == ["bench_texts.py"]
