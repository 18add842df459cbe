"""Protocol variants for the checker: lw's design, and bugs found in the wild put back.

Every variant runs the same ``lw.fsm`` endpoints or a subclass of them that changes one decision
(:mod:`lw.sim.defects`); the rest is how the world around them behaves (who the proxy contacts
first, whether the forward pass waits, when P frees blocks, ``quirks`` of the transport and the
schedulers). A variant carries the bounds that expose its bug (``bounds``: overrides of
:class:`~lw.sim.config.WorldConfig` fields); ``lw check --design NAME`` runs it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lw.fsm import DecodeEndpoint, PrefillEndpoint
from lw.sim import defects

# World behaviour switches a design may turn on (see lw.sim.world).
QUIRKS = {
    "front-trim": "on a partial prefix hit P aligns its blocks with D's by trimming the front "
                  "(P's prefix blocks go into D's suffix slots)",
    "full-hit-waits": "D registers a full prefix hit as a request to load (it waits for KV "
                      "that no P sends)",
    "staging-queue": "P's sender copies each layer into a staging buffer and queues it, with no "
                     "bound on the queue",
    "shared-layer-slot": "every layer of a request lives in one physical KV slot (layer k+1 is "
                         "computed into the buffer layer k is still being read from)",
    "poll-on-step": "P learns that a write completed only when its engine steps (an idle "
                    "engine never polls)",
    "serial-handshake": "a P worker's first contact with a D (MetaRequest asking for its "
                        "layout) waits until its previous first contact was answered",
    "token-by-slot": "D's scheduler hands P's first token to the request that holds the slot "
                     "(first D block) of the token's request now",
    "token-spec-unchecked": "D's scheduler streams P's first token whatever sampling spec it "
                            "was drawn with",
    "recompute-own-token": "after a failed transfer D recomputes from the prompt alone and "
                           "decodes on from its own first token, not the client's",
    "fence-returns-early": "the data plane has a fence, and it returns while the bytes of the "
                           "writers it cut can still land (a NIXL candidate fence measured not "
                           "to hold, benchmarks/late_landing.py)",
}

# Bounds of the plain check (lw check --design d-first with explicit flags starts from these).
BASE_BOUNDS: dict[str, Any] = {"dp": 2, "requests": 2, "layers": 2}


@dataclass(frozen=True)
class Design:
    """One protocol variant: the switches that make the world behave like that design."""

    name: str
    title: str
    summary: str  # one line: what the design does differently
    expected: str  # the property the checker must report, or "holds"
    ref: str = ""  # upstream reference of the bug it re-introduces
    d_first: bool = True  # the proxy asks D to allocate before P starts (else P and D together)
    # P computes a prefill before D's blocks are known (add_ahead) and is bound to them when D
    # allocates; a bind P refuses (dropped meanwhile) makes the proxy start it D first
    ahead: bool = False
    hook_waits_for_meta: bool = False  # a P layer hook blocks until D's metadata arrived
    timers: bool = True  # deadlines and retries exist (the pre-#3866 plan had none)
    free_on_request_finished: bool = False  # P frees blocks when compute ends
    quirks: frozenset[str] = frozenset()
    prefill: type[PrefillEndpoint] = PrefillEndpoint
    decode: type[DecodeEndpoint] = DecodeEndpoint
    bounds: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    ruled_out: str = ""  # what in lw's design rules the bug out (docs/checker-findings.md)

    def __post_init__(self) -> None:
        unknown = set(self.quirks) - set(QUIRKS)
        if unknown:
            raise ValueError(f"design {self.name}: unknown quirks {sorted(unknown)}")

    def config_overrides(self) -> dict[str, Any]:
        """The WorldConfig fields of this design's default bounds (BASE_BOUNDS, then its own)."""
        return {**BASE_BOUNDS, **self.bounds}


_FAULTS_ONLY = {"dp": 1, "requests": 1, "layers": 1, "faults": True}
# An in-doubt write whose bytes land after D's lease gave its block to the next request.
_LATE_WRITES = {"dp": 1, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("write",),
                "late_writes": True, "kv_checksum": True, "delays": False,
                "retries": 1}

