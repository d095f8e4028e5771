"""fork_map: one function over many items on several cores, results in order, for CPU-bound Python that holds
the GIL (rendering chat templates: about 150 conversations a second on one core). The function need not
pickle: forked workers inherit it; items and results are pickled.

Workers end as a pool closes (no signal), take SIGTERM's default (death, whichever of their threads it reaches:
a handler inherited from the parent runs only in a main thread that may be waiting on the pool's lock, and a
worker once hung there) and leave Ctrl-C to the parent."""

import multiprocessing
import os
import signal
from typing import Callable, Iterable, Iterator

_FUNCTION: Callable | None = None  # what the forked workers call: set in the parent just before the fork


def _call(item):
    return _FUNCTION(item)


def _start_worker() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fork_map(function: Callable, items: Iterable, processes: int, chunksize: int = 64) -> Iterator:
    """function(item) for each item, in order, over `processes` forked workers; in this process where that is
    1 or the platform cannot fork."""
    global _FUNCTION
    if processes <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(function, items)
        return
    _FUNCTION = function
    pool, finished = multiprocessing.get_context("fork").Pool(processes, initializer=_start_worker), False
    try:
        yield from pool.imap(_call, items, chunksize)
        finished = True
    finally:
        if finished:
            pool.close()
        else:  # a failure, or a consumer that stopped early
            pool.terminate()
        pool.join()
        _FUNCTION = None
