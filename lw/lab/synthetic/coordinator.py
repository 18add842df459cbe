"""The synthetic cluster's coordinator: the workers it started (P DP ranks and decoders, as
processes or threads), the events they send, the proxy's routing of prefills to live P ranks,
the requests fed and aborted, each request's outcome, and the stats polled from every worker.

One :class:`Coordinator` per run; :func:`lw.lab.synthetic.cluster.run_cluster` drives it (and
stops, collects and reaps its workers). Its fault injection is :mod:`lw.lab.synthetic.faults`'.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from lw.lab.synthetic.config import DECODER_RESTARTS, PROCESS_PLANES, ClusterConfig
from lw.lab.synthetic.decoder import decode_main
from lw.lab.synthetic.faults import FaultInjector
from lw.lab.synthetic.netem import Link
from lw.lab.synthetic.netns import Partition
from lw.lab.synthetic.observe import status_table
from lw.lab.synthetic.prefill_rank import prefill_main
from lw.lab.synthetic.result import ClusterResult, short_reason
from lw.lab.synthetic.router import Lost, Router
from lw.lab.synthetic.workers import BarrierAction, ghost_steps, p_engine

__all__ = ["CORRUPT_DETAILS", "Coordinator", "ProgressFn", "Worker"]

ProgressFn = Callable[["ClusterResult"], None]
CORRUPT_DETAILS = 5  # corrupt requests whose wrong block is described in the result
_DEBUG = bool(os.environ.get("LW_DEBUG"))


@dataclass
class Worker:
    role: str  # "p" or "d"
    index: int  # rank, or decoder generation
    cmd: Connection  # coordinator -> worker
    events: Connection  # worker -> coordinator
    proc: Any  # multiprocessing Process or threading.Thread
    alive: bool = True
    ready: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    frozen: bool = False
    slot: int = 0  # which D engine (several decoders); 0 for P ranks
    key: str = ""  # short name in reports: p<rank>, d<generation>, d<slot>g<generation>

    @property
    def pid(self) -> int | None:
        return getattr(self.proc, "pid", None)


class Coordinator(FaultInjector):
    """Coordinator state and the proxy's routing; one instance per run."""

    def __init__(self, cfg: ClusterConfig, progress: ProgressFn | None,
                 on_status: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        self.as_process = cfg.data_plane in PROCESS_PLANES
        self.ctx = mp.get_context("spawn") if self.as_process else None
        self.res = ClusterResult(cfg)
        self.own_log_dir = cfg.log_dir is None
        if cfg.log_dir is None:
            cfg.log_dir = tempfile.mkdtemp(prefix="lw-synthetic-")
        os.makedirs(cfg.log_dir, exist_ok=True)
        self.res.log_dir = cfg.log_dir
        # one barrier for every lock-step wait; flags[0] = stop requested, flags[1] = stop now
        if self.as_process:
            assert self.ctx is not None
            self.flags = self.ctx.RawArray("i", 2)
            self.barrier = self.ctx.Barrier(cfg.prefill_dp, action=BarrierAction(self.flags))
        else:
            self.flags = [0, 0]
            self.barrier = threading.Barrier(cfg.prefill_dp, action=BarrierAction(self.flags))
        self.ranks: list[Worker] = []
        # per D engine: its current incarnation, ports (kept across restarts), generation
        self.decoders: list[Worker | None] = [None] * cfg.decoders
        self.d_all: list[Worker] = []  # every D incarnation started (all are reaped)
        self.d_ports: list[list[int]] = [[0] * cfg.decode_tp for _ in range(cfg.decoders)]
        self.d_generation = [0] * cfg.decoders
        self.req_ids = [f"req-{i}" for i in range(cfg.requests)]
        self.router = Router(self.req_ids, cfg.decoders, cfg.window or cfg.d_capacity)
        self.outcome: dict[str, str] = {}  # client request -> outcome
        self.assigned: dict[str, int] = {}  # attempt -> P rank (until SendFinished)
        self.ghosts: list[threading.Thread] = []
        self.fault_fired = False
        self.fault_at = 0.0
        self.status_shown = False
        self.on_status = on_status
        self.thaw_at: float | None = None
        self.net: Partition | None = None  # the link to the decoder (partition faults)
        self.link: Link | None = None  # the lossy or slow link to the decoder (link faults)
        self.heal_at: float | None = None
        self.rng = random.Random(cfg.seed)
        self.aborts_due: list[tuple[float, str]] = []
        # attempts D had prefilled again (failover) -> whether the old epoch was fenced first
        self.reprefilled: dict[str, bool] = {}
        self.gone: set[str] = set()  # clients that sent an abort: never moved, not counted in K
        self.t_first = 0.0
        self.t_last = 0.0

    # ------------------------------------------------------------------- workers
    def _spawn(self, target: Callable[..., None], make_args: Callable[..., tuple],
               name: str) -> tuple[Any, Connection, Connection]:
        """Start a worker as a process (Mooncake, NIXL) or a thread (in-process data plane)."""
        ctx: Any = self.ctx if self.as_process else mp
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        ev_r, ev_w = ctx.Pipe(duplex=False)
        args = make_args(cmd_r, ev_w, self.as_process)
        if self.as_process:
            proc = ctx.Process(target=target, args=args, name=name, daemon=True)
            proc.start()
            cmd_r.close()  # the child has its own copies
            ev_w.close()
        else:
            proc = threading.Thread(target=target, args=args, name=name, daemon=True)
            proc.start()
        return proc, cmd_w, ev_r

    def start_rank(self, rank: int) -> None:
        cfg, barrier, flags, inc = self.cfg, self.barrier, self.flags, time.time_ns()
        proc, cmd, ev = self._spawn(
            prefill_main,
            lambda c, e, p: (cfg, rank, c, e, barrier, flags, inc, p),
            f"lw-prefill-dp{rank}")
        self.ranks.append(Worker("p", rank, cmd, ev, proc, key=f"p{rank}"))

    def start_decoder(self, slot: int = 0) -> None:
        self.d_generation[slot] += 1
        cfg, ports, inc = self.cfg, list(self.d_ports[slot]), time.time_ns()
        gen = self.d_generation[slot]
        proc, cmd, ev = self._spawn(
            decode_main,
            lambda c, e, p: (cfg, c, e, ports, inc, gen, p, slot),
            f"lw-decode-gen{gen}" if slot == 0 else f"lw-decode{slot}-gen{gen}")
        w = Worker("d", gen, cmd, ev, proc, slot=slot,
                    key=f"d{gen}" if cfg.decoders == 1 else f"d{slot}g{gen}")
        self.decoders[slot] = w
        self.d_all.append(w)
        self.res.decoder_generations = max(self.d_generation)

    @property
    def decoder(self) -> Worker | None:
        """The first D engine: the one single-decoder faults act on."""
        return self.decoders[0]

    def live_decoders(self) -> list[Worker]:
        return [d for d in self.decoders if d is not None and d.alive]

    def workers(self) -> list[Worker]:
        return [w for w in self.ranks if w.alive] + self.live_decoders()

    def send(self, w: Worker, item: tuple) -> None:
        if not w.alive or w.frozen:
            return
        try:
            w.cmd.send(item)
        except (OSError, EOFError, ValueError):
            self.lost(w, "command pipe closed")

    # ------------------------------------------------------------------- events
    def pump(self, timeout: float) -> None:
        """Handle worker events and deaths for up to ``timeout`` seconds (one wait)."""
        conns: dict[Any, Worker] = {}
        for w in self.workers():
            conns[w.events] = w
            if self.as_process:
                conns[w.proc.sentinel] = w
        if not conns:
            time.sleep(timeout)
            return
        for obj in wait(list(conns), timeout):
            w = conns[obj]
            if obj is w.events:
                self._drain(w)
            elif w.alive:
                self._drain(w)
                if w.final is not None:
                    w.alive = False  # exited normally after its final report
                else:
                    self.lost(w, f"process exited with {w.proc.exitcode}")

    def _drain(self, w: Worker) -> None:
        try:
            while w.alive and w.events.poll():
                self.on_event(w, w.events.recv())
        except (EOFError, OSError, ValueError):
            if self.as_process:
                return  # the sentinel reports the death
            if w.final is not None:
                w.alive = False  # a worker thread that finished normally
            else:
                self.lost(w, "event pipe closed")
        except Exception as exc:  # a half-written event from a killed worker
            self.res.counters["torn_events"] += 1
            del exc

    def on_event(self, w: Worker, ev: tuple) -> None:
        kind = ev[0]
        if _DEBUG and kind not in ("stats", "final"):
            print(f"[lw] {time.monotonic():.3f} {w.role}{w.index}: {ev}", flush=True)
        if kind == "ready":
            w.ready = ev[3]
            if w.role == "d":
                self.d_ports[w.slot] = list(ev[3]["ports"])
        elif kind == "start_prefill":
            _, rid, d_addrs, blocks = ev  # one side-channel address per D TP worker
            client = self.router.client_of(rid)
            if client is None:
                return  # an attempt that already ended (its decoder died meanwhile)
            if self.kill_at_prefill(rid):
                return  # its decoder is dead: the request moves with the others it held
            if self.cfg.abort_rate and self.rng.random() < self.cfg.abort_rate:
                # the client goes away at some moment of the transfer (or just before it)
                self.aborts_due.append((time.monotonic() + self.rng.uniform(0, 0.01), client))
            self.route(rid, d_addrs, blocks, 0, ())
        elif kind == "reprefill":  # D lost the request's P and keeps its blocks: another P
            _, rid, epoch, avoid, d_addrs, blocks, fenced = ev
            if self.router.client_of(rid) is None:
                return
            self.res.reprefills += 1
            self.res.reprefills_fenced += fenced
            self.reprefilled[rid] = fenced
            self.route(rid, d_addrs, blocks, epoch, avoid)
        elif kind == "p_finished":
            _, _rank, rid, ok, reason = ev
            self.assigned.pop(rid, None)
            if not ok:
                self.res.reasons[f"P: {short_reason(reason)}"] += 1
                self.detected()
        elif kind == "d_result":
            _, rid, outcome, reason, latency = ev
            client = self.router.ended(rid)
            if client is None:
                self.res.counters["stale_results"] += 1
                return
            if rid in self.reprefilled and self.fault_at:  # from the kill to its outcome
                took = time.monotonic() - self.fault_at
                fenced = self.reprefilled[rid]
                res = self.res
                if fenced:
                    res.failover_fenced_s = max(res.failover_fenced_s, took)
                else:
                    res.failover_s = max(res.failover_s, took)
            self.record(client, outcome, reason, latency)
        elif kind == "token":
            self.router.streamed(ev[1], ev[2])
            self.res.tokens += 1
        elif kind == "stats":
            w.stats = ev[3]
        elif kind == "final":
            w.final = ev[3]
            w.stats = ev[3]
        elif kind == "freezing":
            w.frozen = True
            self.thaw_at = time.monotonic() + self.cfg.freeze_s
        elif kind == "error":
            self.res.errors.append(f"{ev[1]}: {ev[2].strip().splitlines()[-1]}")

    def route(self, rid: str, d_addrs: tuple[str, ...], blocks: tuple[int, ...], epoch: int,
              avoid: tuple[str, ...]) -> None:
        """Send claim epoch ``epoch`` of a prefill to the least loaded live P rank not in
        ``avoid``, and tell its decoder where it went (so D watches that P before it claims)."""
        live = [r for r in self.ranks if r.alive and p_engine(r.index) not in avoid]
        if not live:
            return  # nobody to prefill: D's deadline fails the request
        rank = min(live, key=lambda r: (sum(1 for v in self.assigned.values()
                                            if v == r.index), r.index))
        self.assigned[rid] = rank.index
        self.send(rank, ("prefill", rid, d_addrs, blocks, epoch))
        slot = self.router.slot_of(rid)
        d = self.decoders[slot] if slot is not None else None
        if d is not None and d.alive:
            self.send(d, ("routed", rid, p_engine(rank.index), rank.ready.get("addr", ""),
                          epoch))

    def record(self, rid: str, outcome: str, reason: str, latency: float | None) -> None:
        if rid in self.outcome:
            self.res.double_reports += 1
            return
        self.outcome[rid] = outcome
        self.t_last = time.monotonic()
        if latency is not None:
            self.res.max_outcome_s = max(self.res.max_outcome_s, latency)
        if outcome == "done":
            self.res.done += 1
            if self.router.tries[rid] > 1:  # moved off a dead decoder, verified by another
                self.res.counters["failovers_done"] += 1
            if latency is not None:
                self.res.latencies_s.append(latency)
        elif outcome == "corrupt":
            self.res.corrupt += 1
            what, _, detail = reason.partition("; ")
            self.res.reasons[f"corrupt: {what}"] += 1
            if detail and len(self.res.corrupt_details) < CORRUPT_DETAILS:
                self.res.corrupt_details.append(detail)
        else:
            self.res.failed += 1
            self.res.client_gone += rid in self.gone
            self.res.reasons[f"D: {short_reason(reason)}"] += 1
            self.detected()
        if self.progress is not None:
            self.progress(self.res)

    def lost(self, w: Worker, why: str) -> None:
        if not w.alive:
            return
        if _DEBUG:
            print(f"[lw] {time.monotonic():.3f} lost {w.role}{w.index}: {why}", flush=True)
        w.alive = False
        if w.role == "d":
            if w is self.decoders[w.slot]:
                self.decoder_lost(w, why)
        else:
            self.res.dead_ranks.append(w.index)
            for rid, rank in list(self.assigned.items()):
                if rank == w.index:
                    del self.assigned[rid]
            # A dead rank's place in the lock step is taken by a dummy stepper.
            ghost = threading.Thread(target=ghost_steps, args=(self.barrier,),
                                     name=f"lw-ghost-dp{w.index}", daemon=True)
            ghost.start()
            self.ghosts.append(ghost)

    def decoder_lost(self, w: Worker, why: str) -> None:
        """Everything the dead D engine held is lost: account for each request once, here. A
        request that streamed no token moves to a live D (a fresh D-first round; its P side is
        cancelled, as the real proxy closes the old prefill); one that did fails."""
        cfg = self.cfg
        moved: list[Lost] = []
        for lost in self.router.decoder_lost(w.slot):
            if lost.client in self.gone:  # nobody to answer: nothing to move or count
                self.record(lost.client, "failed", f"decoder died ({why})", None)
            elif self.router.may_move(lost, max_tries=cfg.decoders):
                moved.append(lost)
                rank = self.assigned.get(lost.attempt)
                if rank is not None:
                    self.send(self.ranks[rank], ("cancel", lost.attempt))
            elif lost.tokens:
                self.res.failed_after_first_token += 1
                self.record(lost.client, "failed", f"decoder died after {lost.tokens} tokens "
                            f"were streamed ({why})", None)
            else:
                self.record(lost.client, "failed", f"decoder died ({why})", None)
        for lost in reversed(moved):  # ahead of the queue, in the order they came
            self.router.retry(lost.client)
        if moved:
            self.res.failovers += len(moved)
            self.detected()
        if (cfg.decoders == 1 and cfg.fault in DECODER_RESTARTS
                and self.d_generation[w.slot] < 2):
            self.start_decoder(w.slot)
            self.router.revive(w.slot)

    # ------------------------------------------------------------------- driving
    def feed(self) -> None:
        """Send waiting requests to the D engines the router picks, while they have room."""
        router = self.router
        while router.pending:
            # recomputed each time: a send below may find a decoder dead (lost() moved or
            # accounted its requests; the rest wait for a live one)
            ready = [d.slot for d in self.live_decoders() if d.ready and not d.frozen]
            slot = router.pick(ready)
            if slot is None:
                return
            rid = router.start(router.pending.popleft(), slot)
            if not self.t_first:
                self.t_first = time.monotonic()
            d = self.decoders[slot]
            assert d is not None
            self.send(d, ("request", rid))

    def fire_aborts(self) -> None:
        """Send the client aborts that are due to the decoder."""
        now = time.monotonic()
        due = [x for x in self.aborts_due if x[0] <= now]
        if not due:
            return
        self.aborts_due = [x for x in self.aborts_due if x[0] > now]
        for _t, client in due:
            if client in self.outcome:
                continue
            self.res.aborts += 1
            self.gone.add(client)
            rid = self.router.current.get(client)
            slot = self.router.slot_of(rid) if rid is not None else None
            d = self.decoders[slot] if slot is not None else None
            if d is not None:
                self.send(d, ("abort", rid))
            elif client in self.router.pending:  # moved off a dead decoder, not yet resent
                self.router.pending.remove(client)
                self.record(client, "failed", "client went away before a decoder had it",
                            None)

    def record_rss(self, point: int) -> None:
        """Resident memory of every worker (from its last stats) at ``point`` 0 (start), 1
        (warm: 10 % of the requests ended) or 2 (end)."""
        for w in self.ranks + self.d_all:
            s = w.final or w.stats
            if s and s.get("rss_kib") and (w.alive or w.final is not None):
                key = w.key
                cur = list(self.res.rss_kib.get(key, (0, 0, 0)))
                cur[point] = s["rss_kib"]
                self.res.rss_kib[key] = (cur[0], cur[1], cur[2])

    def detected(self) -> None:
        """A request failed: the first failure after an injected fault is its detection."""
        if self.fault_at and not self.res.detect_s:
            self.res.detect_s = time.monotonic() - self.fault_at

    def addrs(self) -> list[str]:
        """Side-channel addresses of every live worker (P ranks' TP workers, then D's)."""
        return [a for w in self.workers() for a in w.ready.get("addrs", ())]

    def maybe_show_status(self) -> None:
        """Once: the lw status table, while the fault is active (or midway without a fault)."""
        if not self.cfg.status or self.status_shown or self.on_status is None:
            return
        now = time.monotonic()
        if self.cfg.fault == "none" or not self.fault_at:
            due = self.cfg.fault == "none" and self.router.started > self.cfg.requests // 2
            title = "midway"
        else:
            due = now - self.fault_at >= 1.0  # before heartbeats give up on a frozen peer
            title = f"{now - self.fault_at:.1f}s into fault {self.cfg.fault}"
        if due:
            self.status_shown = True
            self.on_status(status_table(self.addrs(), self.cfg.cluster_key, title))

    def poll_stats(self) -> None:
        for w in self.workers():
            w.stats = None
            self.send(w, ("stats",))
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
            w.stats is None and not w.frozen for w in self.workers()
        ):
            self.pump(0.05)

    def settled(self) -> bool:
        """Every live worker reports no live request, no held block and (P) no prefill still
        queued for admission: a queued one is admitted later, holds blocks and is live when the
        run stops (its decoder may be gone, so it ends only at P's request timeout)."""
        self.poll_stats()
        for w in self.workers():
            s = w.stats
            if s is None or s["held_blocks"] or s["live_requests"] or s.get("waiting"):
                return False
        return True
