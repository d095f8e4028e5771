"""common.parallel.fork_map: results in order, and workers that neither run the parent's signal handlers nor
outlive the pool (a worker once hung in the pool's lock at the end of tokenizing, its SIGTERM handler
inherited from train.py)."""

import os
import signal

import pytest

from common.parallel import fork_map


def worker_state(item: int) -> tuple[int, int, object, object]:
    return item * item, os.getpid(), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


@pytest.fixture
def parent_handler(tmp_path):
    """A SIGTERM handler like train.py's, leaving a file where it runs."""
    mark = tmp_path / "handled"
    previous = signal.signal(signal.SIGTERM, lambda *_: (mark.write_text(str(os.getpid())), os._exit(3)))
    yield mark
    signal.signal(signal.SIGTERM, previous)


def test_workers_finish_without_a_signal_and_take_its_default(parent_handler):
    out = list(fork_map(worker_state, range(500), processes=2, chunksize=8))
    assert [square for square, *_ in out] == [i * i for i in range(500)]
    assert {pid for _, pid, _, _ in out} - {os.getpid()}  # forked workers did the work
    assert {(term, intr) for _, _, term, intr in out} == {(signal.SIG_DFL, signal.SIG_IGN)}
    assert not parent_handler.exists()  # no worker was sent SIGTERM, nor ran the parent's handler


def test_a_consumer_that_stops_early_ends_the_workers(parent_handler):
    results = fork_map(worker_state, range(10_000), processes=2, chunksize=8)
    first = next(results)
    results.close()  # the pool is terminated and joined here
    assert first[0] == 0 and not parent_handler.exists()
