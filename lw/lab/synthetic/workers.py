"""The synthetic engine's workers, what P's ranks and the decoders share: engine ids, process
setup, fault injection, data planes, KV layouts and the outbox to the coordinator.

A worker is an engine: a P DP rank (:mod:`lw.lab.synthetic.prefill_rank`) or a decoder
(:mod:`lw.lab.synthetic.decoder`). It has one TP worker per tensor-parallel rank, each with its
own KV memory (its KV heads of every block, HND), data plane, side channel and
:class:`~lw.transport.runtime.WorkerLoop`, and talks to the coordinator
(:mod:`lw.lab.synthetic.cluster`) through two one-way pipes: commands in, events out.
An engine is an OS process (Mooncake or NIXL data plane) or a thread of the coordinator's process
(in-process data plane); its TP workers are its loops' threads; the code is the same.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from lw.fsm.messages import KVFormat
from lw.lab.synthetic.config import ClusterConfig
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import FaultInjection
from lw.transport.wire import LayerLayout

_SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address


def d_engine(slot: int) -> str:
    """Engine id of D engine ``slot`` (its own id, so P keeps each engine's layouts apart)."""
    return f"decode-{slot}"


def p_engine(rank: int) -> str:
    """Engine id of P DP rank ``rank`` (one engine per DP rank, like one vLLM engine core)."""
    return f"prefill-dp{rank}"


def barrier_action(flags: Any) -> None:
    """Runs once per barrier generation: publish the stop request so all ranks agree on it."""
    flags[1] = flags[0]


class BarrierAction:
    """Picklable barrier action: publish the stop request (see barrier_action)."""

    def __init__(self, flags: Any) -> None:
        self.flags = flags

    def __call__(self) -> None:
        barrier_action(self.flags)


def ghost_steps(barrier: Any) -> None:
    """Dummy steps for a dead rank: take its turn in every lock-step wait until the barrier is
    aborted at the end (it cannot tell a step's first wait from the others, so it never leaves
    on its own: the live ranks leave at a step start and the ghost is then alone)."""
    while True:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return


def setup_process(name: str, cfg: ClusterConfig) -> None:
    """Worker-process setup: stderr to a log file, die with the coordinator."""
    if cfg.log_dir:
        fd = os.open(os.path.join(cfg.log_dir, f"{name}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s")
    parent = os.getppid()

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:  # coordinator gone: never outlive it
                os._exit(3)

    threading.Thread(target=watchdog, name="lw-watchdog", daemon=True).start()


def faults_for(cfg: ClusterConfig, salt: int) -> FaultInjection | None:
    """The side channel's message faults for ``cfg.fault`` (seeded per worker by ``salt``)."""
    seed = cfg.seed * 1000 + salt
    if cfg.fault == "drop-messages":
        return FaultInjection(drop=0.15, seed=seed)
    if cfg.fault == "duplicate-messages":
        return FaultInjection(duplicate=0.3, seed=seed)
    if cfg.fault == "garbage-messages":
        return FaultInjection(garbage=0.1, seed=seed)
    if cfg.fault == "mix":
        return FaultInjection(drop=0.05, duplicate=0.1, garbage=0.03, seed=seed)
    return None


def data_plane_for(cfg: ClusterConfig, name: str, host: str = "127.0.0.1",
                   writer: bool = False) -> Any:
    """A fresh data plane of the kind ``cfg`` names, for the TP worker ``name`` (``writer``: a
    P worker's, which only writes)."""
    if cfg.data_plane == "mooncake":
        from lw.transport.dataplane import MooncakeDataPlane

        return MooncakeDataPlane(host, timeout_s=cfg.transfer_timeout_s)
    if cfg.data_plane == "nixl":
        from lw.transport.dataplane.nixl import NixlDataPlane

        return NixlDataPlane(host, timeout_s=cfg.transfer_timeout_s, env=ucx_env(host),
                             progress_thread=not writer)
    from lw.transport.dataplane import InProcessDataPlane

    return InProcessDataPlane(f"{name}-{os.getpid()}-{time.monotonic_ns()}",
                              timeout_s=cfg.transfer_timeout_s)


def ucx_env(host: str) -> dict[str, str]:
    """UCX settings of a NIXL worker on ``host``, each unless the user's environment sets it:
    TCP (not shared memory between the cluster's processes), on the interface holding ``host``.

    UCX lists devices by the names in /sys/class/net, which shows the host's namespace even
    to a decoder that entered its own: there it saw only ``lo`` and P refused that address
    ("remote loopback"). Both ends of the decoder's link have one name
    (:class:`~lw.lab.synthetic.netns.Partition`, :class:`~lw.lab.synthetic.netem.Link`), so
    pinning it makes each side use its own end of that link.
    """
    env = {} if "UCX_TLS" in os.environ else {"UCX_TLS": "tcp"}
    dev = interface_of(host)
    if dev and "UCX_NET_DEVICES" not in os.environ:
        env["UCX_NET_DEVICES"] = dev
    return env


def interface_of(ip: str) -> str:
    """The name of the interface holding IPv4 address ``ip`` in this thread's network
    namespace ("" when none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return ""


def layer_layouts(kv: np.ndarray) -> list[LayerLayout]:
    """Each layer's block layout in the KV memory ``kv`` (layers, blocks, bytes per block)."""
    layers, nblk, blen = kv.shape
    base = kv.ctypes.data
    return [LayerLayout(base + i * nblk * blen, blen, blen, nblk) for i in range(layers)]


class TPWorker:
    """One TP worker of an engine: its head format, KV memory (layers, blocks, bytes) and loop."""

    def __init__(self, fmt: KVFormat, kv: np.ndarray, loop: WorkerLoop) -> None:
        self.fmt = fmt
        self.kv = kv
        self.loop = loop


def rss_kib() -> int:
    """This process's resident memory (KiB), from /proc; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def merged_stats(tps: list[TPWorker]) -> dict[str, Any]:
    """The TP workers' loop stats as one engine's: counts summed, percentiles their maximum."""
    out: dict[str, Any] = {"rss_kib": rss_kib()}
    for tp in tps:
        for k, v in tp.loop.stats().items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                if v and not out.get(k):
                    out[k] = v
                else:
                    out.setdefault(k, v)
            elif k.endswith(("_p50_s", "_p99_s", "_max_s")):
                out[k] = max(out.get(k, 0.0), v)
            else:
                out[k] = out.get(k, 0) + v
    return out


def run_reporting(name: str, out: Connection, body: Callable[[Outbox], None]) -> None:
    """Run an engine's ``body`` with an outbox to the coordinator: a crash is reported there as
    an ``error`` event (with its traceback), then raised; the outbox is flushed and closed."""
    outbox = Outbox(out)
    try:
        body(outbox)
    except BaseException:
        outbox.put(("error", name, traceback.format_exc()))
        raise
    finally:
        outbox.close()


class Outbox:
    """Events to the coordinator, sent by a thread so a worker never waits on the pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._t = threading.Thread(target=self._pump, name="lw-outbox", daemon=True)
        self._t.start()

    def put(self, item: tuple) -> None:
        self._q.put(item)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything put so far has been handed to the pipe."""
        done = threading.Event()
        self._q.put(done)
        done.wait(timeout)

    def _pump(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._conn.send(item)
            except (OSError, EOFError, ValueError):
                return

    def close(self, timeout: float = 5.0) -> None:
        self._q.put(None)
        self._t.join(timeout)
