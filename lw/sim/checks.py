"""The properties checked on world states: safety after every action, liveness where nothing
is enabled (a part of :class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm.lifecycles import AWAIT_DECODER_META, CHUNK_SENT, META_READY, layer_sent
from lw.sim.config import _owner
from lw.sim.describe import Describe
from lw.sim.pnode import PNode
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.state import WorldState


class Checks:
    """The always and eventually properties of a world state (reads the state only)."""

    __slots__ = ("s", "p_node", "describe")

    def __init__(self, s: WorldState, p_node: PNode, describe: Describe) -> None:
        self.s = s
        self.p_node = p_node
        self.describe = describe

    def check_safety(self) -> None:
        """The 'always' properties on this state; raises Violation."""
        s = self.s
        L = s.cfg.layers
        tp, d_tp = s.tp, s.d_tp
        for z in s.zombies if not s.cfg.late_writes else ():  # unbounded: stale-kv's
            q = s.reqs[z[1]]
            if z[6] != q.epoch and set(z[4]) & set(q.d_remote):
                raise Violation("stale-kv",
                                f"{s.dname(z[3] // d_tp)} moved {q.rid} on to claim epoch "
                                f"{q.epoch} while in-doubt bytes of its epoch-{z[6]} "
                                f"{s.what(z[1], z[2])} write from P worker {z[0]} may still "
                                f"land in D block(s) {list(z[4])} (until t={z[5]:g}): the "
                                "new epoch's KV can be overwritten with the old one's")
            self._check_owned(z[0] // tp, z[1], (), z[3] // d_tp, z[4],
                              f"in-doubt bytes of its {s.what(z[1], z[2])} write from P "
                              f"worker {z[0]} may land until t={z[5]:g}")
        for i, fifo in enumerate(s.fifo):
            for w in fifo:  # a write addressed to an earlier incarnation of D cannot land
                current = w[6] == s.d_inc[w[4] // d_tp]
                self._check_owned(i // tp, w[0], w[2], w[4] // d_tp, w[3] if current else (),
                                  f"its {s.what(w[0], w[1])} write from P worker {i} is in "
                                  "flight")
        if not s.p_alive:
            return
        # states from which the request still submits writes (CHUNK_SENT: the next chunk's)
        more = {AWAIT_DECODER_META, META_READY, CHUNK_SENT,
                *(layer_sent(k) for k in range(L - 1))}
        for i, ep in enumerate(s.p):
            if not s.rank_alive(i // tp):
                continue
            for rid in ep.live_requests():
                st = ep.state_of(rid)
                if st in more or ep.inflight_writes(rid):
                    q = s.reqs[int(rid[1:])]
                    d_side = (st != AWAIT_DECODER_META and st in more
                              and q.d_inc == s.d_inc[q.d_rank])
                    self._check_owned(i // tp, q.idx, q.p_blocks or (), q.d_rank,
                                      q.d_blocks if d_side else (),
                                      f"it is {st} on {s.wname(i)} with "
                                      f"{ep.inflight_writes(rid)} write(s) in flight")

    def _check_owned(self, i: int, r: int, local: tuple[int, ...], d: int,
                     remote: tuple[int, ...] | None, why: str) -> None:
        s = self.s
        rid = s.reqs[r].rid
        if s.rank_alive(i):
            pool = s.p_pool[i]
            for b in local:
                if pool[b] != r:
                    how = s.free_why.get(("P", i, b), "?")
                    raise Violation("use-after-free",
                                    f"P rank {i} block {b} was freed ({how}) while {rid} may "
                                    f"still read it ({why}); it is now {_owner(pool[b])}")
        if remote and s.d_alive[d]:
            pool = s.d_pool[d]
            for b in remote:
                if pool[b] != r:
                    how = s.free_why.get(("D", d, b), "?")
                    raise Violation("use-after-free",
                                    f"{s.dname(d)} block {b} was freed ({how}) while {rid} may "
                                    f"still write into it ({why}); it is now {_owner(pool[b])}")

    def check_terminal(self) -> None:
        """The 'eventually' properties at a state where no action is enabled."""
        s = self.s
        stuck = [q for q in s.reqs if not self._finished_both(q)]
        if stuck:
            names = ", ".join(q.rid for q in stuck)
            raise Violation("deadlock", f"no action is enabled but {names} never finished",
                            self.explain_stuck())
        for q in s.reqs:
            once = (1 if q.loads() else 0,) * s.d_tp  # a full prefix hit has nothing to load
            current = q.d_inc == s.d_inc[q.d_rank]  # not lost with an earlier incarnation
            if (s.d_alive[q.d_rank] and current and q.d_blocks is not None
                    and q.recv_reports != once):
                raise Violation("request-ends", f"{q.rid} was reported {list(q.recv_reports)} "
                                                f"times by the workers of {s.dname(q.d_rank)}")
            if s.rank_alive(q.p_rank) and q.p_added and any(n != 1 for n in q.send_reports):
                raise Violation("request-ends", f"{q.rid} was reported {q.send_reports} times "
                                                f"by the workers of P DP rank {q.p_rank}")
        if s.p_alive:
            for i, pool in enumerate(s.p_pool):
                if s.rank_alive(i) and any(o is not None for o in pool):
                    raise Violation("blocks-return", f"P rank {i} still holds blocks {pool}")
            for i, ep in enumerate(s.p):
                if s.rank_alive(i // s.tp) and ep.live_requests():
                    raise Violation("blocks-return",
                                    f"{s.wname(i)} still holds {ep.live_requests()}")
        for d, pool in enumerate(s.d_pool):
            if not s.d_alive[d]:
                continue
            if any(o is not None for o in pool):
                raise Violation("blocks-return", f"{s.dname(d)} still holds blocks {pool}")
            for v in s.d_workers_of(d):
                if s.d[v].live_requests():
                    raise Violation("blocks-return",
                                    f"D{v} still holds {s.d[v].live_requests()}")
                if s.d[v].ghosts():
                    raise Violation("blocks-return", f"D{v} still holds abandoned claim "
                                                     f"epochs {sorted(s.d[v].ghosts())}")
        self.check_progress()

    def check_progress(self) -> None:
        """Property progress (with a timely clock): every request no fault touched, with fewer
        message losses than P's retry budget, ended DONE on both sides."""
        s = self.s
        cfg = s.cfg
        if not cfg.progress_budget():
            return
        for q in s.reqs:
            if q.touched or q.losses >= cfg.retries:
                continue
            loaded = q.d_stage == "done" and (all(q.recv_ok) or not q.loads())
            if loaded and (all(q.send_ok) or q.p_crashes):  # a dead P reports nothing
                continue
            hits = q.p_crashes + q.bad_transfers
            if hits > cfg.retry_prefill or len(s.dead_ranks) >= cfg.dp:
                continue  # its prefill was lost more often than D may retry, or every P died
            if (q.bad_transfers and hits >= cfg.dp
                    and getattr(cfg, "retry_prefill_avoid", "lost") == "lost"):
                continue  # each P engine it met is avoided after its bad transfer
            if q.bad_transfers:
                why = (f"although its transfers went bad {q.bad_transfers} time(s) and its P rank "
                       f"died {q.p_crashes} time(s), within D's prefill retry budget of "
                       f"{cfg.retry_prefill}, and a P rank it need not avoid lives")
            elif q.p_crashes:
                why = (f"although its P rank died {q.p_crashes} time(s), within D's prefill "
                       f"retry budget of {cfg.retry_prefill}, and a P rank lives")
            elif not cfg.faults:
                why = "although there were no faults"
            elif q.losses:
                why = (f"although only {q.losses} of its messages were lost (P's retry budget "
                       f"is {cfg.retries}) and no other fault touched it")
            elif "stall" in cfg.fault_kinds:
                why = ("although no fault touched it (its peers were at most slow: silent "
                       f"{cfg.stall_s:g}s with their processes alive)")
            else:
                why = "although no fault touched it (only other requests were hit)"
            raise Violation("progress", f"{q.rid} did not end DONE {why}", self.describe.summary())

    def _finished_both(self, q: Req) -> bool:
        s = self.s
        d_ok = q.d_final() or not s.d_alive[q.d_rank]
        if not s.p_alive or s.first_live_rank() is None:
            return d_ok
        if q.p_stage in ("released", "aborted", "lost"):
            p_ok = True
        elif q.p_stage == "none":
            p_ok = not (s.design.d_first and q.d_blocks is not None)
        else:
            p_ok = False
        return d_ok and p_ok

    def explain_stuck(self) -> list[str]:
        """Why nothing can move: the cycle of waits if there is one, else what each party
        waits for."""
        s = self.s
        edges: dict[str, list[str]] = {}
        label: dict[str, str] = {}

        def edge(a: str, b: str) -> None:
            edges.setdefault(a, [])
            if b not in edges[a]:
                edges[a].append(b)

        blocked = self.p_node.blocked_hooks()  # rank -> requests it waits for in its hook
        stepping = s.phase is not None and s.p_alive
        for wk in range(len(s.p)):
            node = f"P{wk}"
            if wk in blocked:
                label[node] = (f"{s.wname(wk)} is blocked inside the layer-{s.phase} save "
                               f"hook, waiting for D's metadata of {', '.join(blocked[wk])}")
                for rid in blocked[wk]:
                    edge(node, f"meta:{rid}")
            elif stepping and blocked:
                others = sorted(blocked)
                label[node] = (f"{s.wname(wk)} passed its layer-{s.phase} hook and waits in "
                               f"the layer-{s.phase} collective for "
                               f"{', '.join(s.wname(o) for o in others)}")
                for o in others:
                    edge(node, f"P{o}")
        for q in s.reqs:
            rid = q.rid
            if q.d_stage == "waiting":
                d = q.d_rank
                holders = sorted({o for o in s.d_pool[d] if o is not None})
                dn = s.dname(d)
                label[f"meta:{rid}"] = (f"{rid} has no D metadata: it waits in {dn}'s queue for a "
                                        f"free block ({dn} has {len(s.d_pool[d])} block(s), all "
                                        f"held)" if holders else
                                        f"{rid} waits in {dn}'s queue for a free block")
                for h in holders:
                    edge(f"meta:{rid}", f"req:r{h}")
            if q.d_stage == "allocated" and q.d_blocks is not None:
                d = q.d_rank
                blocks = list(q.d_blocks)
                writers = sorted({wk for v in s.d_workers_of(d) for wk in s.writers(q, v)})
                senders = [f"P{wk}" for wk in writers]
                who = " and ".join(s.wname(wk) for wk in writers) or "nobody"
                label[f"req:{rid}"] = (f"{s.dname(d)} block(s) {blocks} are held by {rid}, "
                                       f"which waits for its KV from {who}")
                for node in senders:
                    edge(f"req:{rid}", node)
        cycle = _find_cycle(edges)
        if cycle:
            starts = [n for n in cycle if n.startswith("P") and int(n[1:]) in blocked]
            if starts:
                k = cycle.index(starts[0])
                cycle = cycle[k:] + cycle[:k]
            lines = ["cycle of waits:", f"   {label.get(cycle[0], cycle[0])}"]
            lines += [f"-> {label.get(node, node)}" for node in cycle[1:]]
            lines.append(f"-> back to: {label.get(cycle[0], cycle[0])}")
            return lines
        lines = ["stuck state (no cycle found among the modelled waits):"]
        lines += [f"  {text}" for text in label.values()]
        lines += [f"  {line}" for line in self.describe.summary()]
        return lines


def _find_cycle(edges: dict[str, list[str]]) -> list[str]:
    """A cycle in a small directed graph (depth-first search), as its list of nodes."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str]:
        color[n] = 1
        stack.append(n)
        for m in edges.get(n, []):
            if color.get(m) == 1:
                return stack[stack.index(m):]
            if color.get(m) is None:
                found = dfs(m)
                if found:
                    return found
        stack.pop()
        color[n] = 2
        return []

    for n in sorted(edges):
        if n not in color:
            found = dfs(n)
            if found:
                return found
    return []
