"""The properties the checker establishes (docs/design.md section 4), and the explanation of a
stuck state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from lw.sim.world import World


@dataclass(frozen=True)
class Property:
    """One checked property: its id (printed on violation), docs/design.md property and meaning."""

    id: str
    item: str
    kind: str  # "always" (every state), "eventually" (terminal states), "sometimes" (vacuity)
    text: str


PROPERTIES: tuple[Property, ...] = (
    Property("forward-never-waits", "property 1", "always",
             "a layer hook returns without waiting on the network, and every DP rank makes the "
             "same sequence of collective calls (a step in progress can always take its next "
             "layer)"),
    Property("use-after-free", "property 2", "always",
             "no P or D block is freed or reused while a transfer into or out of it may still "
             "happen (in flight, or still to be submitted by a live request)"),
    Property("write-before-accept", "property 2", "always",
             "P writes into a D worker's blocks only after that worker answered its MetaRequest "
             "with 'accepted', and only where the sender plan (lw.fsm.kvmap) says it writes"),
    Property("cached-block-written", "property 2", "always",
             "P never writes a D block that D serves from its prefix cache"),
    Property("kv-placement", "property 3", "always",
             "each write sends the KV of the tokens D misses (P's blocks after the prefix hit) "
             "into the D blocks that hold those tokens, block for block (chunked prefill: "
             "exactly the blocks its chunk completes, once the forward pass computed it)"),
    Property("layout-match", "property 2", "always",
             "a write is addressed with its D worker's current layout (an earlier "
             "incarnation's write fails), inside D's registered blocks, with as many layers as "
             "P computes and byte runs that fit both blocks"),
    Property("p-memory-bounded", "property 1", "always",
             "P holds no KV outside its block pool: writes read the request's own blocks, no "
             "staged copy queues up while D is slower than compute"),
    Property("partial-kv", "property 3", "always",
             "D reports a request finished only when every expected sender's write of every "
             "layer of every block has landed, whichever chunk made it, and none is still in "
             "flight (per D TP worker, and for the engine only when every one of its TP workers "
             "is DONE)"),
    Property("stale-kv", "property 7", "always",
             "fencing: no request is reported loaded while one of its D blocks holds bytes of "
             "another claim, late writes of superseded claims included (checked where the world "
             "tracks D's memory: kv_checksum or late_writes)"),
    Property("double-free", "property 4", "always", "each block is freed exactly once"),
    Property("reported-twice", "property 4", "always",
             "no request is reported finished (sending or receiving) twice"),
    Property("core-protocol-error", "all", "always",
             "the core never raises ProtocolError (an event its own table says is impossible)"),
    Property("deadlock", "property 5", "eventually",
             "no reachable state is stuck: when no action is enabled every request is final "
             "on both sides (otherwise the cycle of waits is printed)"),
    Property("request-ends", "property 5", "eventually",
             "every request reaches DONE or FAILED on both live sides, reported exactly once, "
             "within its deadlines"),
    Property("no-deadline-without-faults", "property 5", "always",
             "without faults no timer ever fires (no deadline, retry or lease is needed)"),
    Property("blocks-return", "property 6", "eventually",
             "when traffic stops every P and D block is back in its pool, nothing quarantined"),
    Property("progress", "property 5", "eventually",
             "with a timely clock, every request ends DONE unless a fault touched it: without "
             "faults no request fails, and k < retry-budget message losses never fail one; a "
             "crash, abort or failed write of one request or D never fails another"),
    Property("sometimes-done", "vacuity", "sometimes",
             "some request reaches DONE on both sides"),
    Property("sometimes-deadline", "vacuity", "sometimes",
             "with faults, some deadline, lease or retry timer fires"),
)

PROPERTY_BY_ID: dict[str, Property] = {p.id: p for p in PROPERTIES}


@dataclass
class Violation(Exception):
    """A property failed in the current state (or transition)."""

    prop: str
    message: str
    details: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prop not in PROPERTY_BY_ID:
            raise ValueError(f"unknown property {self.prop!r}")
        super().__init__(f"{self.prop}: {self.message}")

    def headline(self) -> str:
        """One line naming the property (the word the CLI prints) and what happened."""
        return f"VIOLATION {self.prop} ({PROPERTY_BY_ID[self.prop].item}): {self.message}"


def explain_stuck(w: World) -> list[str]:
    """Why nothing can move: the cycle of waits if there is one, else what each party waits for."""
    edges: dict[str, list[str]] = {}
    label: dict[str, str] = {}

    def edge(a: str, b: str) -> None:
        edges.setdefault(a, [])
        if b not in edges[a]:
            edges[a].append(b)

    blocked = w.blocked_hooks()  # rank -> requests it waits for in its hook
    stepping = w.phase is not None and w.p_alive
    for wk in range(len(w.p)):
        node = f"P{wk}"
        if wk in blocked:
            label[node] = (f"{w.wname(wk)} is blocked inside the layer-{w.phase} save hook, "
                           f"waiting for D's metadata of {', '.join(blocked[wk])}")
            for rid in blocked[wk]:
                edge(node, f"meta:{rid}")
        elif stepping and blocked:
            others = sorted(blocked)
            label[node] = (f"{w.wname(wk)} passed its layer-{w.phase} hook and waits in the "
                           f"layer-{w.phase} collective for "
                           f"{', '.join(w.wname(o) for o in others)}")
            for o in others:
                edge(node, f"P{o}")
    for q in w.reqs:
        rid = q.rid
        if q.d_stage == "waiting":
            d = q.d_rank
            holders = sorted({o for o in w.d_pool[d] if o is not None})
            dn = w.dname(d)
            label[f"meta:{rid}"] = (f"{rid} has no D metadata: it waits in {dn}'s queue for a "
                                    f"free block ({dn} has {len(w.d_pool[d])} block(s), all "
                                    f"held)" if holders else
                                    f"{rid} waits in {dn}'s queue for a free block")
            for h in holders:
                edge(f"meta:{rid}", f"req:r{h}")
        if q.d_stage == "allocated" and q.d_blocks is not None:
            d = q.d_rank
            blocks = list(q.d_blocks)
            writers = sorted({wk for v in w.d_workers_of(d) for wk in w.writers(q, v)})
            senders = [f"P{wk}" for wk in writers]
            who = " and ".join(w.wname(wk) for wk in writers) or "nobody"
            label[f"req:{rid}"] = (f"{w.dname(d)} block(s) {blocks} are held by {rid}, which "
                                   f"waits for its KV from {who}")
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
    lines += [f"  {line}" for line in w.summary()]
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
