"""The synthetic cluster: a D-first proxy/coordinator that runs P DP ranks and decoders.

:func:`run_cluster` starts the workers (OS processes with the Mooncake data plane, threads with
the in-process one), feeds requests to the decoders (each allocates first and asks for the
prefill; with several, :mod:`lw.lab.synthetic.router` picks one per request and moves a dead one's
requests that streamed no token yet), routes each prefill to a live P rank, injects the
configured fault, waits until every request is accounted for and every held block came back,
and returns a :class:`ClusterResult`. Every worker it started is stopped or killed before it
returns. The coordinator's state and event handling are
:class:`lw.lab.synthetic.coordinator.Coordinator`'s.

Worker processes are started with ``spawn``: a script that calls :func:`run_cluster` needs the
usual ``if __name__ == "__main__":`` guard. Worker stderr (Mooncake's logs) goes to files in
``ClusterConfig.log_dir``; ``LW_DEBUG=1`` prints the coordinator's events as they happen.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable

from lw.lab.synthetic.config import LINK_FAULTS, PARTITION_FAULTS, ClusterConfig
from lw.lab.synthetic.coordinator import Coordinator, ProgressFn
from lw.lab.synthetic.netem import Link
from lw.lab.synthetic.netns import Partition
from lw.lab.synthetic.observe import write_timelines, write_trace
from lw.lab.synthetic.result import ClusterResult

__all__ = ["ProgressFn", "run_cluster"]


def run_cluster(cfg: ClusterConfig, progress: ProgressFn | None = None,
                on_status: Callable[[str], None] | None = None) -> ClusterResult:
    """Run the synthetic cluster for ``cfg`` and return what happened (workers always reaped);
    ``on_status`` receives the ``lw status`` table when ``cfg.status`` asks for one."""
    cl = Coordinator(cfg, progress, on_status)
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


def _debug(cl: Coordinator, what: str) -> None:
    if _DEBUG:
        print(f"[lw] {time.monotonic():.3f} {what}: " + ", ".join(
            f"{w.role}{w.index} alive={w.alive} stats={None if w.stats is None else {k: w.stats.get(k) for k in ('held_blocks', 'live_requests')}}"  # noqa: E501
            for w in cl.ranks + cl.d_all), flush=True)


def _stop(cl: Coordinator) -> None:
    """Stop the P ranks at the same step (barrier action) and the decoders; wait for finals."""
    cl.flags[0] = 1
    for d in cl.live_decoders():
        cl.send(d, ("stop",))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(w.final is None for w in cl.workers()):
        cl.pump(0.05)


def _collect(cl: Coordinator) -> None:
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


def _reap(cl: Coordinator) -> None:
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
