"""bench/floor_ratio.py: serving/ against the floor in alternating slices. Each serving/ slice is divided by the mean of
the floor slices beside it, so that a machine whose speed drifts during the run moves both sides of each ratio; and
what it cannot measure (no slice, no second, a damaged bundle) is refused before either server starts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO

spec = importlib.util.spec_from_file_location("floor_ratio", REPO / "bench" / "floor_ratio.py")
floor_ratio = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floor_ratio)  # type: ignore[union-attr]


def test_each_serving_slice_is_divided_by_the_floor_slices_beside_it() -> None:
    serving, floor = object(), object()
    # the machine slows by 10 texts/s a slice; serving/ runs at 0.9 of the floor at every moment
    t = iter(range(100))

    def slice_rate(server: object) -> float:
        machine = 200.0 - 10 * next(t)
        return machine * (0.9 if server is serving else 1.0)

    r = floor_ratio.ratios(slice_rate, serving, floor, 8, 3)  # slices: S F F S S F
    # rates in slice order: S 180, F 190, F 180, S 153, S 144, F 150
    assert len(r["ratios"]) == 3 and r["c"] == 8
    assert r["ratios"][0] == pytest.approx(180 / 190)  # slice 0 has one floor neighbour, slice 1
    assert r["ratios"][1] == pytest.approx(0.9 * 170 / 180)  # slice 3: floor slice 2 before it, serving after
    assert r["ratios"][2] == pytest.approx(0.9 * 160 / 150)  # slice 4: serving before it, floor slice 5 after
    assert r["median"] == pytest.approx(sorted(r["ratios"])[1])


def test_another_tree_is_sliced_in_turn_and_each_has_its_own_floor_neighbours() -> None:
    serving, floor, against = object(), object(), object()
    seen: list[object] = []

    def slice_rate(server: object) -> float:  # the machine slows by 10 texts/s a slice
        seen.append(server)
        machine = 200.0 - 10 * (len(seen) - 1)
        return machine * {serving: 0.9, against: 0.8}.get(server, 1.0)

    r = floor_ratio.ratios(slice_rate, serving, floor, 64, 2, against)
    assert seen == [serving, floor, against, floor, against, floor, serving, floor]  # each side first in turn
    # rates: S 180, F 190, A 144, F 170, A 128, F 150, S 126, F 130
    assert r["ratios"] == pytest.approx([180 / 190, 126 / 140])
    assert r["against"]["ratios"] == pytest.approx([144 / 180, 128 / 160])
    assert r["against"]["median"] == pytest.approx(0.8) and r["floor_texts_per_s"] == pytest.approx(160)


def test_against_a_folder_that_is_no_checkout_exits_2(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "bench/floor_ratio.py", "--bundle", str(tmp_path), "--against", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"--against {tmp_path}: no serving/server.py there" in p.stderr, p.stderr


@pytest.mark.parametrize("args, named", [(["--slices", "0"], "--slices 0"), (["--seconds", "0"], "--seconds 0"),
                                         (["--concurrency", "8", "0"], "--concurrency 8 0")])
def test_what_it_cannot_measure_exits_2_before_a_server_starts(args: list[str], named: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "bench/floor_ratio.py", "--bundle", str(tmp_path), *args], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and named in p.stderr, p.stderr


def test_a_folder_that_is_no_bundle_exits_2_naming_it(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "bench/floor_ratio.py", "--bundle", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"--bundle: {tmp_path}/manifest.json" in p.stderr, p.stderr


def test_h2load_slices_without_h2load_exit_2_naming_the_package(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "bench/floor_ratio.py", "--bundle", str(tmp_path), "--client", "h2load"],
                       cwd=REPO, capture_output=True, text=True, timeout=60, env={"PATH": str(tmp_path)})
    assert p.returncode == 2 and "h2load not found" in p.stderr and "nghttp2-client" in p.stderr, p.stderr
