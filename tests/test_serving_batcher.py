"""serving/model/batcher.py around the real predictor: merging, limits, grouping, bounded queue, dropping, order.

`HeldRuns` (tests/serving_fixtures.py) wraps the real `Predictor.infer` to record each batch and, while holding, to
keep the worker inside a run so that the queue fills deterministically.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from serving_fixtures import HeldRuns, reviews, wait_until

from serving.errors import Cancelled, DeadlineExpired, NotReady, Overloaded
from serving.model.batcher import Batcher
from serving.model.predictor import Predictor


def _hold_worker(batcher: Batcher, held: HeldRuns, predictor: Predictor):
    """Submit one request and wait until the worker is inside its run (the queue is then ours)."""
    blocker = batcher.submit([predictor.tokenizer.encode("bloquant").ids])
    assert held.wait_entered(5)
    return blocker


def test_concurrent_requests_share_runs_and_each_gets_its_own_answer(predictor: Predictor, data_dir: Path) -> None:
    """24 threads submit at once while the worker is held in a run, so all of them queue whatever the machine's
    load (thread start-up on a busy CI machine is not ours to time); then they share few runs."""
    texts = reviews(data_dir, 24)
    alone = [predictor.predict([t])[0].probabilities for t in texts]
    batcher = Batcher(predictor.infer)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    barrier, results = threading.Barrier(len(texts)), [None] * len(texts)

    def call(i: int) -> None:
        ids = predictor.tokenizer.encode(texts[i]).ids
        barrier.wait()
        results[i] = batcher.submit([ids]).result(30)[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    wait_until(lambda: batcher.queued == len(texts))
    held.release()
    for t in threads:
        t.join()
    blocker.result(10)
    batcher.close()
    runs = held.batches[1:]
    assert sum(map(len, runs)) == len(texts) and len(runs) < len(texts) / 2, runs
    for got, expected in zip(results, alone, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_worker_waits_for_as_much_company_as_the_last_batch_had(predictor: Predictor) -> None:
    """After a batch of 3, a lone text waits (up to max_queue_delay_s) for 2 more, and the 3 run together."""
    batcher = Batcher(predictor.infer, max_queue_delay_s=10.0)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    ids = predictor.tokenizer.encode("Trois par trois.").ids
    first = [batcher.submit([ids]) for _ in range(3)]
    held.release()
    for f in [blocker, *first]:
        f.result(10)
    assert held.batches[1:] == [[len(ids)] * 3]
    lone = batcher.submit([ids])
    wait_until(lambda: batcher.waiting_for_company == 1, what="the worker waiting for company")
    assert not lone.done() and batcher.queued == 1  # 10 s window: it waits instead of running alone
    company = [batcher.submit([ids]) for _ in range(2)]
    for f in [lone, *company]:
        f.result(10)
    batcher.close()
    assert held.batches[2:] == [[len(ids)] * 3]


@pytest.mark.parametrize("workers", [1, 2])
def test_batches_respect_size_budget_and_padding_and_keep_request_order(predictor: Predictor, data_dir: Path,
                                                                        workers: int) -> None:
    texts = reviews(data_dir, 13) + [f"court {i}" for i in range(13)] + ["moyen " * i for i in range(1, 14)]
    encoded = predictor.encode(texts)
    batcher = Batcher(predictor.infer, max_batch_size=5, max_batch_tokens=4 * predictor.max_len, max_padding=0.2,
                      workers=workers)
    held = HeldRuns(batcher, hold=False)
    got = batcher.submit([e.ids for e in encoded]).result(10)
    batcher.close()
    assert all(len(b) <= 5 and len(b) * max(b) <= 4 * predictor.max_len for b in held.batches)
    assert all(len(b) * max(b) <= 1.2 * sum(b) for b in held.batches if len(b) > 1)
    assert max(len(b) for b in held.batches) > 1
    assert sum(len(b) for b in held.batches) == len(texts)
    expected = np.stack([p.probabilities for p in predictor.predict(texts)])
    np.testing.assert_allclose(got, expected, atol=1e-5)  # row i is text i, whatever batch it ran in


def test_similar_lengths_are_grouped(predictor: Predictor) -> None:
    batcher = Batcher(predictor.infer, max_batch_size=8)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    short = predictor.tokenizer.encode("Bien.").ids
    long = predictor.tokenizer.encode("Un roman très long, " * 20).ids
    futures = [batcher.submit([short if i % 2 == 0 else long]) for i in range(16)]  # interleaved arrivals
    held.release()
    for f in [blocker, *futures]:
        f.result(10)
    batcher.close()
    assert sorted(map(sorted, held.batches[1:])) == [[len(short)] * 8, [len(long)] * 8]


def test_full_queue_refuses_at_once_and_accepted_requests_complete(predictor: Predictor) -> None:
    batcher = Batcher(predictor.infer, max_queue=4)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    ids = predictor.tokenizer.encode("Un livre agréable.").ids
    accepted = [batcher.submit([ids, ids]), batcher.submit([ids, ids])]
    start = time.perf_counter()
    with pytest.raises(Overloaded, match="max_queue 4"):
        batcher.submit([ids])
    assert time.perf_counter() - start < 1.0  # refused without waiting for the held worker (it never moves)
    held.release()
    expected = predictor.predict(["Un livre agréable."])[0].probabilities
    for f in accepted:
        np.testing.assert_allclose(f.result(10), [expected, expected], atol=1e-5)
    blocker.result(10)
    assert batcher.submit([ids]).result(10).shape == (1, len(predictor.label_names))  # room again
    batcher.close()


def test_expired_and_cancelled_requests_are_dropped_before_compute(predictor: Predictor) -> None:
    batcher = Batcher(predictor.infer)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    t = predictor.tokenizer
    deadline = time.monotonic() + 0.02
    expired = batcher.submit([t.encode("a" * 30).ids], deadline=deadline)
    cancelled = batcher.submit([t.encode("b" * 31).ids], cancelled=lambda: True)
    live = batcher.submit([t.encode("c").ids])
    wait_until(lambda: time.monotonic() >= deadline, what="the deadline passed while the worker is held")
    held.release()
    with pytest.raises(DeadlineExpired):
        expired.result(10)
    with pytest.raises(Cancelled):
        cancelled.result(10)
    live.result(10)
    blocker.result(10)
    batcher.close()
    computed = [n for b in held.batches for n in b]
    assert len(t.encode("c").ids) in computed
    assert len(t.encode("a" * 30).ids) not in computed and len(t.encode("b" * 31).ids) not in computed


def test_a_failed_run_fails_only_its_own_requests(predictor: Predictor) -> None:
    calls = []

    def flaky(rows: Sequence[np.ndarray]) -> np.ndarray:
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("onnxruntime failed")
        return predictor.infer(rows)

    batcher = Batcher(flaky)
    ids = predictor.tokenizer.encode("Bof.").ids
    with pytest.raises(RuntimeError, match="onnxruntime failed"):
        batcher.submit([ids]).result(10)
    assert batcher.submit([ids]).result(10).shape == (1, len(predictor.label_names))
    batcher.close()


def test_a_lone_blocking_caller_runs_its_batch_itself_and_the_slots_still_bound_the_runs(predictor: Predictor) -> None:
    """With nothing queued, every slot free and a previous batch of one, a caller that blocks on its answer
    (`inline`, ServingCore.classify's) computes its batch in its own thread; a caller that does not (an event loop's
    `submit`) hands it to a worker. While an inline caller holds the one slot, the worker runs nothing beside it."""
    ids = predictor.tokenizer.encode("Seul, sans attente.").ids
    threads: list[str] = []

    def infer(rows: Sequence[np.ndarray]) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return predictor.infer(rows)

    batcher = Batcher(infer, workers=1)
    assert batcher.submit([ids], inline=True).done()  # answered before submit returned: computed by this thread
    batcher.submit([ids]).result(10)
    assert threads == [threading.current_thread().name, "batcher-0"], threads

    held = HeldRuns(batcher)
    inline = threading.Thread(target=lambda: batcher.submit([ids], inline=True), name="inline-caller")
    inline.start()
    assert held.wait_entered(10)  # the inline caller is inside its run, holding the one slot
    queued = batcher.submit([ids])
    time.sleep(0.3)  # room for a worker that ignored the slot to start a second run (it must not)
    assert len(held.batches) == 1 and not queued.done() and batcher.queued == 1
    held.stop_holding()
    held.release()
    inline.join(10)
    queued.result(10)
    batcher.close()
    assert threads[2:] == ["inline-caller", "batcher-0"], threads


def test_a_per_row_graphs_blocking_caller_runs_its_rows_itself_whenever_a_slot_is_free(predictor: Predictor) -> None:
    """A graph that runs one text per run (int8 on the CPU) gains nothing from company: a blocking caller that finds a
    slot free computes its rows itself even after a batch of several, where a batching graph's caller hands them to
    a worker that waits for the company the last batch had."""
    ids = predictor.tokenizer.encode("Une ligne par run.").ids

    def runs_of_a_lone_caller_after_a_batch_of_three(per_row: bool) -> list[str]:
        threads: list[str] = []

        def infer(rows: Sequence[np.ndarray]) -> np.ndarray:
            threads.append(threading.current_thread().name)
            return predictor.infer(rows)

        batcher = Batcher(infer, workers=1, per_row=per_row)
        held = HeldRuns(batcher)
        first = batcher.submit([ids, ids, ids])  # a batch of three, computed by the worker
        assert held.wait_entered(10)
        held.stop_holding()
        held.release()
        first.result(10)
        caller = threading.Thread(target=lambda: batcher.submit([ids], inline=True).result(10), name="inline-caller")
        caller.start()
        caller.join(10)
        batcher.close()
        return threads

    assert runs_of_a_lone_caller_after_a_batch_of_three(per_row=True) == ["batcher-0"] * 3 + ["inline-caller"]
    assert runs_of_a_lone_caller_after_a_batch_of_three(per_row=False) == ["batcher-0", "batcher-0"]


def test_batching_off_runs_each_request_alone(predictor: Predictor) -> None:
    batcher = Batcher(predictor.infer, enabled=False, max_queue=8)
    ids = predictor.tokenizer.encode("Sans batching.").ids
    runs = predictor.runs
    for _ in range(3):
        assert batcher.submit([ids, ids]).result(10).shape == (2, len(predictor.label_names))
    assert predictor.runs - runs == 3
    with pytest.raises(DeadlineExpired):
        batcher.submit([ids], deadline=time.monotonic() - 1).result(10)
    assert predictor.runs - runs == 3  # the expired one never ran
    batcher.close()


def test_close_drains_then_refuses(predictor: Predictor) -> None:
    batcher = Batcher(predictor.infer)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    queued = batcher.submit([predictor.tokenizer.encode("en attente").ids])
    closer = threading.Thread(target=batcher.close)
    closer.start()
    wait_until(lambda: batcher.closing)
    with pytest.raises(NotReady):
        batcher.submit([predictor.tokenizer.encode("trop tard").ids])
    held.release()
    closer.join(10)
    assert blocker.done() and queued.result(0).shape == (1, len(predictor.label_names))


def test_requests_queued_while_every_slot_is_busy_wake_no_worker_and_the_worker_goes_back_for_them(
        predictor: Predictor) -> None:
    """A wake that finds no free slot puts the worker back to sleep: two context switches a queued call for nothing
    (bench/workers_bench.py --switches). The worker that frees the slot takes the queued texts itself."""
    batcher = Batcher(predictor.infer, workers=1, max_queue_delay_s=0.0)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    wakes = []
    real_notify = batcher._cond.notify
    batcher._cond.notify = lambda n=1: (wakes.append(n), real_notify(n))  # type: ignore[method-assign]
    rows = [predictor.tokenizer.encode(f"texte {i}").ids for i in range(5)]
    queued = [batcher.submit([r]) for r in rows]
    assert wakes == []  # the one slot is the held run's
    held.stop_holding()
    held.release()
    assert blocker.result(10).shape == (1, len(predictor.label_names))
    for r, f in zip(rows, queued, strict=True):
        np.testing.assert_allclose(f.result(10)[0], predictor.infer([r])[0], rtol=1e-5, atol=1e-6)
    assert wakes == []  # nothing but the worker itself went back for them
    batcher.close(5)


def test_a_worker_that_a_bug_ends_wakes_another_for_the_texts_left_queued(predictor: Predictor) -> None:
    """Not onnxruntime's error (a run's error fails its requests): a bug out of a worker's batch ends its thread, and
    on its way out it wakes another worker for the texts still queued (a worker that returns to its loop takes them
    itself, and wakes no one)."""
    batcher = Batcher(predictor.infer, workers=1, max_queue_delay_s=0.0)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    queued = batcher.submit([predictor.tokenizer.encode("en attente").ids])
    wakes = []
    real_notify, real_take = batcher._cond.notify, batcher._take
    batcher._cond.notify = lambda n=1: (wakes.append(n), real_notify(n))  # type: ignore[method-assign]

    def broken_take(now: float) -> list:
        raise SystemExit("a bug in the batcher")  # not an Exception: nothing on the way catches it

    with batcher._lock:
        batcher._busy += 1  # the slot of the worker this thread stands for
    batcher._take = broken_take  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        batcher._run_batch(worker=True)
    batcher._take = real_take  # type: ignore[method-assign]
    assert wakes == [1] and batcher.queued == 1
    held.stop_holding()
    held.release()
    assert blocker.result(10).shape == queued.result(10).shape == (1, len(predictor.label_names))
    batcher.close(5)


def test_a_per_row_graphs_batch_answers_each_request_once_its_own_rows_have_run(predictor: Predictor) -> None:
    """One run a row anyway: the first request of a batch need not wait for the last one's run."""
    ids = [predictor.tokenizer.encode(f"Réponse numéro {i}.").ids for i in range(3)]
    queued: list = []
    done_at_each_run: list[int] = []

    def infer(rows: Sequence[np.ndarray]) -> np.ndarray:
        done_at_each_run.append(sum(f.done() for f in queued))
        return predictor.infer(rows)

    batcher = Batcher(infer, workers=1, per_row=True, max_queue_delay_s=0.0)
    held = HeldRuns(batcher)
    blocker = _hold_worker(batcher, held, predictor)
    queued += [batcher.submit([r]) for r in ids]  # one batch of three, taken when the held run ends
    held.stop_holding()
    held.release()
    blocker.result(10)
    for r, f in zip(ids, queued, strict=True):
        np.testing.assert_allclose(f.result(10)[0], predictor.infer([r])[0], rtol=1e-5, atol=1e-6)
    batcher.close(5)
    assert done_at_each_run[-3:] == [0, 1, 2], done_at_each_run
