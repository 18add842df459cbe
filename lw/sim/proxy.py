"""The proxy and the side channel of the checker world: requests arriving, D allocating their
blocks, the proxy starting and routing prefills, and messages delivered to the endpoints (a
part of :class:`lw.sim.world.World`)."""

from __future__ import annotations

from lw.fsm import ProtocolError
from lw.fsm.messages import MetaReply
from lw.sim.config import _who, p_addr
from lw.sim.network import MsgKey, describe_key
from lw.sim.pnode import PNode
from lw.sim.ports import Ports
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.state import WorldState
from lw.transport.wire import decode, encode


class Proxy:
    """Arrivals (``arrived``, ``d_queue``, ``p_queue``), D's allocation (``d_pool``), starts
    and routing, and deliveries (``net``)."""

    __slots__ = ("s", "ports", "p_node")

    def __init__(self, s: WorldState, ports: Ports, p_node: PNode) -> None:
        self.s = s
        self.ports = ports
        self.p_node = p_node

    def do_arrive(self) -> None:
        """The client sends the next request to the proxy."""
        s = self.s
        q = s.reqs[s.arrived]
        s.arrived += 1
        d = q.d_rank
        if s.d_alive[d]:
            s.d_queue[d].append(q.idx)
            q.d_stage = "waiting"
            s.arrow("Proxy", s.dpart(d), f"allocate {q.rid}")
        else:
            q.d_stage = "lost"
            q.touched = True
        if not s.design.d_first:
            if s.p_alive:
                s.p_queue[q.p_rank].append(q.idx)
                q.p_stage = "queued"
                q.started = True
                s.arrow("Proxy", f"P{q.p_rank * s.tp}", f"prefill {q.rid}")
            else:
                q.p_stage = "lost"

    def do_alloc(self, d: int) -> None:
        """D engine ``d`` allocates blocks for the head of its queue and registers it."""
        s = self.s
        r = s.d_queue[d].pop(0)
        q = s.reqs[r]
        pool = s.d_pool[d]
        blocks = tuple([b for b, o in enumerate(pool) if o is None][:s.cfg.blocks_per_request])
        for b in blocks:
            pool[b] = r
        q.d_blocks = blocks
        q.d_stage = "allocated"
        q.t_alloc = s.now
        q.d_inc = s.d_inc[d]
        if not q.loads() and "full-hit-waits" in s.quirks:
            # vLLM #56640: the full hit is still registered as a request to load.
            s.note(s.dpart(d), f"{q.rid} gets block(s) {list(blocks)}: full prefix-cache "
                               "hit, but registered as loading")
            for v in s.d_workers_of(d):
                self.register(q, v, blocks)
        elif not q.loads():
            # Every block is in D's prefix cache: nothing to load, D decodes at once (the
            # stranded request of vLLM #56640 waited here for a transfer that never comes).
            q.d_stage = "decoding"
            s.flags.add("done")
            s.note(s.dpart(d), f"{q.rid} gets block(s) {list(blocks)}: full prefix-cache "
                               "hit, decoding")
        else:
            cached = f", {list(q.d_cached)} cached" if q.hit else ""
            s.note(s.dpart(d), f"{q.rid} gets block(s) {list(blocks)}{cached}")
            for v in s.d_workers_of(d):
                self.register(q, v, q.d_remote)
        if s.design.ahead and q.ahead == "ahead" and s.rank_alive(q.p_rank):
            self.p_node.p_bind(q)  # a full hit binds it to no decoder: P ends, sending nothing
            if not q.refused and q.loads():
                self.route(q)
        elif s.design.ahead and q.ahead != "bound" and not s.rank_alive(q.p_rank) and q.loads():
            # its P rank died before D's blocks came (queued, or computing ahead): the proxy saw
            # P's ahead request fail and starts the prefill D first on a live rank, as for a
            # refused bind
            if s.first_live_rank() is not None:
                self._restart(q, "its P rank died before the bind")
        elif s.design.ahead and q.p_stage == "queued" and q.loads():
            # P has not scheduled it yet: D's call is answered with the attempt's P (it watches
            # it from now), and P's scheduler adds it with D's blocks (lw/sim/pnode.py)
            self.route(q)
        elif not s.design.d_first and q.p_stage == "scheduled" and not q.p_added:
            self.p_node.p_add(q)

    def register(self, q: Req, v: int, blocks: tuple[int, ...]) -> None:
        """D worker ``v`` registers ``q`` to receive into ``blocks`` (in the allocation's
        own action here)."""
        s = self.s
        self.ports.run(("d", v), s.d[v].add_request(
            q.rid, blocks, s.plan.senders[v % s.d_tp], s.now))

    def do_start(self, r: int) -> None:
        """The proxy starts the prefill of request ``r`` on its (live) P rank."""
        s = self.s
        q = s.reqs[r]
        if not s.rank_alive(q.p_rank):  # the proxy routes to a live P
            live = s.first_live_rank()
            assert live is not None
            q.p_rank = live
        q.started = True
        q.p_stage = "queued"
        s.p_queue[q.p_rank].append(r)
        s.arrow("Proxy", f"P{q.p_rank * s.tp}", f"prefill {q.rid}")
        self.route(q)

    def fallback_actions(self) -> list[tuple]:
        """Requests whose bind P refused, now released by P, with D still waiting: the proxy
        starts them D first (computing ahead)."""
        s = self.s
        if not s.p_alive or s.first_live_rank() is None:
            return []
        return [("fallback", q.idx) for q in s.reqs
                if q.refused and q.p_stage == "released" and q.d_stage == "allocated"]

    def do_fallback(self, r: int) -> None:
        """The proxy starts request ``r`` again, D first: P dropped its attempt computed ahead
        before D's blocks came (nothing of it was written: it never claimed D)."""
        self._restart(self.s.reqs[r], "P refused the bind")

    def _restart(self, q: Req, why: str) -> None:
        """Start ``q`` again, D first, its attempt computed ahead given up (never written)."""
        s = self.s
        q.p_stage, q.p_blocks, q.p_added, q.p_freed, q.t_padd = "none", None, False, False, None
        q.chunk, q.accepted, q.landed = 0, frozenset(), frozenset()
        q.send_reports, q.send_ok = (0,) * s.tp, (False,) * s.tp
        q.ahead, q.refused = "", False
        s.note("Proxy", f"{q.rid}: {why}; started again, D first")
        self.do_start(q.idx)

    def route(self, q: Req) -> None:
        """The proxy sends ``q``'s current attempt to its rank: D watches that P from now."""
        s = self.s
        i = q.p_rank
        for v in s.d_workers_of(q.d_rank):
            self.ports.run(("d", v), s.d[v].prefill_routed(
                q.rid, s.p_engine(i), p_addr(i * s.tp), q.p_epoch, s.now))

    def do_deliver(self, key: MsgKey) -> None:
        """The side channel delivers one message to its (live) endpoint."""
        s = self.s
        msg = s.net.take(key)
        dest, src = key[0], key[1]
        if s.cfg.wire and decode(encode(msg)) != msg:
            raise Violation("core-protocol-error", f"{describe_key(key)} does not survive the "
                                                   "wire encoding")
        idx = int(dest[1:])
        s.arrow(_who(src), _who(dest), describe_key(key))
        if dest[0] == "p":
            if not s.rank_alive(idx // s.tp):
                return
            if isinstance(msg, MetaReply):
                q = s.req_of(msg.req_id)
                if q is not None and msg.status == "accepted":
                    q.accepted = q.accepted | {(idx, int(src[1:]))}
                if s.lane[idx] == src:  # serial-handshake: the first contact is answered
                    self.ports.next_handshake(idx)
            self.ports.run(("p", idx), s.p[idx].on_message(msg, s.now))
        else:
            e = idx // s.d_tp
            if not s.d_alive[e]:
                return
            try:
                effects = s.d[idx].on_message(msg, s.now)
            except ProtocolError:
                q = s.req_of(msg.req_id)
                if q is None or q.d_inc == s.d_inc[e] or s.d[idx].state_of(q.rid):
                    raise
                # A message about a request of an earlier incarnation of this D: the new
                # process does not know it and the runtime drops what the core refuses.
                s.note(f"D{idx}", f"{msg.req_id} is unknown to this incarnation: dropped")
                return
            self.ports.run(("d", idx), effects)
