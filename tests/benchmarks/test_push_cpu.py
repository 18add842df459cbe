"""benchmarks/push_cpu.py's CPU accounting (a busy side thread is counted, the main one not) and
its ratios against the first configuration."""

from __future__ import annotations

import os
import threading
import time

from benchmarks.push_cpu import ratio_lines, side_thread_ticks


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_side_threads_are_counted_and_the_main_thread_is_not() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = side_thread_ticks(os.getpid())
    _spin(0.3)  # main thread: 0.3 s of CPU, not counted
    main_only = side_thread_ticks(os.getpid()) - before
    # an ended thread leaves /proc: measure while the busy one still runs (until told to stop).
    # Poll rather than sleep a fixed time: on a loaded machine it gets the CPU later, not never.
    stop = threading.Event()

    def busy_until_stopped() -> None:
        while not stop.is_set():
            _spin(0.01)

    busy = threading.Thread(target=busy_until_stopped)
    start = side_thread_ticks(os.getpid())
    busy.start()
    try:
        deadline = time.monotonic() + 60
        while (during := side_thread_ticks(os.getpid()) - start) < 0.2 * hz:
            assert time.monotonic() < deadline, f"a busy side thread: {during} ticks in 60 s"
            time.sleep(0.05)
    finally:
        stop.set()
        busy.join()
    assert main_only < 0.1 * hz


def test_ratios_against_a_single_server_skip_its_zero_side_cpu() -> None:
    single = {"side_cpu_ms": 0.0, "p_prefill_ms": 550.0}
    results = {"single": [single, single, None],
               "auto": [{"side_cpu_ms": 24.0, "p_prefill_ms": 556.0},
                        {"side_cpu_ms": 25.0, "p_prefill_ms": 561.0}, None]}
    lines = ratio_lines(results, ["single", "auto"], "single")
    # no CPU ratio (nothing to divide by), the prefill's over the two repeats both ran
    assert lines == ["p_prefill_ms_ratio_vs_single: 1.02  (auto; 1.01-1.02 over 2 repeat(s))"]


def test_a_side_threads_wake_ups_are_counted_under_its_name() -> None:
    """A named side thread that sleeps and wakes 20 times shows >= 20 voluntary switches under
    its name; the main thread's preemptions and waits are keyed apart."""
    from benchmarks.push_cpu import thread_switches

    go, done = threading.Event(), threading.Event()

    def napper() -> None:
        go.wait()
        for _ in range(20):
            time.sleep(0.001)
        done.set()
        time.sleep(5)  # stays alive (in /proc) until counted

    t = threading.Thread(target=napper, name="lw-test-napper", daemon=True)
    t.start()
    # Python 3.11 does not name OS threads: name it as lw's name_os_thread would
    with open(f"/proc/{os.getpid()}/task/{t.native_id}/comm", "w") as f:
        f.write("lw-test-napper")
    before = thread_switches(os.getpid())
    go.set()
    assert done.wait(30)
    after = thread_switches(os.getpid())
    assert after["lw-test-napper"] - before.get("lw-test-napper", 0) >= 20
    assert "main" in after and "main waits" in after
