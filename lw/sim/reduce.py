"""Partial-order reduction for the explorer: persistent singleton sets (arrivals, inert deliveries).

The explorer may expand, at a state ``s``, only a subset of the enabled actions, provided the
subset contains a *persistent set* (Godefroid): every action on any path from ``s`` that avoids
the subset is independent of every action in it. With that (C0, C1), every terminal state is
still reached; with invisibility of the reduced actions (C2) and the cycle proviso (C3) the
reduced graph is stutter-equivalent to the full one, so every "always" violation and every
terminal state keep a representative. C3 ("every cycle of the reduced graph has a fully
expanded state") holds vacuously when the reduced graph is acyclic, which the explorer checks
anyway (``check_cycles``; a cycle is reported as a livelock).

**Arrival** (``("arrive",)``, the client sending the next request to the proxy) is, in the
D-first designs, a persistent singleton in every state where it is enabled (in p-first an
arrival also queues the request on P, which the next P step reads: dependent, not reduced).
It writes only the arriving request's entry and the tail of its D engine's queue, which no
other action
reads before the request has arrived: allocation pops the head of a queue (a queue it is the
head of already has that head), an abort or allocation of the new request needs it to have
arrived, a crash empties the queue and marks the request lost whichever came first (a request
that arrives at a dead engine is lost at once: the same state). No other action changes
``arrived``, so nothing disables it; it uses no fault budget, arms no timer, reads no clock, and
no property reads the queues, so it is invisible. Every run that lets the request arrive later
is a reordering of one that lets it arrive now.

Both arguments assume a dead endpoint stays dead: with D restarts (``WorldConfig.d_restarts``)
an arrival at, or a delivery to, a dead D does not commute with its restart, so the explorer
turns the reduction off there.

The comparison tests (``tests/sim/test_explorer.py``: full vs reduced graph, same violated
properties, same terminal states, same values of everything the properties read) first failed
for the inert deliveries: the cause was not the reduction but the state hashing, which merged
states whose relative times were -1 s and -2 s (``hash(-1) == hash(-2)`` in CPython); the
explorer now fingerprints the key's text (``lw.sim.explorer.fingerprint``).

An **inert delivery**. A message in flight to an endpoint that is dead,
or about a request that endpoint has already finished (final, released, not live), once no fault
can be injected any more (no drop, duplicate, crash or abort left in the budget, faults off, or
no fault kind):

* it can never be disabled (only delivering it removes it: no drop, no crash of its receiver);
* its receiver's answer to it cannot change (a dead endpoint stays dead; a finished request stays
  finished: requests are never re-added, there are no restarts), so it commutes with every other
  action: other actions only add messages (a multiset: counts commute) or touch other state;
* it is invisible when its application, *checked on the spot*, changes nothing but the messages
  in flight: the world key with the network left out is the same before and after (endpoint
  snapshots, pools, requests, timers, writes, clock), so no property can see it.

Then ``{deliver(m)}`` is a persistent set and it is the only successor explored. The dynamic
check means a wrong guess costs nothing in soundness: a candidate that does change more than the
network is just one ordinary successor among the others.
"""

from __future__ import annotations

from collections.abc import Callable

from lw.fsm.lifecycles import DONE, FAILED
from lw.sim.world import Action, World

_FINAL = (DONE, FAILED)
ARRIVE: Action = ("arrive",)


def faults_exhausted(w: World) -> bool:
    """No fault action (drop, duplicate, failed write, crash, abort) can ever be enabled again."""
    return (not w.faults_on() or w.s.faults_used >= w.cfg.max_faults
            or not w.cfg.fault_kinds)  # --faults with no fault kind: delays only


def inert_candidates(w: World, acts: list[Action]) -> list[Action]:
    """Enabled deliveries to a dead endpoint or about a request final and released there.

    Only meaningful when :func:`faults_exhausted`; each candidate must still pass the dynamic
    invisibility check (:func:`key_without_network` unchanged by it)."""
    out: list[Action] = []
    for a in acts:
        if a[0] != "deliver":
            continue
        dest, rid = a[1][0], a[1][3]
        idx = int(dest[1:])
        if dest[0] == "p":
            if not w.s.p_alive:
                out.append(a)
                continue
            ep = w.s.p[idx]
        else:
            if not w.s.d_alive[idx // w.s.d_tp]:
                out.append(a)
                continue
            ep = w.s.d[idx]
        if rid not in ep.live_requests() and ep.state_of(rid) in _FINAL:
            out.append(a)
    return out


def key_without_network(w: World) -> tuple:
    """The world's key with the messages in flight left out."""
    net = w.s.net
    saved = net.counts
    net.counts = {}
    try:
        return w.key()
    finally:
        net.counts = saved


def inert_detections(w: World, acts: list[Action]) -> list[tuple[Action, Callable[[World], None]]]:
    """Enabled failure detections (``p_lost``, ``d_lost``) that nothing can make matter any more,
    each with the world flag it sets (to compute the key it must leave unchanged).

    Only meaningful when :func:`faults_exhausted` (no crash can disable them). A detection of a
    dead peer reads the detecting endpoint's live requests bound to that peer and its cached
    layouts of it. It is *stable* when no message from the dead peer to the endpoint is in
    flight (the only way a claim or a layout of it could still arrive) and, for a P worker, no
    request bound for the dead D engine can still be added to it (every such request was added
    already or was never allocated: a dead engine allocates nothing). Then its effect is the same
    in every later state; the dynamic check (the key with the flag set is unchanged) shows it is
    nothing, so it commutes with everything and is invisible."""
    out: list[tuple[Action, Callable[[World], None]]] = []
    senders: dict[str, set[str]] = {}
    for k in w.s.net.keys():
        senders.setdefault(k[0], set()).add(k[1])
    for a in acts:
        if a[0] == "p_lost":
            v = a[1]
            if not any(s[0] == "p" for s in senders.get(f"d{v}", ())):
                out.append((a, _mark_p_lost(v)))
        elif a[0] == "d_lost":
            i, d = a[1], a[2]
            dead = {f"d{v}" for v in w.s.d_workers_of(d)}
            if dead & senders.get(f"p{i}", set()):
                continue
            rank = i // w.s.tp
            if all(q.p_added or q.d_blocks is None for q in w.s.reqs
                   if q.d_rank == d and q.p_rank == rank):
                out.append((a, _mark_d_lost(i, d)))
    return out


def _mark_p_lost(v: int) -> Callable[[World], None]:
    def mark(w: World) -> None:
        w.s.p_lost_seen[v] = True
    return mark


def _mark_d_lost(i: int, d: int) -> Callable[[World], None]:
    def mark(w: World) -> None:
        w.s.d_lost_seen.add((i, d))
    return mark


def key_if(w: World, mark: Callable[[World], None]) -> tuple:
    """The key ``w`` would have after ``mark`` (applied to a scratch copy of the flags)."""
    p_seen, d_seen = list(w.s.p_lost_seen), set(w.s.d_lost_seen)
    mark(w)
    try:
        return w.key()
    finally:
        w.s.p_lost_seen, w.s.d_lost_seen = p_seen, d_seen
