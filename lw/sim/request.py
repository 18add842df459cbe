"""The world's view of one request: what the schedulers and the client know of it."""

from __future__ import annotations


class Req:
    """The world's view of one request (what the schedulers and the client know)."""

    __slots__ = ("idx", "rid", "p_rank", "d_rank", "hit", "d_stage", "p_stage", "d_blocks",
                 "p_blocks", "started", "p_added", "landed", "send_reports", "send_ok",
                 "recv_reports", "recv_ok", "accepted", "quarantined", "p_freed", "t_alloc",
                 "t_padd", "t_dfail", "d_inc", "touched", "losses", "sizes", "chunk", "forged",
                 "epoch", "p_epoch", "retry", "p_crashes", "bad_transfers", "ahead", "refused",
                 "token_due", "client", "base")

    def __init__(self, idx: int, p_rank: int, d_rank: int, tp: int, d_tp: int = 1,
                 hit: int = 0, sizes: tuple[int, ...] = (1,)) -> None:
        self.idx = idx
        self.rid = f"r{idx}"
        self.p_rank = p_rank
        self.d_rank = d_rank  # the D engine
        self.hit = hit  # first blocks D serves from its prefix cache (never written by P)
        # D: new, waiting (for blocks), allocated, decoding, done, failed, aborted, lost
        self.d_stage = "new"
        # P: none, queued, scheduled, finished (SendFinished, free pending), released, aborted, lost
        self.p_stage = "none"
        self.d_blocks: tuple[int, ...] | None = None
        self.p_blocks: tuple[int, ...] | None = None
        self.started = False  # the proxy handed it to P
        self.p_added = False  # PrefillEndpoint.add_request was called
        # Per chunk of its prefill: how many of its sent blocks it completes
        # (WorldConfig.chunk_sizes), and how many chunks P's scheduler has started (0: none yet).
        self.sizes = sizes
        self.chunk = 0
        # (P worker, D worker, layer, D block): every (layer, block) a write landed in
        self.landed: frozenset[tuple[int, int, int, int]] = frozenset()
        self.send_reports: tuple[int, ...] = (0,) * tp  # SendFinished per TP worker
        self.send_ok: tuple[bool, ...] = (False,) * tp
        self.recv_reports: tuple[int, ...] = (0,) * d_tp  # RecvDone/RecvFailed per D TP worker
        self.recv_ok: tuple[bool, ...] = (False,) * d_tp  # RecvDone per D TP worker
        # (P worker, D worker) pairs where P got MetaReply "accepted"
        self.accepted: frozenset[tuple[int, int]] = frozenset()
        self.quarantined = False
        self.p_freed = False
        self.t_alloc: float | None = None
        self.t_padd: float | None = None
        self.t_dfail: float | None = None
        self.d_inc = 0  # incarnation of the D engine that allocated it (0: not allocated)
        self.touched = False  # a fault hit it: crash of its engines, abort, failed write
        self.losses = 0  # its messages the network dropped
        # D blocks a forged metaserver call named for it (P is told to write there), or None
        self.forged: tuple[int, ...] | None = None
        # Prefill failover: D's current claim epoch, the epoch of the P attempt the P-side
        # fields describe, a re-prefill D asked for and the world has not started yet (its P
        # engines to avoid), and how many of its P ranks died under it.
        self.epoch = 0
        self.p_epoch = 0
        self.retry: tuple[str, ...] | None = None
        self.p_crashes = 0
        self.bad_transfers = 0  # its bytes corrupted in D's blocks (fault "corrupt")
        # Computing ahead: this P attempt was added before D's blocks were known ("ahead"),
        # then bound ("bound") or refused at the bind ("refused": the proxy starts it again, D
        # first, once P released the dropped attempt); "" otherwise.
        self.ahead = ""
        self.refused = False
        # First token from P (WorldConfig.first_token_from_p): the prefills whose last step
        # ended and whose sampled token P's scheduler has not handed to its workers yet, as
        # (claim epoch, P DP rank); the first token the client was streamed (lw.sim.tokens),
        # and the token D decodes on from (at its decode, or its recompute after a failure).
        self.token_due: tuple[tuple[int, int], ...] = ()
        self.client: int | None = None
        self.base: int | None = None

    def key(self, now: float, progress_budget: int = 0) -> tuple:
        """Hashable content (times relative to ``now``). ``progress_budget``: P's retry budget
        where the progress property is checked (it reads the faults that touched a request and
        its losses, up to the budget), 0 where it is not (then they decide nothing)."""

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - now, 6)

        # Sets as sorted tuples: equal frozensets can iterate (and so print) in different orders,
        # and the explorer fingerprints the key's text. The start times are read only by the
        # request-ends bound, checked at each worker's report: once every worker has reported,
        # how long ago the request started decides nothing, and keeping it would tell apart
        # states that differ only in that (t_dfail is for traces: nothing reads it).
        # Likewise the landed writes, read only when a D worker reports.
        d_open = min(self.recv_reports) == 0
        t_alloc = rel(self.t_alloc) if d_open else None
        t_padd = rel(self.t_padd) if min(self.send_reports) == 0 else None
        landed = tuple(sorted(self.landed)) if d_open else None
        return (self.d_stage, self.p_stage, self.d_blocks, self.p_blocks, self.started,
                self.p_added, self.chunk, landed, self.send_reports, self.send_ok,
                self.recv_reports, self.recv_ok, tuple(sorted(self.accepted)), self.quarantined,
                self.p_freed, t_alloc, t_padd, self.d_inc, self.forged, self.epoch,
                self.p_epoch, self.retry, self.p_crashes, self.bad_transfers, self.ahead,
                self.refused, self.token_due, self.client, self.base,
                (self.touched, min(self.losses, progress_budget)) if progress_budget else None)

    def d_final(self) -> bool:
        """D side has nothing more to do for this request."""
        return self.d_stage in ("done", "failed", "aborted", "lost")

    def loads(self) -> bool:
        """D needs KV from P (not a full prefix-cache hit)."""
        return self.d_blocks is None or self.hit < len(self.d_blocks)

    @property
    def d_remote(self) -> tuple[int, ...]:
        """D blocks P writes into (after the prefix-cache hit)."""
        return (self.d_blocks or ())[self.hit:]

    @property
    def p_target(self) -> tuple[int, ...]:
        """D blocks P is told to write into: D's own, unless a forged call named others."""
        return self.d_remote if self.forged is None else self.forged

    @property
    def d_cached(self) -> tuple[int, ...]:
        """D blocks served from D's prefix cache: P must never write them."""
        return (self.d_blocks or ())[:self.hit]

    @property
    def p_local(self) -> tuple[int, ...]:
        """P blocks whose KV goes to D (those of the tokens D does not hold)."""
        return (self.p_blocks or ())[self.hit:]

    def span(self, c: int) -> slice:
        """Which of the sent blocks (``p_local``, ``d_remote``) chunk ``c`` completes."""
        lo = sum(self.sizes[:c])
        return slice(lo, lo + self.sizes[c])

    def chunk_of(self, seq: int, layers: int) -> int:
        """The prompt chunk of this request's write ``seq`` (the core numbers its writes
        chunk * layers + layer counting the chunks announced to it: all but an empty first)."""
        return seq // layers + (not self.announced(0))

    def more_chunks(self) -> bool:
        """P's scheduler has chunks of its prefill still to compute."""
        return self.chunk < len(self.sizes)

    def announced(self, c: int) -> bool:
        """Whether chunk ``c`` completes a sent block: only then is it announced to P's core
        and are its layers reported for the request (the core announces no empty chunk but
        the first: a request added with no local block). Computed ahead, the first chunk also
        completes the blocks of D's prefix hit, which P computes (it does not know of it yet)."""
        return self.sizes[c] > 0 or (c == 0 and self.hit > 0 and self.ahead != "")