# The same, where a data-plane fence may not hold (twice: the retry may fail too).
_FENCE_FAIL = {**_LATE_WRITES, "fault_kinds": ("write", "fence-fail"), "max_faults": 2}

# Chunked prefill with progressive push: two chunks of one block each, pushed layer by layer.
# A D engine crashes and restarts while a second request is still to come (the #4650 variants).
_D_RESTART = {"dp": 1, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("crash",),
              "d_restarts": 1, "delays": False}
# Slow-but-alive peers: each worker's needed peer may go silent (stall_s well past the floor)
# twice, with no other fault and a timely clock, where progress is checked.
_STALL = {"dp": 1, "requests": 1, "layers": 1, "faults": True, "fault_kinds": ("stall",),
          "max_faults": 2, "delays": False}
_CHUNKS = {"dp": 1, "requests": 1, "layers": 1, "chunks": 2, "blocks_per_request": 2,
           "d_blocks": 2, "p_blocks": 2}
# Prefill failover: two P ranks (engines), one request; its rank dies (both, for the budget).
_FAILOVER = {"dp": 2, "requests": 1, "layers": 1, "faults": True, "fault_kinds": ("rank-crash",),
             "delays": False, "retry_prefill": 1}

# ... into fresh blocks, where a write of the lost epoch fails in doubt: its sender lives and
# answers D's abort, saying so; without late writes, ownership judges the old blocks meanwhile.
_IN_DOUBT_GHOST = {**_FAILOVER, "d_blocks": 2, "fault_kinds": ("write",),
                   "retry_fresh_blocks": True}

# First token from P (issue 59): one request, one layer, P's token on.
_FIRST_TOKEN = {"dp": 1, "requests": 1, "layers": 1, "first_token_from_p": True}

