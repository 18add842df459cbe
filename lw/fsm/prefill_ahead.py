"""P's endpoint, computing ahead: a request admitted before D's blocks are known
(``add_ahead``, state AHEAD) and bound to them later (``bind``). A part of
:class:`lw.fsm.prefill.PrefillEndpoint`, split from it as a concern of its own."""

from __future__ import annotations

import dataclasses
from typing import Any

from lw.fsm.effects import ArmTimer, CancelTimer, Effect
from lw.fsm.lifecycles import AHEAD, FAILED
from lw.fsm.machine import ProtocolError
from lw.fsm.prefill_request import PrefillRecord, PrefillRequest, _Target

__all__ = ["AheadBinding"]


class AheadBinding:
    """Computing ahead (docs/protocol.md, "Computing ahead"): the methods PrefillEndpoint
    takes from here."""

    def add_ahead(self: Any, req_id: str, local_blocks: tuple[int, ...],
                  final: bool, prompt: str, now: float) -> list[Effect]:
        """The scheduler computes a request before D's parameters reached P (computing ahead):
        ``local_blocks`` are the P blocks its first chunk completes (possibly none), ``final``
        whether that chunk is the prompt's last, ``prompt`` the digest of the prompt computed.
        Nothing is sent until :meth:`bind`; unbound after ``ahead_wait_s`` it fails."""
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already live on {self._who()}")
        if final and not local_blocks:
            raise ValueError(f"request {req_id!r}: a prompt computed in one chunk completes "
                             "at least one block")
        self._finished.pop(req_id, None)
        self._forget_done_claim(req_id)
        req = PrefillRequest(req_id, (), local_blocks, (), final=final, prompt=prompt)
        rec = PrefillRecord(req, AHEAD, now, now + self.config.ahead_wait_s)
        if local_blocks:
            self._announce(rec, local_blocks)
        self._reqs[req_id] = rec
        self.counters["requests"] += 1
        self.counters["ahead"] += 1
        self.timeline.record(now, req_id, "admitted", "", AHEAD,
                             f"{len(local_blocks)} blocks computed ahead of D's parameters"
                             + ("" if final else " (first chunk)"))
        return [ArmTimer(("deadline", req_id), rec.deadline)]

    def bind(self: Any, req: PrefillRequest, first: int, now: float,
             ahead_id: str = "") -> list[Effect]:
        """D's parameters for a request computed ahead: its decoders and D's blocks
        (``req.remote_blocks``: the prompt's blocks from ``first`` on, ``first`` being D's own
        prefix hit in blocks), epoch and prompt digest. ``req.local_blocks`` and ``req.final``
        are the endpoint's (what was announced). ``ahead_id``: the id it was admitted under
        when that is not D's (P admits it before D names it); from here on it is ``req.req_id``.
        A request already dropped is refused: the driver's caller (the proxy) starts that
        prefill the D-first way instead."""
        rid = req.req_id
        aid = ahead_id or rid
        rec = self._reqs.get(aid)
        if rec is None:
            if aid in self._finished:
                self.counters["late_binds"] += 1
                self.timeline.record(now, aid, "bind", self._finished[aid],
                                     self._finished[aid], "refused: already released")
                return []
            raise ProtocolError("prefill", aid, "UNKNOWN", "bind",
                                f"no such request on {self._who()}")
        if rec.state == FAILED:
            self.counters["late_binds"] += 1
            self._fire(rec, "bind", now, "refused: already failed")
            return []
        if rec.state != AHEAD:
            raise ProtocolError("prefill", aid, rec.state, "bind",
                                "only a request computed ahead is bound")
        if aid != rid:
            if rid in self._reqs:
                raise ValueError(f"request {rid!r} is already live on {self._who()}")
            # D's id from now on: every message and effect of the request carries it
            self.timeline.record(now, aid, "renamed", AHEAD, AHEAD, rid)
            del self._reqs[aid]
            self._reqs[rid] = rec
            self._aliases[aid] = rid
            self._finished.pop(rid, None)
            self._forget_done_claim(rid)
        out: list[Effect] = []
        problem = self._bind_problem(rec, req, first)
        bound = PrefillRequest(rid, req.decoder_addr, (), req.remote_blocks,
                               req.expected_senders, rec.final, req.epoch, req.prompt)
        raw = [local for local, _remote in rec.chunks]
        rec.req = bound
        rec.local, rec.chunks, rec.limit, rec.announced = (), [], 0, 0
        rec.skip = 0 if problem else first
        for local in raw:
            self._announce(rec, local)
        rec.req = dataclasses.replace(bound, local_blocks=rec.local)
        rec.deadline = now + self.config.request_timeout_s
        if aid != rid:
            out.append(CancelTimer(("deadline", aid)))  # the ahead wait, under the old id
        self._fire(rec, "bind", now, f"{len(req.remote_blocks)} blocks to "
                   f"{', '.join(bound.targets) or 'no decoder'} (D holds {first})")
        if problem:
            # no target is claimed: D hears nothing from us and the caller tells the proxy
            self._fail(rec, f"bound to parameters that do not fit: {problem}", now, out)
            return out
        rec.targets = [_Target(a) for a in bound.targets]
        if not rec.targets:
            out.append(CancelTimer(("deadline", rid)))  # the ahead wait's (now D's id)
            self.counters["no_target"] += 1
            self._fire(rec, "no_target", now)
            self._maybe_release(rec, out)
            return out
        t = self.config.progress_timeout_s
        out.append(ArmTimer(("deadline", rid), min(rec.deadline, now + t) if t
                            else rec.deadline))
        self._send_meta_requests(rec, now, out)
        return out

    def refuses_bind(self: Any, ahead_id: str) -> bool:
        """Whether :meth:`bind` under ``ahead_id`` would be refused now: the request admitted
        under that id ended here, or failed, before a bind (a bind renames it to D's id). P's
        worker asks it for a request it no longer holds before telling the proxy so."""
        rec = self._reqs.get(ahead_id)
        return rec.state == FAILED if rec is not None else ahead_id in self._finished

    def _bind_problem(self: Any, rec: PrefillRecord, req: PrefillRequest, first: int) -> str:
        """Why D's parameters cannot be those of the prompt computed ahead (or its DONE could
        not carry its KV checksums), or ""."""
        if len(set(req.targets)) != len(req.targets):
            return f"a decoder is named twice in {req.targets}"
        if rec.req.prompt and req.prompt != rec.req.prompt:
            return "D's blocks are for another prompt than the one computed"
        if not req.targets:
            return ""  # nothing goes from this rank (MLA: another P rank writes)
        n, m = rec.announced, len(req.remote_blocks)
        if first < 0 or m < 1:
            return f"D holds {first} blocks and asks for {m}"
        if rec.final and first + m != n:
            return f"the prompt has {n} blocks; D holds {first} and asks for {m}"
        if first + m < n:
            return f"{n} blocks are computed already; D holds {first} and asks for {m}"
        return self._checksum_problem(req)
