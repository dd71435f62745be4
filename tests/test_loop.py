"""trainer/engine/loop.py in-process: when the cadence logs, evaluates, checkpoints and stops, and the typed run
options.
The loop itself runs in every training test (tests/test_training.py); resumed == uninterrupted is checked there."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config.schema import ConfigError
from trainer.engine.loop import Cadence, RunOptions, order_digest


def steps(cadence: Cadence, question: str, epoch_ends: frozenset[int] = frozenset()) -> list[int]:
    ask = getattr(cadence, question)
    if question in ("evaluate", "log"):
        return [s for s in range(1, cadence.total + 1) if ask(s, s in epoch_ends)]
    return [s for s in range(1, cadence.total + 1) if ask(s)]


def test_pretraining_cadence() -> None:
    """Eval every 4 steps and at the end; a log row at every 3rd step and with every eval; checkpoints every 5
    steps, at the end and at the stop step."""
    c = Cadence(total=10, log_every=3, checkpoint_every=5, eval_every=4, stop_at=7)
    assert steps(c, "evaluate", frozenset({6})) == [4, 8, 10]  # epoch ends do not evaluate pretraining
    assert steps(c, "log") == [3, 4, 6, 8, 9, 10]
    assert steps(c, "checkpoint") == [5, 7, 10]
    assert steps(c, "stop") == [7]


def test_finetuning_cadence_scores_every_epoch() -> None:
    c = Cadence(total=12, log_every=5, eval_epochs=True)
    assert steps(c, "evaluate", frozenset({4, 8, 12})) == [4, 8, 12]
    assert steps(c, "log", frozenset({4, 8, 12})) == [4, 5, 8, 10, 12]
    assert steps(c, "checkpoint") == [12] and steps(c, "stop") == []


def test_stopping_at_the_last_step_is_finishing() -> None:
    c = Cadence(total=6, log_every=10, stop_at=6)
    assert steps(c, "stop") == [] and steps(c, "checkpoint") == [6] and steps(c, "log") == [6]


def test_run_options_are_checked() -> None:
    assert RunOptions(Path("run")).stop_at == 0
    with pytest.raises(ConfigError, match="--stop-at must be >= 0"):
        RunOptions(Path("run"), stop_at=-1)


def test_order_digest_tells_orders_apart() -> None:
    assert order_digest([[3, 1], [4]]) == order_digest([[3, 1], [4]])
    assert len({order_digest([[3, 1], [4]]), order_digest([[1, 3], [4]]), order_digest([[3], [1, 4]])}) == 3


# ---------------------------------------------------------------------------------------------- progress


def test_the_default_log_interval_gives_about_50_round_rows_a_run() -> None:
    """The tiny preset logged every 2 steps: 1,662 lines for a 17 s run."""
    from trainer.engine.monitor import log_interval

    assert [log_interval(0, total) for total in (6, 120, 600, 3300, 10_000, 28_140)] == [1, 2, 10, 50, 200, 500]
    assert log_interval(7, 10_000) == 7  # engine.log_every, when set, decides
    for total in range(1, 30_000, 997):
        assert 20 <= -(-total // log_interval(0, total)) <= 100 or total < 50


def test_without_a_terminal_each_row_is_a_line_with_the_share_done_and_the_time_left(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.engine.monitor as monitor

    clock = iter([100.0, 112.0, 130.0])  # started, then two rows 12 s and 30 s later
    monkeypatch.setattr(monitor.time, "monotonic", lambda: next(clock))
    log = monitor.RunLog(tmp_path, total=1500, initial=100, desc="finetune scratch", columns=["loss"])
    for step in (200, 400):
        log.advance()  # no bar without a terminal
        log.log(step, loss=0.5)
    log.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["finetune scratch: step 200/1,500 (13%, 0:12, about 2:36 left) loss=0.5",
                     "finetune scratch: step 400/1,500 (27%, 0:30, about 1:50 left) loss=0.5"]
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,loss", "200,0.5", "400,0.5"]


def test_every_line_is_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the launcher the ranks run `python -u`, where print() writes a line and its newline apart: DeepSpeed's
    runner, printing its KeyboardInterrupt traceback at the same moment, once landed between them, and the
    `interrupted by SIGINT` line was no longer a line of its own (tests/test_interrupt.py)."""
    import io

    import trainer.engine.monitor as monitor

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, s: str) -> int:
            self.calls.append(s)
            return len(s)

    err = Writes()
    monkeypatch.setattr(monitor.sys, "stderr", err)
    log = monitor.RunLog(tmp_path, total=10, initial=0, desc="pretrain clm", columns=["loss"])
    log.log(2, loss=0.5)
    log.print("interrupted by SIGINT after step 2: checkpoint x; continue")
    log.close()
    assert len(err.calls) == 2 and all(c.endswith("\n") and c.count("\n") == 1 for c in err.calls), err.calls
