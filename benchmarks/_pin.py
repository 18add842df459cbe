"""Which core each benchmark engine's threads run on: every engine on its worker's core, and
optionally P's threads other than the forward pass on the other core (issue 39, item 4)."""

from __future__ import annotations

import os
from typing import Any

CORES = {"single": 0, "prefill": 0, "decode": 1}
"""The core each engine's worker is bound to (``LocalCluster``: VLLM_CPU_OMP_THREADS_BIND)."""

P_THREADS = ("forward-core", "other-core")
"""Where P's worker threads other than the forward's run: on the forward's core (every thread
of an engine on one core), or on D's core, as a host with spare cores runs transfer threads
off the forward's. Applied to lw and to the peer alike."""


def tasks(pid: int) -> list[int]:
    """Every thread of ``pid`` and of its descendants."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            out += [int(t) for t in os.listdir(f"/proc/{p}/task")]
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def worker_pid(root_pid: int) -> int:
    """The process of an engine whose main thread runs the forward pass (``VLLM::Worker``)."""
    for tid in tasks(root_pid):
        try:
            with open(f"/proc/{tid}/comm") as f:
                if f.read().strip() == "VLLM::Worker" and os.path.exists(f"/proc/{tid}/task/{tid}"):
                    return tid
        except OSError:
            continue
    raise RuntimeError(f"no VLLM::Worker process under pid {root_pid}")


def _bind(tid: int, core: int) -> bool:
    try:
        os.sched_setaffinity(tid, {core})
        return True
    except OSError:
        return False  # a thread that just ended


def pin(run: Any, p_threads: str = "forward-core") -> int:
    """Bind every thread of each engine of ``run`` (a ``serving.Running``: API server,
    EngineCore, worker) to its worker's core; with ``p_threads`` ``other-core``, then every
    thread of P's worker process but its main one (the forward pass) to D's core. Returns how
    many P threads were moved off the forward's core.

    vLLM binds only the worker's OpenMP threads; the API server and the EngineCore float. On 2
    cores that puts D's EngineCore, which steps about a thousand times a second while a request
    waits for remote KV, on P's core: P's prefill ran 3-4x slower (lw and the peer alike).
    Threads start later too (a sender per peer, at first contact): pin again after a warm-up."""
    if p_threads not in P_THREADS:
        raise ValueError(f"p_threads must be one of {', '.join(P_THREADS)}, got {p_threads!r}")
    for name, server in run.servers.items():
        core = CORES.get(name)
        if core is None or server.proc is None:
            continue  # proxies float
        for tid in tasks(server.proc.pid):
            _bind(tid, core)
    p = run.servers.get("prefill")
    if p_threads == "forward-core" or p is None or p.proc is None:
        return 0
    pid = worker_pid(p.proc.pid)
    return sum(_bind(int(t), CORES["decode"]) for t in os.listdir(f"/proc/{pid}/task")
               if int(t) != pid)


def off_core(run: Any, p_threads: str = "forward-core") -> dict[str, list[int]]:
    """Per engine of ``run``, the threads whose affinity is not the one ``pin`` gave them
    (empty lists: every thread still where it was put). vLLM's NIXL worker, for one, moves
    the thread that builds it to the last core of each NUMA node (``rsv_cores_for_kv``)."""
    p = run.servers.get("prefill")
    p_worker = None
    if p_threads == "other-core" and p is not None and p.proc is not None:
        p_worker = worker_pid(p.proc.pid)
    out: dict[str, list[int]] = {}
    for name, server in run.servers.items():
        core = CORES.get(name)
        if core is None or server.proc is None:
            continue
        side = set()
        if name == "prefill" and p_worker is not None:
            side = {int(t) for t in os.listdir(f"/proc/{p_worker}/task")} - {p_worker}
        wrong = []
        for tid in tasks(server.proc.pid):
            want = {CORES["decode"]} if tid in side else {core}
            try:
                if os.sched_getaffinity(tid) != want:
                    wrong.append(tid)
            except OSError:
                continue  # a thread that just ended
        out[name] = wrong
    return out
