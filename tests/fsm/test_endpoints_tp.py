"""Heterogeneous TP through the real endpoints: one P rank into two D ranks, and back."""

from __future__ import annotations

from lw.fsm import (
    DecodeEndpoint,
    PrefillEndpoint,
    PrefillRequest,
    RecvDone,
    RecvFailed,
    Send,
    SendFinished,
    WriteLayer,
)
from lw.fsm.kvmap import expected_senders, make_format, targets_of
from lw.fsm.messages import KVLayout, LayerLayout, Sender
from lw.transport.wire import decode, encode

L = 2
HEAD = 256  # bytes of one head in one block


def _layout(engine: str, rank: int, tp: int, heads: int = 4, mla: bool = False) -> KVLayout:
    fmt = make_format(tp_rank=rank, tp_size=tp, total_heads=heads, block_tokens=16,
                      dtype="bf16", mla=mla)
    n = fmt.head_hi - fmt.head_lo
    layers = [LayerLayout(0x1000_0000 * (rank + 1) + i * 0x100_0000, n * HEAD, n * HEAD, 64)
              for i in range(L)]
    return KVLayout(engine, 1, f"{engine}{rank}-te:1", layers, fmt)


class Cluster:
    """P ranks and D ranks with instant, in-order delivery (through the real wire format)."""

    def __init__(self, p_tp: int, d_tp: int, mla: bool = False) -> None:
        self.p = [PrefillEndpoint(Sender("P", i, 1, f"p{i}"), L, local=_layout("P", i, p_tp,
                                                                             mla=mla))
                  for i in range(p_tp)]
        self.d = [DecodeEndpoint(Sender("D", j, 1, f"d{j}"), _layout("D", j, d_tp, mla=mla))
                  for j in range(d_tp)]
        self.writes: list[tuple[int, WriteLayer]] = []
        self.finished: list[SendFinished] = []
        self.recv: list[RecvDone | RecvFailed] = []
        self.queue: list[Send] = []

    def absorb(self, who: int | None, effects: list) -> None:
        for e in effects:
            if isinstance(e, Send):
                self.queue.append(e)
            elif isinstance(e, WriteLayer):
                assert who is not None
                self.writes.append((who, e))
            elif isinstance(e, SendFinished):
                self.finished.append(e)
            elif isinstance(e, (RecvDone, RecvFailed)):
                self.recv.append(e)

    def pump(self) -> None:
        while self.queue or self.writes:
            while self.queue:
                s = self.queue.pop(0)
                msg = decode(encode(s.msg))
                if s.dest.startswith("d"):
                    self.absorb(None, self.d[int(s.dest[1:])].on_message(msg, 0.0))
                else:
                    i = int(s.dest[1:])
                    self.absorb(i, self.p[i].on_message(msg, 0.0))
            if self.writes:
                i, w = self.writes.pop(0)
                self.absorb(i, self.p[i].transfer_done(w.req_id, w.layer, True, "", 0.0))

    def run(self, rid: str = "r") -> list[tuple[int, WriteLayer]]:
        d_tp = len(self.d)
        for d in self.d:
            self.absorb(None, d.add_request(rid, (7, 8), expected_senders(d.layout.fmt,
                                                                          len(self.p)), 0.0))
        for i, p in enumerate(self.p):
            assert p.local is not None
            targets = tuple(f"d{j}" for j in targets_of(p.local.fmt, d_tp))
            self.absorb(i, p.add_request(PrefillRequest(rid, targets, (1, 2), (7, 8)), 0.0))
        self.pump()  # claims accepted before the first layer: every write shows in ``seen``
        seen: list[tuple[int, WriteLayer]] = []
        for layer in range(L):
            for i, p in enumerate(self.p):
                self.absorb(i, p.layer_computed(layer, [rid], 0.0))
            seen += self.writes
            self.pump()
        return seen


def test_one_prefill_rank_writes_its_heads_into_two_decode_ranks() -> None:
    c = Cluster(p_tp=1, d_tp=2)
    writes = c.run()
    assert {w.layout.engine_id + str(w.layout.fmt.tp_rank) for _, w in writes} == {"D0", "D1"}
    # P holds 4 heads; D rank 1 gets heads 2..3: the second half of each P block.
    d1 = [w for _, w in writes if w.layout.fmt.tp_rank == 1]
    assert d1[0].segments == ((2 * HEAD, 0, 2 * HEAD),)
    assert [e.ok for e in c.finished] == [True]
    assert sorted(type(e).__name__ for e in c.recv) == ["RecvDone", "RecvDone"]


def test_two_prefill_ranks_fill_one_decode_rank() -> None:
    c = Cluster(p_tp=2, d_tp=1)
    writes = c.run()
    assert sorted(w.segments for _, w in writes if w.layer == 0) == [
        ((0, 0, 2 * HEAD),), ((0, 2 * HEAD, 2 * HEAD),)]
    assert [e.ok for e in c.finished] == [True, True]
    assert [type(e).__name__ for e in c.recv] == ["RecvDone"]


def test_mla_prefill_rank_without_target_finishes_at_once() -> None:
    c = Cluster(p_tp=2, d_tp=1, mla=True)
    c.run()
    assert c.p[1].counters["no_target"] == 1
    assert [e.ok for e in c.finished] == [True, True]
    assert [type(e).__name__ for e in c.recv] == ["RecvDone"]


def test_a_stray_sender_is_refused_and_the_request_fails_on_p() -> None:
    c = Cluster(p_tp=2, d_tp=1, mla=True)
    c.absorb(None, c.d[0].add_request("r", (7, 8), frozenset({0}), 0.0))
    c.absorb(1, c.p[1].add_request(PrefillRequest("r", ("d0",), (1, 2), (7, 8)), 0.0))
    c.pump()
    assert [(e.ok, "not the one that writes" in e.reason) for e in c.finished] == [(False, True)]
