"""Human text of the checker world's actions and states, for traces and stuck-state reports (a
part of :class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm.effects import timer_name
from lw.sim.config import Action, _who
from lw.sim.network import describe_key
from lw.sim.state import WorldState


class Describe:
    """Descriptions of actions and states (reads the state only)."""

    __slots__ = ("s",)

    def __init__(self, s: WorldState) -> None:
        self.s = s

    def describe(self, a: Action) -> str:
        """Human text of an action, in the current state (before it is applied)."""
        s = self.s
        kind = a[0]
        if kind == "arrive":
            q = s.reqs[s.arrived]
            if s.design.d_first:
                return f"client sends {q.rid}; proxy asks {s.dname(q.d_rank)} to allocate first"
            return (f"client sends {q.rid}; proxy starts it on P DP rank {q.p_rank} and "
                    f"{s.dname(q.d_rank)}")
        if kind == "alloc":
            q = s.reqs[s.d_queue[a[1]][0]]
            free = [b for b, o in enumerate(s.d_pool[a[1]]) if o is None]
            blocks = free[:s.cfg.blocks_per_request]
            hit = ""
            if q.hit:
                hit = (" (full prefix-cache hit: nothing to load)" if q.hit == len(blocks)
                       else f" ({blocks[:q.hit]} from its prefix cache)")
            return f"{s.dname(a[1])} allocates block(s) {blocks} for {q.rid}{hit}"
        if kind == "start":
            q = s.reqs[a[1]]
            return f"proxy starts the prefill of {q.rid} on P DP rank {q.p_rank}"
        if kind == "schedule":
            return f"P step {s.steps + 1} scheduled on every DP rank"
        if kind in ("layer", "hook"):
            ranks = range(s.cfg.dp) if kind == "layer" else [a[1] // s.tp]
            parts = [f"rank {i} " + (",".join(s.in_step(r) for r in s.p_batch[i])
                                     or "dummy") for i in ranks]
            what = "all workers" if kind == "layer" else s.wname(a[1])
            return f"P layer {s.phase} on {what} ({'; '.join(parts)})"
        if kind == "barrier":
            return f"P ranks pass the layer-{s.phase} collective"
        if kind in ("deliver", "drop", "dup"):
            key = a[1]
            verb = {"deliver": "deliver", "drop": "network DROPS",
                    "dup": "network DUPLICATES"}[kind]
            return f"{verb} {describe_key(key)} {_who(key[1])} -> {_who(key[0])}"
        if kind == "zland":
            z = next(z for z in s.zombies if z[:4] == a[1:])
            return (f"LATE: the in-doubt bytes of {s.reqs[z[1]].rid} "
                    f"{s.what(z[1], z[2])} from P{z[0]} land in D{z[3]} block(s) "
                    f"{list(z[4])}")
        if kind == "fence_fail":
            return (f"the data-plane fence {s.dwname(a[1])} asked for ({a[2]} epoch {a[3]}) "
                    "does NOT hold (the transport did not close what it cut)")
        if kind == "fenced":
            return (f"the data-plane fence {s.dwname(a[1])} asked for ({a[2]} epoch {a[3]}) "
                    + ("holds: its senders' in-doubt bytes can no longer land there"
                       if s.cfg.fence_holds() else "returns, while its senders' in-doubt "
                       "bytes can still land there"))
        if kind == "zexp":
            z = next(z for z in s.zombies if z[:4] == a[1:])
            return (f"t={z[5]:g}: the in-doubt bytes of {s.reqs[z[1]].rid} "
                    f"{s.what(z[1], z[2])} from P{z[0]} can no longer land in D{z[3]}")
        if kind in ("complete", "fail_write", "wto"):
            j = (a[2] if len(a) > 2 else 0) if kind == "complete" else (
                a[3] if len(a) > 3 else 0)
            w = s.fifo[a[1]][j]
            how = {"complete": "lands in", "fail_write": "FAILS (injected) towards",
                   "wto": "times out (in doubt) towards"}[kind]
            if kind == "fail_write" and a[2]:
                how = "FAILS IN DOUBT (bytes may still land) towards"
            if kind == "complete" and not s.d_alive[w[4] // s.d_tp]:
                how = "fails (peer dead) towards"
            elif kind == "complete" and w[6] != s.d_inc[w[4] // s.d_tp]:
                how = "fails (peer restarted since) towards"
            return (f"{s.wname(a[1])}: write of {s.reqs[w[0]].rid} {s.what(w[0], w[1])} "
                    f"{how} D{w[4]} block(s) {list(w[3])}")
        if kind == "sample":
            return (f"P rank {a[3]}'s scheduler hands {s.reqs[a[1]].rid}'s first token "
                    f"(epoch {a[2]}) to its workers")
        if kind == "decode":
            q = s.reqs[a[1]]
            blocks = list(q.d_blocks or ())
            return f"{s.dname(q.d_rank)} finishes decoding {q.rid} and frees block(s) {blocks}"
        if kind == "timer":
            ok, oi = a[1]
            return (f"t={s.timers[(a[1], a[2])]:g}: {ok.upper()}{oi} timer {timer_name(a[2])} "
                    "fires")
        if kind == "idle":
            return "time passes, to just before the next deadline"
        if kind == "restart_d":
            return (f"{s.dname(a[1])} restarts (incarnation {s.d_inc[a[1]] + 1}, a new "
                    "process with its memory registered anew)")
        if kind == "p_lost":
            return f"{s.dwname(a[1])} detects that the P engine is gone (peer_lost)"
        if kind == "d_lost":
            return f"{s.wname(a[1])} detects that {s.dname(a[2])} is gone (peer_lost)"
        if kind == "crash_p":
            return "P engine CRASHES (all DP ranks: they share collectives)"
        if kind == "crash_rank":
            return f"P rank {a[1]} CRASHES (engine {s.p_engine(a[1])}; the others live)"
        if kind == "rank_lost":
            return f"{s.dwname(a[1])} detects that P rank {a[2]} is gone (peer_lost)"
        if kind == "reprefill":
            q = s.reqs[a[1]]
            return (f"proxy starts {q.rid} again (claim epoch {q.epoch}) on P rank "
                    f"{s.first_live_rank(q.retry or ())}")
        if kind == "crash_d":
            return f"{s.dname(a[1])} CRASHES" + (" (all its TP workers)" if s.d_tp > 1
                                                    else "")
        if kind == "abort_d":
            return f"client aborts {s.reqs[a[1]].rid} on D"
        if kind == "abort_p":
            return f"client aborts {s.reqs[a[1]].rid} on P"
        if kind == "forge":
            q = s.reqs[a[1]]
            return (f"a forged metaserver call starts the prefill of {q.rid} into D block(s) "
                    f"{list(s.forged_blocks(q))}, not its {list(q.d_remote)}")
        if kind == "stall":
            who = f"P{a[2]}" if a[1] == "p" else s.dwname(a[2])
            return (f"{a[3].upper()} is silent for {s.cfg.stall_s:g}s while its process lives "
                    f"(slow, not dead); {who}'s detector judges it")
        if kind == "corrupt":
            return (f"the bytes of {s.reqs[a[2]].rid} landed in D{a[1]}'s blocks so far are "
                    "CORRUPTED (a bad transfer)")
        return repr(a)

    def summary(self) -> list[str]:
        """A few lines describing the state (for stuck-state reports)."""
        s = self.s
        lines = [f"t={s.now:g}; P step phase: "
                 f"{'idle' if s.phase is None else f'layer {s.phase}'}; P alive "
                 f"{s.p_alive}; D alive {s.d_alive}"]
        for q in s.reqs:
            pst = ",".join(str(s.p[w].state_of(q.rid)) for w in s.workers_of(q.p_rank)
                           ) if s.rank_alive(q.p_rank) else "-"
            dst = ",".join(str(s.d[v].state_of(q.rid)) for v in s.d_workers_of(q.d_rank)
                           ) if s.d_alive[q.d_rank] else "-"
            lines.append(f"{q.rid}: D {q.d_stage} ({dst}), P {q.p_stage} ({pst})")
        lines.append(f"in flight: {len(s.net)} message(s), "
                     f"{sum(len(f) for f in s.fifo)} write(s); timers {len(s.timers)}")
        return lines
