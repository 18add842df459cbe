"""Bounds and shape of a checker world: its configuration, sender plan and KV layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lw.fsm import DecodeConfig, PrefillConfig
from lw.fsm.kvmap import expected_senders, make_format, targets_of, tp_problem
from lw.fsm.messages import KVFormat, KVLayout, LayerLayout
from lw.fsm.settings import core_config
from lw.sim.variants import DESIGNS

Action = tuple  # ("kind", *args): hashable, replayable
Owner = tuple[str, int]  # ("p", P worker) or ("d", D worker)
# A write in flight: (req index, seq, local blocks, remote blocks, D worker, deadline,
# incarnation of the D layout it was addressed with); seq = chunk * layers + layer, the
# WriteLayer's number within its request (the layer, for a request prefilled in one chunk)
Write = tuple[int, int, tuple[int, ...], tuple[int, ...], int, float, int]
HEAD_BYTES = 4096  # bytes of one KV head in one block (layouts only; no bytes are moved)

# "forge": the proxy starts a request's prefill with D block ids D did not register for it (a
# forged or mistaken metaserver call); not among the default kinds, which are the faults of
# processes and the network. "rank-crash": one P DP rank dies (a P server of several, with
# retry_prefill: the failover target of the others' requests), also not a default kind.
# "corrupt" (with kv_checksum): every block a D worker holds so far reads wrong, the bytes of a
# bad transfer (a corrupted or misdirected write), which D's checksums must catch.
# "stall": a live peer a worker's requests need is silent for stall_s, well past the heartbeat
# floor and under its cap (starved of CPU, paused by its GC), while its connection stays up:
# the detector's verdict runs on those facts; slow is not a fault, so it excuses no failure.
# "fence-fail" (with fence_data): a data-plane fence D asked for does not hold in time (the
# transport did not close what it cut), so D keeps the blocks and asks again later.
FAULT_KINDS = ("drop", "dup", "write", "crash", "abort", "forge", "rank-crash", "corrupt",
               "stall", "fence-fail")
DEFAULT_FAULT_KINDS = ("drop", "dup", "write", "crash", "abort")
FAULT_ACTIONS = frozenset({"drop", "dup", "fail_write", "crash_p", "crash_d", "abort_d",
                           "abort_p", "forge", "crash_rank", "corrupt", "stall",
                           "fence_fail"})
EPSILON = 0.001  # abstract time: "just before" a deadline (below every timer's duration)


@dataclass(frozen=True)
class PlaneModel:
    """What the checker takes as measured of one data plane (benchmarks/late_landing.py):
    whether D can fence it from a sender, and whether a fence that returned stops its bytes."""

    title: str
    fence: bool  # D has a fence on this plane (its DecodeConfig.fence_data follows)
    fence_holds: bool  # once the fence returned, no byte of the senders it cut lands
    measured: str  # the figures behind it


PLANES: dict[str, PlaneModel] = {
    "mooncake": PlaneModel(
        "Mooncake over TCP", fence=True, fence_holds=True,
        measured="a failed write's bytes landed up to 83 s after its report (30 % loss); after "
                 "fence_inbound returned (P's engine dropped) no block changed"),
    "nixl": PlaneModel(
        "NIXL (UCX over TCP)", fence=False, fence_holds=False,
        measured="a failed write's bytes landed up to 38.6 s after its report (40 % loss); "
                 "after D removed P's agent or deregistered the memory P writes, up to 109 "
                 "and 120 block changes came; no candidate fence is built (cutting UCX's sockets "
                 "stopped them but never completes, destroying D's agent changes its session)"),
}
"""The data planes whose semantics the checker knows (WorldConfig.data_plane)."""


@dataclass(frozen=True)
class WorldConfig:
    """Bounds and switches of one world (everything the explorer's verdict depends on)."""

    design: str = "d-first"
    dp: int = 2  # P DP ranks
    tp: int = 1  # P workers per DP rank (TP); each writes the D TP ranks kvmap.targets_of says
    requests: int = 2
    layers: int = 2
    d_dp: int = 1  # D engines; request i goes to D engine i mod d_dp, P rank i mod dp
    d_tp: int = 1  # D TP workers per D engine (one scheduler, one block pool, shared block ids)
    d_blocks: int = 1  # blocks per D engine
    p_blocks: int = 1  # blocks per P rank
    blocks_per_request: int = 1
    # P engine steps a request's prefill takes (chunked prefill, one chunk per step); its sent
    # blocks complete chunk by chunk (chunk_sizes) and are pushed as each chunk computes them.
    chunks: int = 1
    mla: bool = False  # latent KV (one head replicated on every rank): one writer per D worker
    heads: int = 0  # the model's KV heads; 0: lcm(tp, d_tp) (MLA: the one latent head)
    # Per request index: how many of its first blocks D already holds in its prefix cache (not
    # written by P; missing entries 0). blocks_per_request is a full hit: nothing to transfer.
    prefix_hits: tuple[int, ...] = ()
    faults: bool = False
    fault_kinds: tuple[str, ...] = DEFAULT_FAULT_KINDS
    max_faults: int = 1
    # With faults, the clock may also move at any time (arbitrary delays: any timer may fire
    # before pending work, and the world may idle until just before the next deadline). Off: the
    # clock only moves when nothing else can (timely delivery), where progress is checked.
    delays: bool = True
    # With delays, the world may idle to just before D's next deadline before P's next step for
    # that request (lw.sim.clock): timers fire in any order the real system allows.
    abstract_time: bool = True
    d_restarts: int = 0  # a crashed D engine may start again, with a new incarnation and layout
    # Blocks and layers D's layout registers (0: d_blocks, layers): a misconfigured D, for tests
    # that P never writes outside D's pool or with a layout of another size.
    d_layout_blocks: int = 0
    d_layout_layers: int = 0
    retries: int = 2  # meta_attempts and ack_attempts of P (small keeps the space finite)
    atomic_layers: bool = True  # the lock-step layer of all ranks as one action (sound reduction)
    wire: bool = True  # every delivered message crosses the real byte encoding
    # After a P crash its in-flight writes may still land (until transfer_timeout_s after the
    # crash), as bytes of a write that failed "in doubt" may (see zombies in World).
    crash_zombies: bool = True
    # D calls peer_lost when it learns that the P engine died (core finding 2 in
    # docs/checker-findings.md); off: D relies on its deadline and lease alone.
    p_loss_detection: bool = True
    # P's DONE carries checksums of what it wrote; D verifies its blocks against them (the
    # endpoints' kv_checksum); the world tracks which claim's bytes each D block holds.
    kv_checksum: bool = False
    # The data plane may complete (or fail) a P worker's writes in any order, not only in
    # submission order (transports whose transfers complete independently: several sender
    # threads or rails, per-transfer handles). lw's own data plane reports a destination's
    # writes in submission order (lw.transport.dataplane.base).
    unordered_writes: bool = False
    # Bytes of a write that failed in doubt may land at any later moment while that D process
    # lives (not only within transfer_timeout_s): past D's lease, into blocks of another claim.
    late_writes: bool = False
    # D fences the data plane from the senders of an epoch whose lease ended before it frees or
    # reuses their blocks (DecodeConfig.fence_data); the fence completes at any later moment
    # and cuts the in-doubt bytes of those senders to that worker (lw's design: late bytes
    # are not bounded in time on a lossy TCP link).
    fence_data: bool = True
    fence_s: float = 5.0  # the longest a fence takes to hold (the runtime's fence timeout)
    # The data plane's measured semantics (PLANES): whether D can fence it at all, and whether
    # its fence stops in-flight bytes. fence_data asks for a fence only where the plane has one.
    data_plane: str = "mooncake"
    fence_retry_s: float = 2.0  # D's DecodeConfig.fence_retry_s: a failed fence asked again
    # D's prefill retry budget (DecodeConfig.retry_prefill): a request whose P rank was lost is
    # prefilled again on another rank under a new claim epoch. With it, each DP rank is a P
    # engine of its own (engine id P<rank>): one rank dies ("rank-crash") while the others live.
    retry_prefill: int = 0
    # D's retry_fresh_blocks: a retried epoch whose old senders may still write receives into
    # blocks D's scheduler allocates from its pool when enough are free (lowest first), else it
    # is fenced; the old blocks stay held until D releases them (ReleaseBlocks).
    retry_fresh_blocks: bool = False
    meta_retry_s: float = 1.0
    ack_retry_s: float = 1.0
    request_timeout_s: float = 30.0
    ahead_wait_s: float = 5.0  # P drops a prefill computed ahead and not bound by then
    prefill_timeout_s: float = 60.0
    lease_s: float = 90.0
    transfer_timeout_s: float = 10.0
    # The liveness detector's facts for a "stall": the budget a peer with no history gets (the
    # floor: heartbeat_s x heartbeat_misses), the cap, and how long the stalled peer is silent.
    # P resends MetaRequests and DONE past its attempts until the request deadline (drivers with
    # heartbeats on: a silent D is judged by the liveness verdict, not by a count).
    resend_until_deadline: bool = False
    heartbeat_floor_s: float = 1.5
    heartbeat_cap_s: float = 30.0
    stall_s: float = 15.0
    # Both cores' first_token_from_p: P's scheduler hands each request's sampled first token to
    # its workers (at any moment after the prefill's last step), TP rank 0 sends it to D, and
    # D's scheduler streams it to the client and decodes on from it (lw.sim.tokens).
    first_token_from_p: bool = False
    # Requests whose P samples with other parameters than the client asked for (a proxy that
    # did not pass them on): D's scheduler must not use that token.
    first_token_other_spec: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ValueError(f"unknown design {self.design!r}; one of {', '.join(DESIGNS)}")
        for name in ("dp", "tp", "requests", "layers", "d_dp", "d_tp", "blocks_per_request",
                     "chunks", "retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("d_blocks", "p_blocks"):
            if getattr(self, name) < self.blocks_per_request:
                raise ValueError(f"{name} must be >= blocks_per_request")
        for name in ("max_faults", "d_restarts", "d_layout_blocks", "d_layout_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        bad = set(self.fault_kinds) - set(FAULT_KINDS)
        if bad:
            raise ValueError(f"unknown fault kinds {sorted(bad)}; known: {', '.join(FAULT_KINDS)}")
        if self.data_plane not in PLANES:
            raise ValueError(f"unknown data plane {self.data_plane!r}; one of "
                             f"{', '.join(PLANES)}")
        d = DESIGNS[self.design]
        if self.retry_prefill and (self.d_tp != 1 or not (d.d_first or d.ahead)):
            raise ValueError("retry_prefill needs D TP 1 and lw's D-first or compute-ahead "
                             "design (each D worker decides its own retries; the world routes "
                             "one prefill per request)")
        if d.ahead and self.tp != 1:
            raise ValueError("a design that computes ahead needs P TP 1 (each P worker decides "
                             "its own bind; the world binds one per request)")
        if self.heads < 0:
            raise ValueError(f"heads must be >= 0, got {self.heads}")
        for side, n in (("P", self.tp), ("D", self.d_tp)):
            problem = tp_problem(n, self.kv_heads(), self.mla)
            if problem:
                raise ValueError(f"{side} TP {n}: {problem}")
        if len(self.prefix_hits) > self.requests:
            raise ValueError(f"{len(self.prefix_hits)} prefix hits given for "
                             f"{self.requests} requests")
        for h in self.prefix_hits:
            if not 0 <= h <= self.blocks_per_request:
                raise ValueError(f"a prefix hit must be 0..blocks_per_request="
                                 f"{self.blocks_per_request} blocks, got {h}")
        if self.first_token_other_spec and not self.first_token_from_p:
            raise ValueError("first_token_other_spec needs first_token_from_p")
        if any(not 0 <= i < self.requests for i in self.first_token_other_spec):
            raise ValueError(f"first_token_other_spec names requests outside 0.."
                             f"{self.requests - 1}")
        for i in range(self.requests):
            n = self.blocks_per_request - self.hit(i)
            if 0 < n < self.chunks - 1:
                raise ValueError(f"request {i} sends {n} block(s) in {self.chunks} chunks: only "
                                 "the first chunk may complete no block (blocks_per_request "
                                 "minus its prefix hit must be >= chunks - 1)")

    def chunk_sizes(self, n: int) -> tuple[int, ...]:
        """How many of a request's ``n`` sent blocks (those after D's prefix hit) each chunk
        completes, in prompt order: every chunk after the first completes max(1, n // chunks),
        the first the rest, possibly none (the core announces an empty chunk only as the
        first: the request is added with no local block, its layers are not reported). A full
        hit (n = 0) sends nothing in any chunk."""
        k = self.chunks
        if n == 0:
            return (0,) * k
        later = max(1, n // k)
        return (n - (k - 1) * later, *(later,) * (k - 1))

    def d_blocks_registered(self) -> int:
        """Blocks D's layout registers (its pool, unless misconfigured)."""
        return self.d_layout_blocks or self.d_blocks

    def misconfigured(self) -> bool:
        """D's layout does not match its pool or the model (requests may fail cleanly)."""
        return (self.d_layout_blocks not in (0, self.d_blocks)
                or self.d_layout_layers not in (0, self.layers))

    def progress_budget(self) -> int:
        """P's retry budget where the progress property is checked (timely clock, not
        misconfigured), else 0: what a request's faults and losses matter up to."""
        return self.retries if self.timely() and not self.misconfigured() else 0

    def timely(self) -> bool:
        """The clock only moves when nothing else can: progress is required (see properties)."""
        return not (self.faults and self.delays)

    def kv_heads(self) -> int:
        """The model's KV heads in this world (MLA: one latent head)."""
        if self.mla:
            return 1
        return self.heads or math.lcm(self.tp, self.d_tp)

    def hit(self, idx: int) -> int:
        """Blocks of request ``idx`` that D already holds in its prefix cache."""
        return self.prefix_hits[idx] if idx < len(self.prefix_hits) else 0

    def prefill_config(self) -> PrefillConfig:
        """The P endpoints' deadlines and retry budgets in this world (one budget, ``retries``,
        for both; no timeline: observability only, the checker needs none)."""
        return core_config(PrefillConfig, vars(self), meta_attempts=self.retries,
                           ack_attempts=self.retries, timeline_entries=0)

    def plane(self) -> PlaneModel:
        """The measured semantics of this world's data plane."""
        return PLANES[self.data_plane]

    def fences(self) -> bool:
        """D fences the data plane at a lease's end: fence_data, on a plane that has a fence
        (or a design whose quirk gives it one that returns early)."""
        return self.fence_data and (self.plane().fence
                                    or "fence-returns-early" in DESIGNS[self.design].quirks)

    def fence_holds(self) -> bool:
        """A fence that returned stops every byte of the senders it cut."""
        return (self.plane().fence_holds
                and "fence-returns-early" not in DESIGNS[self.design].quirks)

    def quarantine_s(self) -> float:
        """The longest D holds a lost epoch's blocks: its lease, then a fence."""
        if not self.fences():
            return self.lease_s
        # each fence that does not hold (fault "fence-fail") costs a retry and another fence
        fails = self.max_faults if "fence-fail" in self.fault_kinds and self.faults else 0
        return self.lease_s + self.fence_s + fails * (self.fence_retry_s + self.fence_s)

    def decode_config(self) -> DecodeConfig:
        """The D endpoints' deadline and lease in this world (no timeline, as for P)."""
        return core_config(DecodeConfig, vars(self), timeline_entries=0,
                           fence_data=self.fences())

    def bounds(self) -> str:
        """One line with the bounds, for reports."""
        kinds = ",".join(self.fault_kinds) or "none"
        delays = ((" + arbitrary delays (abstract time)" if self.abstract_time else
                   " + arbitrary delays (timers at fixed values)") if self.delays
                  else ", timely clock")
        faults = (f"faults {kinds} (at most {self.max_faults}){delays}" if self.fault_kinds
                  else f"no injected faults{delays}") if self.faults else "no faults"
        if self.d_restarts:
            faults += f", D restarts {self.d_restarts}"
        if self.late_writes:
            faults += ", in-doubt bytes may land at any later time (late writes)"
        if self.data_plane != "mooncake":  # (Mooncake's lines read as before planes)
            faults += f", data plane {self.plane().title}" + (
                "" if self.fences() or not self.fence_data else " (lease only: no fence)")
        if self.kv_checksum:
            faults += ", KV checksums"
        if self.unordered_writes:
            faults += ", writes complete in any order"
        if self.resend_until_deadline:
            faults += ", P resends until its deadline"
        if self.retry_prefill:
            faults += f", prefill failover (budget {self.retry_prefill}" + (
                ", fresh blocks)" if self.retry_fresh_blocks else ")")
        if self.first_token_from_p:
            other = (f" (r{', r'.join(map(str, self.first_token_other_spec))} sampled with "
                     "other parameters)") if self.first_token_other_spec else ""
            faults += f", first token from P{other}"
        if self.misconfigured():
            faults += (f", D layout registers {self.d_blocks_registered()} block(s) x "
                       f"{self.d_layout_layers or self.layers} layer(s)")
        tp = f" x TP {self.tp}" if self.tp > 1 else ""
        d_tp = f" x TP {self.d_tp}" if self.d_tp > 1 else ""
        extra = ""
        if self.mla:
            extra += "MLA, "
        elif self.heads or self.tp > 1 or self.d_tp > 1:
            extra += f"{self.kv_heads()} KV head(s), "
        if any(self.prefix_hits):
            extra += f"D prefix hits {list(self.prefix_hits)} block(s), "
        if self.chunks > 1:
            extra += f"{self.chunks} chunks/request, "
        return (f"P DP ranks {self.dp}{tp}, requests {self.requests}, layers {self.layers}, "
                f"D ranks {self.d_dp}{d_tp} x {self.d_blocks} block(s), P {self.p_blocks} "
                f"block(s)/rank, {self.blocks_per_request} block(s)/request, {extra}{faults}")


@dataclass(frozen=True)
class Plan:
    """Who writes what (from lw.fsm.kvmap): per TP rank formats, targets and expected senders."""

    p_fmts: tuple[KVFormat, ...]  # per P TP rank
    d_fmts: tuple[KVFormat, ...]  # per D TP rank
    targets: tuple[tuple[int, ...], ...]  # per P TP rank: the D TP ranks it writes into
    senders: tuple[frozenset[int], ...]  # per D TP rank: the P TP ranks that write into it

    @classmethod
    def of(cls, cfg: WorldConfig) -> Plan:
        """The sender plan of a world's P and D TP layouts."""
        def fmt(rank: int, size: int) -> KVFormat:
            return make_format(tp_rank=rank, tp_size=size, total_heads=cfg.kv_heads(),
                               block_tokens=1, dtype="bytes", mla=cfg.mla)

        p_fmts = tuple(fmt(t, cfg.tp) for t in range(cfg.tp))
        d_fmts = tuple(fmt(j, cfg.d_tp) for j in range(cfg.d_tp))
        return cls(p_fmts, d_fmts, tuple(targets_of(f, cfg.d_tp) for f in p_fmts),
                   tuple(expected_senders(f, cfg.tp) for f in d_fmts))


def d_addr(v: int) -> str:
    """Side-channel address of D worker ``v`` (engine v // d_tp, TP rank v % d_tp)."""
    return f"d{v}"


def p_addr(i: int) -> str:
    """Side-channel address of P rank ``i``."""
    return f"p{i}"


def _layout(cfg: WorldConfig, v: int, fmt: KVFormat, incarnation: int = 1) -> KVLayout:
    """D worker ``v``'s KV layout: one block of HEAD_BYTES per head it holds, per layer (a new
    incarnation registers its memory at other addresses)."""
    n = HEAD_BYTES * (fmt.head_hi - fmt.head_lo)
    base = 0x1000_0000 * incarnation
    layers = [LayerLayout(base + k * 0x100_0000, n, n, cfg.d_blocks_registered())
              for k in range(cfg.d_layout_layers or cfg.layers)]
    return KVLayout("D", incarnation, f"d{v}-te:15000", layers, fmt)


def _p_layout(cfg: WorldConfig, w: int, fmt: KVFormat) -> KVLayout:
    """P worker ``w``'s own KV layout (its format is what its MetaRequests carry)."""
    n = HEAD_BYTES * (fmt.head_hi - fmt.head_lo)
    layers = [LayerLayout(0x2000_0000 + k * 0x100_0000, n, n, cfg.p_blocks)
              for k in range(cfg.layers)]
    return KVLayout("P", 1, f"p{w}-te:16000", layers, fmt)


def _who(addr: str) -> str:
    return addr[0].upper() + addr[1:]


def _owner(o: int | None) -> str:
    return "free" if o is None else f"owned by r{o}"
