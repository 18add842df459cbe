"""benchmarks/_pin.py: with ``other-core``, every thread of P's worker but the forward's moves
to D's core, and the forward's stays; with ``forward-core`` all stay on P's."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from benchmarks._pin import CORES, pin

WORKER = """
import sys, threading
open("/proc/self/comm", "w").write("VLLM::Worker")
for _ in range(3):
    threading.Thread(target=sys.stdin.read, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


@dataclass
class _Server:
    proc: subprocess.Popen[str]


@dataclass
class _Run:
    servers: dict[str, _Server] = field(default_factory=dict)


def _affinity(pid: int) -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
@pytest.mark.parametrize("p_threads", ["forward-core", "other-core"])
def test_p_side_threads_move_to_ds_core_and_the_forward_stays(p_threads: str) -> None:
    # a parent that starts the worker, as vLLM's API server starts its engine's processes
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; p = subprocess.Popen([sys.executable, "
         f"'-c', {WORKER!r}], stdin=sys.stdin); p.wait()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        moved = pin(_Run({"prefill": _Server(parent)}), p_threads)
        worker = int(open(f"/proc/{parent.pid}/task/{parent.pid}/children").read().split()[0])
        aff = _affinity(worker)
        p, d = {CORES["prefill"]}, {CORES["decode"]}
        assert aff.pop(worker) == p  # the forward's thread
        assert len(aff) >= 3
        assert all(a == (d if p_threads == "other-core" else p) for a in aff.values()), aff
        assert moved == (len(aff) if p_threads == "other-core" else 0)
        assert os.sched_getaffinity(parent.pid) == p  # the engine's other processes stay
    finally:
        parent.kill()
        parent.wait()
        assert parent.stdin is not None
        parent.stdin.close()  # the worker shares the pipe: end of input ends it too


def test_an_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="p_threads must be one of"):
        pin(_Run(), "elsewhere")