_DESIGNS: tuple[Design, ...] = (
    Design(
        name="d-first", title="lw's protocol (D first)",
        summary="D allocates its blocks first, then the proxy starts the prefill; P's layer hooks "
                "only record the layer (never wait); P frees blocks only on SendFinished.",
        expected="holds"),
    Design(
        name="p-first", title="pre-#3866 plan (P first)", ref="vllm-ascend #3866",
        summary="The proxy starts P and D together; D allocates only when it has free blocks; a P "
                "rank's layer hook blocks inside the forward pass until D's metadata for its "
                "requests is ready, with no timeout (no deadlines anywhere).",
        d_first=False, hook_waits_for_meta=True, timers=False, expected="deadlock",
        ruled_out="D allocates first, and the hook only records the layer"),
    Design(
        name="compute-ahead", title="lw's protocol, computing ahead",
        summary="The proxy starts P and D together; P computes into its own blocks before D's "
                "are known and sends nothing; D's allocation binds it (the earlier layers are "
                "written once D accepts, D's prefix hit never); not bound within ahead_wait_s "
                "P drops it and frees its blocks, refuses a later bind, and the proxy starts it "
                "again D first.",
        d_first=False, ahead=True, expected="holds"),
    Design(
        name="ahead-ignores-hit", title="computed ahead, D's prefix hit ignored",
        summary="Computing ahead, the bind pairs P's blocks with D's from the prompt's first "
                "block on: with a prefix hit on D, P's prefix blocks are written into D's "
                "suffix slots.",
        d_first=False, ahead=True, prefill=defects.AheadIgnoresHit, expected="kv-placement",
        bounds={"dp": 1, "requests": 1, "layers": 1, "blocks_per_request": 2, "d_blocks": 2,
                "p_blocks": 2, "prefix_hits": (1,)},
        ruled_out="the bind names D's hit; P skips those blocks and pairs the rest by prompt "
                  "position"),
    Design(
        name="late-bind-resurrects", title="computed ahead, bound after it was dropped",
        summary="Computing ahead, a bind that comes after P dropped the request at its "
                "ahead_wait_s deadline (its blocks freed) takes it up again and writes its "
                "remembered layers from the freed blocks.",
        d_first=False, ahead=True, prefill=defects.LateBindResurrects,
        expected="use-after-free",
        bounds={"dp": 1, "requests": 1, "layers": 1, "faults": True, "fault_kinds": ()},
        ruled_out="a bind of a request P released is refused and writes nothing; the proxy "
                  "starts it again D first"),
    Design(
        name="ahead-never-dropped", title="computed ahead, no deadline",
        summary="Computing ahead with no ahead_wait_s: a prefill computed ahead whose D never "
                "binds it (that D died before allocating) holds P's blocks for ever.",
        d_first=False, ahead=True, prefill=defects.AheadNeverDropped,
        expected="deadlock",
        bounds={"dp": 1, "requests": 1, "layers": 1, "faults": True, "fault_kinds": ("crash",),
                "delays": False},
        ruled_out="an unbound prefill fails at ahead_wait_s and frees its blocks"),
    Design(
        name="eager-free", title="the seed's eager free", ref="lw seed (vllm-ascend #3866)",
        summary="As d-first, but P's request_finished returns 'free now' when compute ends: the "
                "scheduler frees (and may reallocate) the blocks while layers are still being "
                "sent.",
        free_on_request_finished=True, expected="use-after-free",
        ruled_out="P reports 'delay free' and frees on SendFinished, sent only with no write in "
                  "flight"),
    Design(
        name="stale-layout", title="layout cached across a D restart",
        ref="vllm-ascend #4650",
        summary="P caches D's KV layout per D address and never drops it: after D restarts, P "
                "writes at the addresses the dead process had registered.",
        prefill=defects.StaleLayoutCache, expected="layout-match",
        bounds=_D_RESTART,
        ruled_out="layouts are cached per (D worker, incarnation); a reply from another "
                  "incarnation makes P ask for the layout again"),
    Design(
        name="dead-incarnation-layout", title="a dead D's layout used after its restart",
        ref="vllm-ascend #4650",
        summary="Only the cache bug: P keeps a D worker's layout across its restart and writes "
                "with the dead incarnation's addresses; the writes fail, and a request that "
                "reached the restarted D after the restart, which no fault touched, fails.",
        prefill=defects.DeadIncarnationLayout, expected="progress",
        bounds=_D_RESTART,
        ruled_out="layouts are cached per (D worker, incarnation) and forgotten when the peer is "
                  "lost; a reply from another incarnation makes P ask for the layout again"),
    Design(
        name="request-id-suffix", title="DONE under P's internal request id",
        ref="vllm-ascend #6360 (vllm #27987)",
        summary="P's DONE carries the engine-internal request id (vLLM appends a random suffix), "
                "which D never registered.",
        prefill=defects.SuffixedRequestId, expected="core-protocol-error",
        bounds={"dp": 1, "requests": 1, "layers": 1},
        ruled_out="every message carries the id D allocated (the proxy's), checked by D"),
    Design(
        name="meta-error-kills-p", title="metadata error raised in the forward pass",
        ref="vllm-ascend #7514",
        summary="When P cannot reach a dead D for its metadata, the layer hook raises and the P "
                "worker dies (with DP, its peers hang in the collective).",
        prefill=defects.MetaErrorKillsWorker, expected="forward-never-waits",
        bounds={**_FAULTS_ONLY, "layers": 2, "fault_kinds": ("crash",), "delays": False},
        ruled_out="a failed claim is a FAILED transition; the hook only records layers"),
    Design(
        name="ack-no-timeout", title="DONE acknowledgement awaited for ever",
        ref="vllm-ascend #7855",
        summary="After DONE, P waits for D's acknowledgement with no retry and no deadline: a "
                "lost acknowledgement holds P's blocks for ever.",
        prefill=defects.NoAckTimeout, expected="request-ends",
        bounds={**_FAULTS_ONLY, "fault_kinds": ("drop",), "delays": False},
        ruled_out="the ack timer resends DONE and the request deadline stays armed"),
    Design(
        name="unbounded-send-queue", title="unbounded queue of staged layers",
        ref="vllm-ascend #7834",
        summary="P's sender copies each computed layer into a staging buffer and queues it with "
                "no bound: when D is slower than compute, P's memory grows without limit.",
        quirks=frozenset({"staging-queue"}), expected="p-memory-bounded",
        bounds={"dp": 1, "requests": 1, "layers": 2},
        ruled_out="writes read the request's own blocks (held until SendFinished): P needs no "
                  "memory outside its block pool"),
    Design(
        name="done-sent-once", title="a lost DONE is never resent",
        ref="vllm-ascend #8166",
        summary="P sends DONE once; when it is lost P does not resend it and the request fails "
                "although P's retry budget could have carried it.",
        prefill=defects.DoneSentOnce, expected="progress",
        bounds={**_FAULTS_ONLY, "fault_kinds": ("drop",), "delays": False},
        ruled_out="DONE is resent on every ack tick until acknowledged (ack_attempts)"),
    Design(
        name="failed-write-as-done", title="failed transfer reported as complete",
        ref="vllm-ascend #8959",
        summary="A failed layer write is counted as complete: P sends DONE and D decodes KV "
                "that never arrived.",
        prefill=defects.FailedWriteAsDone, expected="partial-kv",
        bounds={**_FAULTS_ONLY, "fault_kinds": ("write",), "delays": False},
        ruled_out="a failed write fails the request (in doubt: D waits for its lease)"),
    Design(
        name="shared-layer-slot", title="physical KV slot shared by layers",
        ref="vllm-ascend #14046",
        summary="Layers share one physical KV slot: layer k+1 is computed into the buffer while "
                "the write of layer k still reads it.",
        quirks=frozenset({"shared-layer-slot"}), expected="use-after-free",
        bounds={"dp": 1, "requests": 1, "layers": 2},
        ruled_out="vLLM gives every layer its own KV tensor (one LayerLayout per layer); a "
                  "source block is only reused after SendFinished"),
    Design(
        name="abort-frees-under-write", title="D's abort frees blocks P still writes",
        ref="vllm #48633 (C1)",
        summary="D aborting a request frees its blocks at once, while P's writes into them may "
                "still land.",
        decode=defects.AbortFreesAtOnce, expected="use-after-free",
        bounds={**_FAULTS_ONLY, "fault_kinds": ("abort",), "delays": False},
        ruled_out="a failed request is quarantined until every accepted sender stopped or "
                  "its lease expired"),
    Design(
        name="deadline-frees-under-write", title="D's deadline frees blocks P still writes",
        ref="issue 12 (4c); vllm #48633 (C1)",
        summary="D's own deadline frees the blocks at once while a P write is in flight; only "
                "abstract time (D's deadline firing during P's transfer) reaches it.",
        decode=defects.DeadlineFreesAtOnce, expected="use-after-free",
        bounds={**_FAULTS_ONLY, "fault_kinds": ()},
        ruled_out="the deadline quarantines like any failure"),
    Design(
        name="idle-p-never-polls", title="an idle P never polls its writes",
        ref="vllm #48633 (L1)",
        summary="P learns of completed writes only when its engine steps; with no new request "
                "the engine is idle, DONE is never sent and D waits for its deadline.",
        quirks=frozenset({"poll-on-step"}), expected="no-deadline-without-faults",
        bounds={"dp": 1, "requests": 1, "layers": 1},
        ruled_out="each worker's event loop handles completions and timers by itself, whether "
                  "or not the engine steps"),
    Design(
        name="handshake-hol", title="head-of-line handshake blocking",
        ref="vllm #48633 (S2)",
        summary="A P worker handshakes with one D at a time: a dead D's unanswered handshake "
                "blocks the first contact with a healthy D, whose request fails.",
        quirks=frozenset({"serial-handshake"}), expected="progress",
        bounds={"dp": 1, "requests": 2, "layers": 1, "d_dp": 2, "p_blocks": 2,
                "faults": True, "fault_kinds": ("crash",), "delays": False},
        ruled_out="claims are per request and D worker, never wait for another D; a fault of "
                  "one D touches only its requests (property progress)"),
    Design(
        name="partial-hit-front-trim", title="partial prefix hit written front-trimmed",
        ref="vllm #48633 (C3), vllm #48758",
        summary="On a partial D prefix hit, P sends its first blocks (the cached prefix) into "
                "D's uncached suffix slots instead of its last ones.",
        quirks=frozenset({"front-trim"}), expected="kv-placement",
        bounds={"dp": 1, "requests": 1, "layers": 1, "blocks_per_request": 2, "d_blocks": 2,
                "p_blocks": 2, "prefix_hits": (1,)},
        ruled_out="P's local blocks are the tail after the hit (PrefillRequest.local_blocks), "
                  "checked block for block against D's"),
    Design(
        name="full-hit-stranded", title="full D prefix hit waits for KV",
        ref="vllm #56640",
        summary="A request whose every block is in D's prefix cache is still registered as "
                "loading; no P sends anything and it waits for its deadline.",
        quirks=frozenset({"full-hit-waits"}), expected="no-deadline-without-faults",
        bounds={"dp": 1, "requests": 1, "layers": 1, "prefix_hits": (1,)},
        ruled_out="a full hit decodes at once and P gets no target (decoder_addr=())"),
    Design(
        name="d-never-reclaims", title="D blocks held for a P that never reports",
        ref="vllm #46283",
        summary="D has no deadline: when P dies before it claimed the request, D holds the "
                "blocks for ever.",
        decode=defects.NoDeadline, expected="deadlock",
        bounds={**_FAULTS_ONLY, "fault_kinds": ("crash",), "delays": False},
        ruled_out="every D request has a deadline (then a lease) from allocation"),
    Design(
        name="lease-only-fence", title="late writes fenced by the lease alone",
        ref="vllm #41383 (NIXL lease)",
        summary="D takes whatever landed in its blocks as the claim's KV; only waiting out the "
                "lease keeps an in-doubt write off reused blocks, and a write that lands later "
                "(a partition healing after the lease) is decoded as another request's KV.",
        decode=defects.LeaseOnlyFence, expected="stale-kv", bounds=_LATE_WRITES,
        ruled_out="a lease's end fences the data plane from senders not known stopped before "
                  "it frees the blocks (fence_data), and with kv_checksum every DONE is "
                  "verified against what D's blocks hold"),
    Design(
        name="fence-failure-trusted", title="a fence that did not hold taken as held",
        ref="plausible, no upstream report (lw issue 40: a fence timed out in a lossy run)",
        summary="D's fence of an in-doubt sender times out (the transport did not close what "
                "it cut) and D frees the blocks anyway; the sender's late bytes land in the next "
                "request's blocks while it decodes.",
        decode=defects.FenceFailureTrusted, expected="stale-kv", bounds=_FENCE_FAIL,
        ruled_out="only data_fenced(ok=True) releases; a failed fence keeps the blocks and is "
                  "asked again after fence_retry_s"),
    Design(
        name="fence-returns-early", title="a fence that returns before the bytes stop",
        ref="lw issue 60 (NIXL: benchmarks/late_landing.py --data-plane nixl)",
        summary="D's data plane (NIXL) gets a candidate fence that returns while an in-doubt "
                "writer's bytes can still land (removing the writer's agent, deregistering "
                "the memory it targets: measured, bytes kept landing); D frees the blocks when "
                "it returns, and the late bytes land in the next request's blocks while it "
                "decodes.",
        quirks=frozenset({"fence-returns-early"}), expected="stale-kv", bounds=_LATE_WRITES,
        ruled_out="a plane has a fence in the checker only where benchmarks/late_landing.py "
                  "saw no byte land after it returned (lw.sim.config.PLANES): NIXL is "
                  "lease-only until one is measured"),
    Design(
        name="lease-frees-in-flight", title="a lease frees blocks late bytes still reach",
        ref="vllm #41383 (NIXL lease); lw issue 40 (bytes landed 83 s after a failed report)",
        summary="With KV checksums on, D frees a failed request's blocks when its lease ends; "
                "a write that failed in doubt lands after the next request's last DONE was "
                "verified, while that request decodes: no checksum sees it.",
        decode=defects.LeaseFreesInFlight, expected="stale-kv", bounds=_LATE_WRITES,
        ruled_out="a lease's end fences the data plane from the senders not known stopped "
                  "(FenceData) and frees or reuses the blocks only once the fence holds"),
    Design(
        name="done-before-earlier-chunk", title="DONE after the last chunk, an earlier in flight",
        ref="plausible, no upstream report",
        summary="Progressive push over a data plane that completes writes out of order: P "
                "sends DONE once the last chunk's writes completed, while a write of an "
                "earlier chunk is still in flight, and D decodes without that chunk's KV.",
        prefill=defects.DoneAfterLastChunk, expected="partial-kv",
        bounds={**_CHUNKS, "unordered_writes": True},
        ruled_out="writes are numbered in (chunk, layer) order and DONE goes out only once "
                  "every write up to the last chunk's last layer completed"),
    Design(
        name="d-counts-chunks", title="a DONE per chunk, counted as the request's",
        ref="plausible, no upstream report",
        summary="Progressive push bolted onto a one-shot DONE path: P sends a DONE after each "
                "chunk is written, and D, counting one DONE per sender, takes the first "
                "chunk's as the whole request's and decodes blocks no write reached yet.",
        prefill=defects.DonePerChunk, decode=defects.DoneCoversAll, expected="partial-kv",
        bounds=_CHUNKS,
        ruled_out="one DONE per sender, after the last chunk, stating the blocks it covers "
                  "(DoneSending.num_blocks); D refuses one that does not cover its blocks"),
    Design(
        name="unchecked-claim-blocks", title="a claim accepted whatever blocks it targets",
        ref="sglang #39400 class (unauthenticated control plane); lw issue 23",
        summary="The proxy starts a prefill from a metaserver call that names other D blocks "
                "than D registered (forged, or another request's); D accepts the sender on the "
                "request id alone, and P's writes land in blocks of another request.",
        decode=defects.ClaimBlocksUnchecked, expected="kv-placement",
        bounds={"dp": 1, "requests": 2, "layers": 1, "d_blocks": 2, "faults": True,
                "fault_kinds": ("forge",), "delays": False},
        ruled_out="a claim names the D blocks its sender was told to write, and D accepts only "
                  "the blocks it registered for that request (protocol 3); the proxy takes "
                  "only signed calls bound to the transfer (docs/deployment.md)"),
    Design(
        name="retry-same-blocks", title="prefill retried into the same blocks, unfenced",
        ref="sglang #24527 class (late writer into reused pages); lw issue 22",
        summary="When the request's P is lost D starts the next claim epoch at once in the same "
                "blocks, taking the lost P's senders as stopped, while a write the dead P had "
                "in flight may still land there over the new epoch's KV.",
        decode=defects.RetryUnfenced, expected="stale-kv", bounds=_FAILOVER,
        ruled_out="a new epoch starts only when no byte of the old one can land: at once when "
                  "no old sender was accepted or each said it stopped, else after FENCING "
                  "(abort, then every sender's word or the lease)"),
    Design(
        name="fresh-blocks-freed-at-once", title="retry into fresh blocks, old ones freed at once",
        ref="plausible, no upstream report (lw issue 22)",
        summary="Prefill failover into fresh blocks (retry_fresh_blocks): the new epoch receives "
                "elsewhere, and the lost epoch's blocks are freed at once, while a write the "
                "dead P had in flight may still land in them.",
        decode=defects.GhostReleasedAtOnce, expected="use-after-free",
        bounds={**_FAILOVER, "d_blocks": 2, "retry_fresh_blocks": True},
        ruled_out="the lost epoch's blocks are quarantined as a failed request's (a ghost: its "
                  "senders aborted, the blocks freed when each stopped or the lease ended)"),
    Design(
        name="fresh-blocks-trust-in-doubt", title="a ghost released on an in-doubt answer",
        ref="plausible, no upstream report (lw issue 22)",
        summary="Prefill failover into fresh blocks: the lost epoch's ghost takes its sender's "
                "answer to the abort as that sender's stop even when the answer says a write "
                "is in doubt, and frees the old blocks while that write may still land.",
        decode=defects.GhostTrustsInDoubt, expected="use-after-free", bounds=_IN_DOUBT_GHOST,
        ruled_out="a ghost counts a sender stopped only by an answer not in doubt (DONE, "
                  "FailedSending, AbortAck); an in-doubt one leaves its blocks to the lease"),
    Design(
        name="bad-transfer-failed", title="a bad transfer failed, not prefilled again",
        ref="vLLM kv_load_failure_policy=fail; lw before issue 40",
        summary="D's KV checksums catch a transfer whose bytes are wrong, and the request "
                "fails at once although D's prefill retry budget is left and another P lives.",
        decode=defects.BadTransferFailed, expected="progress",
        bounds={**_FAILOVER, "fault_kinds": ("corrupt", "write"), "kv_checksum": True},
        ruled_out="a checksum mismatch loses the epoch as a lost P does: fenced until its "
                  "senders stopped, then prefilled again on another P within retry_prefill"),
    Design(
        name="fixed-heartbeat-budget", title="a slow peer declared dead",
        ref="lw before issue 40 (a starved D lost at 1.9 s on a 2-core host); NIXL heartbeat "
            "leases",
        summary="Each worker declares a needed peer lost once it is silent past one fixed "
                "budget, however alive its process: a peer starved of CPU for longer loses "
                "the requests that wait on it.",
        prefill=defects.FixedBudgetPrefill, decode=defects.FixedBudgetDecode,
        expected="progress", bounds=_STALL,
        ruled_out="past its budget a silent peer is lost only when the connection to it is "
                  "down (no process holds its port), or past heartbeat_cap_s (lw.fsm.silence)"),
    Design(
        name="retry-unbounded", title="prefill retried without a budget",
        ref="sglang #28651 class (abort storm); lw issue 22",
        summary="Every loss of the request's P is retried, however often: a request whose "
                "prefills keep failing is sent to P again and again instead of failing.",
        decode=defects.RetryUnbounded, expected="request-ends",
        bounds={**_FAILOVER, "max_faults": 2},
        ruled_out="D retries at most retry_prefill times per request, then fails it as before "
                  "(quarantine, lease, kv_load_failure_policy)"),
    Design(
        name="token-slot-race", title="a first token handed on by slot",
        ref="sglang #17259 (decode took another request's first token from a reused slot)",
        summary="D's scheduler hands P's first token to the request holding the slot its "
                "request had: a token that comes after its request decoded and freed its "
                "block reaches the next request in that block, whose client streams another "
                "request's token.",
        quirks=frozenset({"token-by-slot"}), expected="first-token-bound",
        bounds={**_FIRST_TOKEN, "requests": 2},
        ruled_out="the token is bound to its request's claim (D's id, epoch, prompt) and "
                  "handed to the scheduler by request id; a request that holds a first token "
                  "already discards it"),
    Design(
        name="stale-epoch-token", title="a first token of a given-up epoch taken",
        ref="plausible, no upstream report (lw issue 59)",
        summary="Prefill failover with P's first token: D takes a token by request id alone, "
                "so the token of the epoch whose transfer went bad, sent late by its live P, "
                "is taken for the next epoch.",
        decode=defects.StaleEpochToken, expected="first-token-bound",
        bounds={**_FAILOVER, "fault_kinds": ("corrupt", "write"), "kv_checksum": True,
                "first_token_from_p": True},
        ruled_out="D takes a token only under the request's current claim epoch, from a "
                  "sender accepted for it, once per epoch (protocol 6)"),
    Design(
        name="recompute-own-token", title="a recompute that forgets the streamed token",
        ref="plausible, no upstream report (vLLM kv_load_failure_policy=recompute; lw issue "
            "59)",
        summary="The client was streamed P's first token, then the transfer fails; D "
                "recomputes the request from its prompt alone and decodes on from a first "
                "token of its own, which need not be the one the client holds.",
        quirks=frozenset({"recompute-own-token"}), expected="first-token-continuation",
        bounds={**_FIRST_TOKEN, "faults": True, "fault_kinds": ("write",), "delays": False},
        ruled_out="a recompute after the client holds a token continues from the prompt and "
                  "that token (or the request ends with an error)"),
    Design(
        name="token-spec-unchecked", title="a first token drawn with other parameters used",
        ref="plausible, no upstream report (lw issue 59: P samples as the client asked only "
            "when the proxy passes the parameters on)",
        summary="P samples the first token with its defaults (the proxy did not pass the "
                "client's sampling parameters on) and D's scheduler streams it without "
                "comparing the token's spec with the request's.",
        quirks=frozenset({"token-spec-unchecked"}), expected="first-token-bound",
        bounds={**_FIRST_TOKEN, "first_token_other_spec": (0,)},
        ruled_out="every token carries its sampling spec digest, and D's scheduler uses it "
                  "only when it equals the request's own; else D samples the first token "
                  "itself"),
)

DESIGNS: dict[str, Design] = {d.name: d for d in _DESIGNS}
