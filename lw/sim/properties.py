"""The properties the checker establishes (docs/design.md section 4) and the violation they
raise; the world checks them (lw.sim.checks)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
             "exactly the blocks its chunk completes, once the forward pass computed it), each "
             "head into that head's own slot of D's block"),
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
    Property("first-token-bound", "first token", "always",
             "P's first token is used only for the request, claim epoch and sampling spec it "
             "was drawn for: D's core takes it only under the request's current epoch, and "
             "the client is streamed only a token of its own request, of the epoch D holds, "
             "drawn with the spec it asked for (first_token_from_p)"),
    Property("first-token-continuation", "first token", "always",
             "every token after the first follows the one the client was streamed: D decodes "
             "on, or recomputes after a failed transfer, from the client's first token "
             "(first_token_from_p)"),
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
             "with faults, some deadline, lease or retry timer fires (with stalls only: some "
             "peer stalls, and no timer need fire)"),
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
