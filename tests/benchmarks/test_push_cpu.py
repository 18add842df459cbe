"""benchmarks/push_cpu.py's CPU accounting: a busy side thread is counted, the main one not."""

from __future__ import annotations

import os
import threading
import time

from benchmarks.push_cpu import side_thread_ticks


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_side_threads_are_counted_and_the_main_thread_is_not() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = side_thread_ticks(os.getpid())
    _spin(0.3)  # main thread: not counted
    main_only = side_thread_ticks(os.getpid()) - before
    # an ended thread leaves /proc: measure while the busy one still runs
    busy = threading.Thread(target=_spin, args=(1.0,))
    start = side_thread_ticks(os.getpid())
    busy.start()
    time.sleep(0.6)
    during = side_thread_ticks(os.getpid()) - start
    busy.join()
    assert main_only < 0.1 * hz
    assert during >= 0.2 * hz
