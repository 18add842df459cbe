"""lw's threads carry their names at the OS level (``top -H``, per-thread CPU in benchmarks)."""

import sys
import threading

import pytest

from lw.transport.osthread import name_os_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")
@pytest.mark.parametrize(("name", "shown"), [("lw-loop-p0t1", "lw-loop-p0t1"),
                                              ("lw-dp->10.0.0.2:15002", "lw-.0.0.2:15002")])
def test_a_thread_shows_its_name_in_proc(name: str, shown: str) -> None:
    seen: list[str] = []

    def body() -> None:
        name_os_thread()
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    assert seen == [shown]
