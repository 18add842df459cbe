"""Configuration of a synthetic P/D cluster run and the faults it can inject."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lw.fsm import DecodeConfig, PrefillConfig, check_lease
from lw.fsm.kvmap import make_format, tp_problem
from lw.fsm.messages import KVFormat
from lw.fsm.settings import core_config
from lw.transport.dataplane.planes import PLANE_NAMES, can_fence
from lw.transport.loopconfig import LoopConfig
from lw.transport.sidechannel import parse_cluster_key

FAULTS: dict[str, str] = {
    "none": "no fault",
    "kill-decoder": "SIGKILL the decoder mid-transfer, then start a new incarnation on its port "
    "(with --decoders > 1: SIGKILL one decoder while it holds requests at every stage; the "
    "proxy moves those that streamed no token yet to a live decoder and avoids the dead one)",
    "freeze-decoder-before-contact": "decoder SIGSTOPs itself after allocating, before any P "
    "contact; SIGCONT later",
    "freeze-decoder-mid-transfer": "SIGSTOP the decoder while layers are in flight; SIGCONT later",
    "freeze-kill-decoder": "SIGSTOP the decoder while layers are in flight; SIGKILL it later and "
    "start a new incarnation",
    "kill-prefill-rank": "the last P DP rank SIGKILLs itself in the middle of a step",
    "drop-messages": "every side channel drops 15% of its outgoing frames",
    "duplicate-messages": "every side channel sends 30% of its messages twice",
    "garbage-messages": "every side channel replaces 10% of its payloads by garbage",
    "no-cluster-key": "the last P DP rank has no cluster key (the others and D have one)",
    "partition-before-contact": "the link between P and D (decoder in its own network "
    "namespace) is cut before any request, healed after freeze_s",
    "partition-mid-transfer": "the link is cut while layers are in flight and healed after "
    "partition_s (shorter than the heartbeat budget: transfers resume)",
    "partition-long": "the link is cut while layers are in flight for longer than every "
    "deadline (long_partition_s), then healed",
    "lossy-link": "the decoder behind a userspace link (two TUN devices and a relay, the kernel "
    "has no sch_netem) that drops link_loss (30%) of the packets in each direction, the whole run",
    "slow-link": "the same userspace link delivers every packet from P to D link_delay_s (200 ms) "
    "late, the whole run (one direction, like netem on P's interface: RTT +200 ms)",
    "mix": "drop 5%, duplicate 10% and garble 3% of side-channel frames, and land shifted "
    "bytes in every 61st write, all at once (the soak's fault mix; use --kv-checksum)",
    "corrupt-write": "every 7th layer write of each P worker lands bytes shifted by one "
    "(caught by D's pattern check; with --kv-checksum, by the checksums first)",
}
ALIASES = {"drop": "drop-messages", "duplicate": "duplicate-messages",
           "garbage": "garbage-messages", "no-key": "no-cluster-key"}
PARTITION_FAULTS = frozenset({"partition-before-contact", "partition-mid-transfer",
                              "partition-long"})
# Faults of the link itself: the decoder's namespace is joined by TUN devices and a relay.
LINK_FAULTS = frozenset({"lossy-link", "slow-link"})
# ... run with deadlines sized for such a link, as a deployment on one would set them: a cap
# its backlog fits (40 requests of 2 MiB over the slow link's ~5 MB/s take ~16 s), a progress
# timeout that still ends a stuck request in seconds, D's deadline above P's cap, and a
# transfer timeout over TCP's retransmission back-off (the lease and the settling follow).
LINK_DEADLINES = {"request_timeout_s": 20.0, "progress_timeout_s": 8.0,
                  "prefill_timeout_s": 24.0, "transfer_timeout_s": 10.0,
                  "settle_timeout_s": 45.0}
# Faults that need the decoder in its own network namespace (root, iproute2).
NETNS_FAULTS = PARTITION_FAULTS | LINK_FAULTS
PROCESS_FAULTS = frozenset({"kill-decoder", "freeze-decoder-before-contact",
                            "freeze-decoder-mid-transfer", "freeze-kill-decoder",
                            "kill-prefill-rank"}) | NETNS_FAULTS
DECODER_RESTARTS = frozenset({"kill-decoder", "freeze-kill-decoder"})  # with one decoder
# Faults aimed at "the decoder" (frozen, or alone in a network namespace): one decoder only.
ONE_DECODER_FAULTS = frozenset({"freeze-decoder-before-contact", "freeze-decoder-mid-transfer",
                                "freeze-kill-decoder"}) | NETNS_FAULTS
# Faults after which failed requests are expected (every request must still be accounted for).
FAILURES_EXPECTED = frozenset({"kill-decoder", "freeze-decoder-before-contact",
                               "freeze-decoder-mid-transfer", "freeze-kill-decoder",
                               "kill-prefill-rank",
                               "drop-messages", "garbage-messages", "no-cluster-key",
                               "corrupt-write", "mix", *PARTITION_FAULTS,
                               # Mooncake's TCP writes stall behind retransmission timeouts
                               # (loss) or take round trips of 200 ms each (delay): longer than
                               # the demo's deadlines (docs/benchmarks.md)
                               *LINK_FAULTS})


DATA_PLANES = PLANE_NAMES
"""The data planes a synthetic cluster runs on (``--data-plane``)."""
PROCESS_PLANES = frozenset({"mooncake", "nixl"})
"""Planes whose engines are OS processes (they move bytes between address spaces)."""
FENCED_PLANES = frozenset(p for p in PLANE_NAMES if can_fence(p))
"""Planes D may fence (cut a failed sender's in-flight writes; over TCP, as the synthetic
cluster runs them); the others are lease-only."""


def canonical_fault(name: str) -> str:
    """The fault's full name; ValueError for unknown names."""
    name = ALIASES.get(name, name)
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose from {', '.join(FAULTS)}")
    return name


