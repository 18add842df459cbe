"""The synthetic cluster: a D-first proxy/coordinator that runs P DP ranks and decoders.

:func:`run_cluster` starts the workers (OS processes with the Mooncake data plane, threads with
the in-process one), feeds requests to the decoders (each allocates first and asks for the
prefill; with several, :mod:`lw.lab.synthetic.router` picks one per request and moves a dead one's
requests that streamed no token yet), routes each prefill to a live P rank, injects the
configured fault, waits until every request is accounted for and every held block came back,
and returns a :class:`ClusterResult`. Every worker it started is stopped or killed before it
returns.

Worker processes are started with ``spawn``: a script that calls :func:`run_cluster` needs the
usual ``if __name__ == "__main__":`` guard. Worker stderr (Mooncake's logs) goes to files in
``ClusterConfig.log_dir``; ``LW_DEBUG=1`` prints the coordinator's events as they happen.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from lw.lab.synthetic.config import (
    DECODER_RESTARTS,
    LINK_FAULTS,
    PARTITION_FAULTS,
    ClusterConfig,
)
from lw.lab.synthetic.decoder import decode_main
from lw.lab.synthetic.faults import FaultInjector
from lw.lab.synthetic.netem import Link
from lw.lab.synthetic.netns import Partition
from lw.lab.synthetic.observe import status_table, write_timelines, write_trace
from lw.lab.synthetic.prefill_rank import prefill_main
from lw.lab.synthetic.result import ClusterResult, short_reason
from lw.lab.synthetic.router import Lost, Router
from lw.lab.synthetic.workers import BarrierAction, ghost_steps, p_engine

ProgressFn = Callable[["ClusterResult"], None]
CORRUPT_DETAILS = 5  # corrupt requests whose wrong block is described in the result


@dataclass
class _Worker:
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


class _Cluster(FaultInjector):
    """Coordinator state and the proxy's routing; one instance per run."""

    def __init__(self, cfg: ClusterConfig, progress: ProgressFn | None,
                 on_status: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        self.as_process = cfg.data_plane == "mooncake"
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
        self.ranks: list[_Worker] = []
        # per D engine: its current incarnation, ports (kept across restarts), generation
        self.decoders: list[_Worker | None] = [None] * cfg.decoders
        self.d_all: list[_Worker] = []  # every D incarnation started (all are reaped)
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
        """Start a worker as a process (Mooncake) or a thread (in-process data plane)."""
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
        self.ranks.append(_Worker("p", rank, cmd, ev, proc, key=f"p{rank}"))

    def start_decoder(self, slot: int = 0) -> None:
        self.d_generation[slot] += 1
        cfg, ports, inc = self.cfg, list(self.d_ports[slot]), time.time_ns()
        gen = self.d_generation[slot]
        proc, cmd, ev = self._spawn(
            decode_main,
            lambda c, e, p: (cfg, c, e, ports, inc, gen, p, slot),
            f"lw-decode-gen{gen}" if slot == 0 else f"lw-decode{slot}-gen{gen}")
        w = _Worker("d", gen, cmd, ev, proc, slot=slot,
                    key=f"d{gen}" if cfg.decoders == 1 else f"d{slot}g{gen}")
        self.decoders[slot] = w
        self.d_all.append(w)
        self.res.decoder_generations = max(self.d_generation)

    @property
    def decoder(self) -> _Worker | None:
        """The first D engine: the one single-decoder faults act on."""
        return self.decoders[0]

    def live_decoders(self) -> list[_Worker]:
        return [d for d in self.decoders if d is not None and d.alive]

    def workers(self) -> list[_Worker]:
        return [w for w in self.ranks if w.alive] + self.live_decoders()

    def send(self, w: _Worker, item: tuple) -> None:
        if not w.alive or w.frozen:
            return
        try:
            w.cmd.send(item)
        except (OSError, EOFError, ValueError):
            self.lost(w, "command pipe closed")

    # ------------------------------------------------------------------- events
    def pump(self, timeout: float) -> None:
        """Handle worker events and deaths for up to ``timeout`` seconds (one wait)."""
        conns: dict[Any, _Worker] = {}
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

    def _drain(self, w: _Worker) -> None:
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

    def on_event(self, w: _Worker, ev: tuple) -> None:
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

    def lost(self, w: _Worker, why: str) -> None:
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

    def decoder_lost(self, w: _Worker, why: str) -> None:
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


def run_cluster(cfg: ClusterConfig, progress: ProgressFn | None = None,
                on_status: Callable[[str], None] | None = None) -> ClusterResult:
    """Run the synthetic cluster for ``cfg`` and return what happened (workers always reaped);
    ``on_status`` receives the ``lw status`` table when ``cfg.status`` asks for one."""
    cl = _Cluster(cfg, progress, on_status)
    t_start = time.monotonic()
    try:
        if cfg.fault in PARTITION_FAULTS:
            try:
                cl.net = Partition().__enter__()
            except OSError as exc:
                cl.res.errors.append(str(exc))
                return cl.res
            cfg.p_host, cfg.d_host, cfg.d_netns = cl.net.host_ip, cl.net.ns_ip, cl.net.name
        elif cfg.fault in LINK_FAULTS:
            # the whole run, from before the first connection: nothing to inject later, and no
            # moment of injection, so no time-to-detect either (nothing dies)
            loss = cfg.link_loss if cfg.fault == "lossy-link" else 0.0
            delay = cfg.link_delay_s if cfg.fault == "slow-link" else 0.0
            try:
                cl.link = Link(loss=loss, delay_pd_s=delay, seed=cfg.seed).__enter__()
            except OSError as exc:
                cl.res.errors.append(str(exc))
                return cl.res
            cfg.p_host, cfg.d_host, cfg.d_netns = cl.link.host_ip, cl.link.ns_ip, cl.link.name
        for slot in range(cfg.decoders):
            cl.start_decoder(slot)
        for rank in range(cfg.prefill_dp):
            cl.start_rank(rank)
        deadline = time.monotonic() + 60
        while (not all(w.ready for w in cl.workers())
               or len(cl.workers()) < cfg.prefill_dp + cfg.decoders):
            dead = [w for w in cl.ranks + cl.d_all if not w.alive]
            if time.monotonic() > deadline or cl.res.errors or dead:
                cl.res.errors.append("workers did not start" + (
                    f" ({len(dead)} died; logs in {cfg.log_dir})" if dead else ""))
                return cl.res
            cl.pump(0.05)
        cl.poll_stats()
        cl.record_rss(0)
        warm = False
        run_deadline = time.monotonic() + cfg.run_timeout_s
        while len(cl.outcome) < cfg.requests:
            if time.monotonic() > run_deadline:
                cl.res.errors.append(f"run timeout: {len(cl.outcome)}/{cfg.requests} accounted")
                break
            cl.inject()
            cl.fire_aborts()
            if not warm and len(cl.outcome) >= cfg.requests // 10:
                warm = True
                cl.poll_stats()
                cl.record_rss(1)
            cl.maybe_show_status()
            cl.feed()
            cl.pump(0.02)
            if not cl.live_decoders():
                # every decoder gone for good (a restart starts the new one at once): every
                # request not yet sent fails with them
                while cl.router.pending:
                    cl.record(cl.router.pending.popleft(), "failed", "no decoder", None)
        cl.res.elapsed_s = (cl.t_last or time.monotonic()) - (cl.t_first or t_start)
        # thaw a still frozen decoder, heal a cut link, before settling
        while cl.thaw_at is not None or cl.heal_at is not None:
            cl.inject()
            cl.pump(0.05)
        settle_deadline = time.monotonic() + cfg.settle_timeout_s
        _debug(cl, "settling")
        while not cl.settled() and time.monotonic() < settle_deadline:
            cl.pump(0.2)
        if cfg.trace_out:
            answered, spans = write_trace(cl.addrs(), cfg.cluster_key, cfg.trace_out)
            cl.res.counters["trace_workers"] = answered
            cl.res.counters["trace_spans"] = spans
        if cfg.timelines_out:
            cl.res.counters["timeline_workers"] = write_timelines(
                cl.addrs(), cfg.cluster_key, cfg.timelines_out, f"synthetic fault={cfg.fault}",
                cfg)
        _debug(cl, "stopping")
        _stop(cl)
        _debug(cl, "collecting")
        _collect(cl)
        cl.record_rss(2)
        return cl.res
    finally:
        _reap(cl)
        if cl.net is not None:
            cl.net.__exit__()
        if cl.link is not None:
            cl.link.__exit__()
            if cl.link.error:
                cl.res.errors.append(cl.link.error)
            st = cl.link.stats
            cl.res.counters.update({
                "link.packets": st.packets_pd + st.packets_dp,
                "link.dropped": st.dropped_pd + st.dropped_dp,
                "link.bytes": st.bytes_pd + st.bytes_dp,
                "link.mib": (st.bytes_pd + st.bytes_dp) >> 20,
                "link.tcp_syns": st.syns,
                "link.relay_cpu_ms": int(st.busy_s * 1000)})
        if cl.own_log_dir and cl.res.ok and not _DEBUG:
            shutil.rmtree(cfg.log_dir, ignore_errors=True)  # kept when something went wrong
            cl.res.log_dir = ""
            cfg.log_dir = None


_DEBUG = bool(os.environ.get("LW_DEBUG"))


def _debug(cl: _Cluster, what: str) -> None:
    if _DEBUG:
        print(f"[lw] {time.monotonic():.3f} {what}: " + ", ".join(
            f"{w.role}{w.index} alive={w.alive} stats={None if w.stats is None else {k: w.stats.get(k) for k in ('held_blocks', 'live_requests')}}"  # noqa: E501
            for w in cl.ranks + cl.d_all), flush=True)


def _stop(cl: _Cluster) -> None:
    """Stop the P ranks at the same step (barrier action) and the decoders; wait for finals."""
    cl.flags[0] = 1
    for d in cl.live_decoders():
        cl.send(d, ("stop",))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(w.final is None for w in cl.workers()):
        cl.pump(0.05)


def _collect(cl: _Cluster) -> None:
    res = cl.res
    for w in cl.ranks:
        s = w.final or w.stats
        if not w.alive and w.final is None:
            continue  # a dead rank's memory died with it
        if s is None:
            res.errors.append(f"P rank {w.index} sent no final stats")
        else:
            res.add_p_stats(s)
    res.p_unreported = sum(1 for r in cl.assigned.values() if r not in res.dead_ranks)
    for d in cl.decoders:  # a dead decoder's blocks died with it
        if d is None or not (d.alive or d.final is not None):
            continue
        s = d.final or d.stats
        if s is None:
            res.errors.append(f"decoder {d.slot} sent no final stats")
        else:
            res.add_d_stats(s)


def _reap(cl: _Cluster) -> None:
    """Kill whatever is still running (processes: SIGCONT first, then SIGKILL)."""
    cl.flags[0] = 1
    cl.flags[1] = 1
    try:
        cl.barrier.abort()
    except Exception:
        pass
    all_workers = list(cl.ranks) + cl.d_all
    if cl.as_process:
        for w in all_workers:
            p = w.proc
            p.join(timeout=0 if not w.alive else 3)
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
                p.join(5)
    else:
        for w in all_workers:
            w.proc.join(timeout=10)
    for w in all_workers:
        for c in (w.cmd, w.events):
            try:
                c.close()
            except OSError:
                pass