@dataclass
class ClusterConfig:
    """Shape, deadlines and fault of one synthetic cluster run (picklable for spawned workers)."""

    requests: int = 40
    prefill_dp: int = 2
    prefill_tp: int = 1  # TP worker threads per P DP rank, each holding its KV heads
    decode_tp: int = 1  # TP worker threads of the decoder, sharing one block pool
    # D engines, each with decode_tp workers and its own pool of d_blocks; the proxy spreads
    # the requests over them (lw.lab.synthetic.router)
    decoders: int = 1
    # Tokens D decodes after verifying a request's KV, one every token_ms, each streamed to the
    # client: whether a token was streamed decides whether a request may move to another D.
    # -1: 8 with several decoders, 0 with one (a request is done once verified, as before)
    decode_tokens: int = -1
    token_ms: float = 5.0
    mla: bool = False  # latent KV: one vector per token, identical on every TP rank
    kv_heads: int = 0  # KV heads of the model (0: max(prefill_tp, decode_tp); 1 with MLA)
    layers: int = 8
    blocks_per_request: int = 4
    # P computes each prompt in this many steps (chunked prefill; at most one per block): with
    # push_mode "progressive" each chunk's blocks are written while that chunk computes
    chunks: int = 1
    push_mode: str = "progressive"  # or "last_chunk": every block is written in the last chunk
    block_bytes: int = 64 * 1024  # one block of one layer, all KV heads (MLA: the latent)
    d_blocks: int = 64  # the decoder's finite block pool
    p_blocks: int = 64  # per P rank
    max_batch: int = 4  # new requests a P rank admits per step
    layer_ms: float = 2.0  # simulated compute per layer (the forward pass sleeps, GIL released)
    # "mooncake" or "nixl" (every engine an OS process), or "inprocess" (every worker a thread
    # of this process)
    data_plane: str = "mooncake"
    fault: str = "none"
    cluster_key: bytes | None = None
    seed: int = 0
    window: int = 0  # requests outstanding at each D at once (0: what its pool can hold)
    # deadlines (short, so that faults resolve in seconds)
    meta_retry_s: float = 0.2
    meta_attempts: int = 15
    ack_retry_s: float = 0.2
    ack_attempts: int = 10
    request_timeout_s: float = 4.0
    progress_timeout_s: float = 0.0  # P fails a request with no progress this long (0: off)
    prefill_timeout_s: float = 6.0
    transfer_timeout_s: float = 5.0  # Mooncake's MC_TRANSFER_TIMEOUT (5 is its minimum)
    lease_margin_s: float = 1.0
    freeze_s: float = 6.0  # how long a frozen decoder stays stopped
    partition_s: float = 1.0  # partition-mid-transfer: cut, then healed after this long
    long_partition_s: float = 12.0  # partition-long: longer than every deadline
    link_loss: float = 0.3  # lossy-link: probability that a packet is dropped, each direction
    link_delay_s: float = 0.2  # slow-link: one-way delay of every packet from P to D
    # where workers listen (a partition fault puts the decoder in its own namespace)
    p_host: str = "127.0.0.1"
    d_host: str = "127.0.0.1"
    d_netns: str = ""
    run_timeout_s: float = 180.0
    settle_timeout_s: float = 30.0  # after the last request: wait for blocks to come back
    barrier_timeout_s: float = 60.0
    log_dir: str | None = None
    kv_checksum: bool = False  # P sends per-block CRC-32C with DONE, D verifies them
    abort_rate: float = 0.0  # probability that the client aborts a request soon after D has it
    heartbeat_s: float = 0.5  # liveness probes between workers sharing requests (0: off)
    heartbeat_misses: int = 3  # the floor of a peer's silence budget, in intervals
    heartbeat_cap_s: float = 30.0  # the most that budget grows to (lw.transport.liveness)
    # prefill failover (DecodeConfig's names): re-prefills per request on another P rank when
    # its rank is lost, and which ranks a re-prefill avoids
    retry_prefill: int = 0
    retry_prefill_avoid: str = "lost"
    # a retry whose lost epoch may still write receives into fresh blocks of the pool (the old
    # ones quarantined until its senders stopped or the lease ended); off: it is fenced first
    retry_fresh_blocks: bool = True
    status: bool = False  # print an lw status table of every worker while the fault is active
    trace_out: str | None = None  # write every worker's request timelines here (Chrome trace)
    timelines_out: str | None = None  # write every worker's timeline here (lw-trace, validate)

    def __post_init__(self) -> None:
        self.fault = canonical_fault(self.fault)
        self.cluster_key = parse_cluster_key(self.cluster_key)
        if self.fault == "no-cluster-key" and self.cluster_key is None:
            raise ValueError("fault no-cluster-key needs a cluster key")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES)}, got "
                             f"{self.data_plane!r}")
        if self.data_plane == "inprocess" and self.fault in PROCESS_FAULTS:
            raise ValueError(f"fault {self.fault} kills or stops processes: it needs "
                             "--data-plane mooncake or nixl")
        if self.fault == "no-cluster-key" and self.prefill_dp < 2:
            raise ValueError("no-cluster-key needs --prefill-dp >= 2 (one keyed rank must remain)")
        if self.decoders < 1:
            raise ValueError(f"decoders must be >= 1, got {self.decoders}")
        if self.decoders > 1 and self.fault in ONE_DECODER_FAULTS:
            raise ValueError(f"fault {self.fault} is aimed at a single decoder: it needs "
                             "--decoders 1")
        if self.decode_tokens < 0:
            self.decode_tokens = 8 if self.decoders > 1 else 0
        # NaN passes every comparison: each time must be a finite number, not merely ">= 0"
        for name, flag in (("token_ms", "--token-ms"), ("layer_ms", "--layer-ms")):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} ({flag}) must be a finite number >= 0, got {v}")
        if self.retry_prefill and self.decode_tp != 1:
            raise ValueError("retry_prefill needs --decode-tp 1 (each D TP worker would decide "
                             "its own re-prefills)")
        if self.fault == "kill-prefill-rank" and self.prefill_dp < 2:
            raise ValueError("kill-prefill-rank needs --prefill-dp >= 2")
        if not 0 <= self.abort_rate <= 1:
            raise ValueError(f"abort_rate must be in [0, 1], got {self.abort_rate}")
        if not 0 <= self.link_loss < 1 or self.link_delay_s < 0:
            raise ValueError(f"link_loss must be in [0, 1) and link_delay_s >= 0, got "
                             f"{self.link_loss}, {self.link_delay_s}")
        if self.requests < 1 or self.prefill_dp < 1 or self.layers < 1:
            raise ValueError("requests, prefill_dp and layers must be >= 1")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if self.push_mode not in ("progressive", "last_chunk"):
            raise ValueError(f"push_mode must be progressive or last_chunk, got "
                             f"{self.push_mode!r}")
        if self.blocks_per_request > min(self.d_blocks, self.p_blocks):
            raise ValueError("blocks_per_request exceeds a block pool")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("prefill_tp and decode_tp must be >= 1")
        if self.kv_heads < 0:  # 0 means the default below; a negative count is a mistake
            raise ValueError(f"kv_heads (--kv-heads) must be >= 0 (0: the larger TP size), got "
                             f"{self.kv_heads}")
        if self.block_bytes <= 0:  # else found only when a worker sizes its cache
            raise ValueError(f"block_bytes (--block-kib) must be > 0, got {self.block_bytes}")
        if self.mla:
            self.kv_heads = 1
        elif self.kv_heads < 1:
            self.kv_heads = max(self.prefill_tp, self.decode_tp)
        for side, tp in (("prefill", self.prefill_tp), ("decode", self.decode_tp)):
            problem = tp_problem(tp, self.kv_heads, self.mla)
            if problem:
                raise ValueError(f"{side}: {problem}")
        if self.block_bytes % (8 * self.kv_heads):
            raise ValueError(f"block_bytes must be a multiple of 8 bytes per KV head "
                             f"({8 * self.kv_heads})")
        # The core's and the loop's settings are checked by their declarations, here at start
        # rather than in a spawned worker.
        self.prefill_config()
        self.loop_config("lw-loop")
        check_lease(self.decode_config(), self.request_timeout_s, self.transfer_timeout_s)

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head in one block of one layer."""
        return self.block_bytes // self.kv_heads

    def p_format(self, tp_rank: int) -> KVFormat:
        """Head format of P TP rank ``tp_rank`` (HND blocks, like vLLM's CPU KV cache)."""
        return make_format(tp_rank=tp_rank, tp_size=self.prefill_tp, total_heads=self.kv_heads,
                           block_tokens=16, dtype="uint8", order="HND", mla=self.mla)

    def d_format(self, tp_rank: int) -> KVFormat:
        """Head format of D TP rank ``tp_rank``."""
        return make_format(tp_rank=tp_rank, tp_size=self.decode_tp, total_heads=self.kv_heads,
                           block_tokens=16, dtype="uint8", order="HND", mla=self.mla)

    def rank_block_bytes(self, fmt: KVFormat) -> int:
        """Bytes of one block of one layer held by the TP rank of ``fmt``."""
        return (fmt.head_hi - fmt.head_lo) * self.head_bytes

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """Per chunk of a prompt, the block range it completes (every chunk at least one)."""
        n = min(self.chunks, self.blocks_per_request)
        b = self.blocks_per_request
        return [(c * b // n, (c + 1) * b // n) for c in range(n)]

    @property
    def d_capacity(self) -> int:
        """Requests one decoder's pool holds at once."""
        return self.d_blocks // self.blocks_per_request

    def prefill_config(self) -> PrefillConfig:
        """Deadlines of every P rank (the settings named as the core names them)."""
        # with heartbeats on, a silent D is judged by the liveness verdict, not by attempts
        return core_config(PrefillConfig, vars(self),
                           resend_until_deadline=self.heartbeat_s > 0)

    def loop_config(self, name: str) -> LoopConfig:
        """Settings of a worker's loop (``name``: its thread's), those named as the loop does."""
        return core_config(LoopConfig, vars(self), name=name)

    def decode_config(self) -> DecodeConfig:
        """Deadlines of the decoder; the lease covers P's deadline plus the transfer timeout."""
        lease = self.request_timeout_s + self.transfer_timeout_s + self.lease_margin_s
        # Mooncake's TCP data plane can fence what a failed sender still has in flight; NIXL
        # has nothing of lw's to cut (lease-only, lw.transport.dataplane.nixl)
        return core_config(DecodeConfig, vars(self), lease_s=lease,
                           fence_data=self.data_plane in FENCED_PLANES)
