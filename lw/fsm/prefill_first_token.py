"""P's endpoint, first token: the token P's scheduler sampled as a request's first goes to D as a
:class:`~lw.fsm.messages.FirstToken`, bound to the claim it was computed under (D's id, epoch,
prompt). A part of :class:`lw.fsm.prefill.PrefillEndpoint`, split from it as a concern of its own.

Only TP rank 0 of a P engine sends it (every rank's scheduler sees the same token), to the first
D worker it writes into. A token that comes before D accepted the claim (computed ahead, or the
claim unanswered) is held on the request's record and sent as the claim is accepted; it never
waits for anything else and nothing waits for it. The scheduler hears of the sampled token after
the request finished, often after D acknowledged its DONE: the claim of a request released DONE
is remembered (``finished_memory`` of them) so that its token still goes. A failed request's
token is never sent. The same token may be handed over twice (P's runner as it samples it, its
scheduler a step later): the repeat of the token a request holds or sent is dropped, not
refused.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from lw.fsm.effects import ArmTimer, Effect, Send
from lw.fsm.lifecycles import AHEAD, AWAIT_DECODER_META, DONE, FAILED
from lw.fsm.messages import PROTOCOL_VERSION, FirstToken, first_token_problem
from lw.fsm.prefill_request import PrefillRecord

__all__ = ["FirstTokens"]

DoneClaim = tuple[str, int, str, tuple[str, ...]]
"""What a request released DONE leaves for its token: (D worker address, claim epoch, prompt
digest, the ids it was computed ahead under)."""


class FirstTokens:
    """The first token's methods PrefillEndpoint takes from here (they use its ``_reqs``,
    ``_finished``, ``_renamed``, ``_fire``, ``fmt``, ``me``, ``config``, timeline, counters)."""

    _done_claims: OrderedDict[str, DoneClaim]  # D's id -> its claim, token not sent yet
    _done_alias: dict[str, str]  # ahead id -> D's id, of the requests in _done_claims
    _sent_first: OrderedDict[str, tuple[int, str]]  # released request (any id) -> token sent

    def first_token(self: Any, req_id: str, token: int, spec: str, now: float) -> list[Effect]:
        """P's scheduler sampled ``token`` as the first of request ``req_id`` (D's id, or the
        id it was computed ahead under) with the sampling spec digest ``spec``: send it to D
        under the request's claim, now or once D accepted the claim; at most once per request.
        Other TP ranks than 0 send nothing (rank 0's token is the engine's)."""
        if self.fmt.tp_rank != 0:
            return []
        out: list[Effect] = []
        rec = self._reqs.get(req_id) or self._renamed(req_id)
        if rec is None:
            self._first_of_released(req_id, token, spec, now, out)
            return out
        if rec.first == (token, spec):  # handed over again (module docstring)
            return out
        why = self._first_refusal(rec, token, spec)
        if why:
            self._refuse_first(rec.req.req_id, rec.state, why, now)
            return out
        rec.first = (token, spec)
        if rec.state in (AHEAD, AWAIT_DECODER_META):
            self._fire(rec, "first_token", now, f"token {token}: held until D accepts")
            return out
        self._send_first(rec, now, out)
        if rec.done_held:  # DONE was waiting for the token: it follows it now
            rec.done_held = False
            self._send_done(rec, out)
            out.append(ArmTimer(("ack", rec.req.req_id), now + self.config.ack_retry_s))
        return out

    def _hold_done(self: Any, rec: PrefillRecord, now: float, out: list[Effect]) -> bool:
        """Every write landed: whether DONE waits (at most ``first_token_wait_s``, on the
        request's ack timer) for the token P's scheduler hears of a step later, so that the
        token reaches D first on the same side channel. Only where a token will be sent."""
        if (not self.config.first_token_from_p or self.fmt.tp_rank != 0 or rec.first_sent
                or rec.first is not None or not rec.targets or rec.ack_tries):
            return False
        rec.done_held = True
        out.append(ArmTimer(("ack", rec.req.req_id), now + self.config.first_token_wait_s))
        self.timeline.record(now, rec.req.req_id, "first_token", rec.state, rec.state,
                             "DONE held for the token")
        return True

    def _first_refusal(self: Any, rec: PrefillRecord, token: int, spec: str) -> str:
        """Why a live request takes no (further) first token, or ""."""
        if not self.config.first_token_from_p:
            return "first_token_from_p is off on this worker"
        bad = first_token_problem(token, spec)
        if bad:
            return bad
        if rec.first is not None:
            return "the request has its first token already"
        if rec.state == FAILED:
            return "the request failed"
        if not rec.req.targets and rec.state != AHEAD:
            return "this rank writes into no decoder"
        return ""

    def _send_first(self: Any, rec: PrefillRecord, now: float, out: list[Effect]) -> None:
        """Send a live request's held token to its first target (D accepted the claim)."""
        first = rec.first
        if first is None or rec.first_sent or rec.state == FAILED or not rec.targets:
            return
        rec.first_sent = True
        token, spec = first
        req = rec.req
        addr = rec.targets[0].addr
        out.append(Send(addr, FirstToken(PROTOCOL_VERSION, req.req_id, self.me, req.epoch,
                                         token, req.prompt, spec)))
        self.counters["first_tokens_sent"] += 1
        self._fire(rec, "first_token", now, f"token {token} to {addr} (epoch {req.epoch})")

    def _first_of_released(self: Any, req_id: str, token: int, spec: str, now: float,
                           out: list[Effect]) -> None:
        """The token of a request no longer live here: sent if it ended DONE with its claim
        remembered, else refused (failed, sent already, forgotten or never seen)."""
        rid = self._done_alias.get(req_id, req_id)
        claim = self._done_claims.get(rid)
        fin = self._finished.get(rid, self._finished.get(req_id, "UNKNOWN"))
        if claim is None and self._sent_first.get(req_id) == (token, spec):
            return  # handed over again (module docstring)
        why = ("the request failed" if fin == FAILED else
               "not held here (sent already, or forgotten)" if claim is None else
               first_token_problem(token, spec))
        if claim is None or why:
            self._refuse_first(rid, fin, why, now)
            return
        self._forget_done_claim(rid)
        addr, epoch, prompt, aliases = claim
        self._remember_sent((rid, *aliases), token, spec)
        out.append(Send(addr, FirstToken(PROTOCOL_VERSION, rid, self.me, epoch, token, prompt,
                                         spec)))
        self.counters["first_tokens_sent"] += 1
        self.timeline.record(now, rid, "first_token", DONE, DONE,
                             f"token {token} to {addr} (epoch {epoch})")

    def _refuse_first(self: Any, rid: str, state: str, why: str, now: float) -> None:
        self.counters["first_tokens_refused"] += 1
        self.timeline.record(now, rid, "first_token", state, state, f"refused: {why}")

    def _keep_done_claim(self: Any, rec: PrefillRecord, aliases: list[str]) -> None:
        """A request released DONE whose token has not gone: remember its claim for it; one
        whose token went: the token, to tell its repeat from a refusal."""
        if rec.first_sent and rec.first is not None:
            self._remember_sent((rec.req.req_id, *aliases), *rec.first)
        if (rec.first_sent or not rec.targets or self.fmt.tp_rank != 0
                or not self.config.first_token_from_p):
            return
        rid = rec.req.req_id
        self._done_claims[rid] = (rec.targets[0].addr, rec.req.epoch, rec.req.prompt,
                                  tuple(aliases))
        for aid in aliases:
            self._done_alias[aid] = rid
        while len(self._done_claims) > self.config.finished_memory:
            self._forget_done_claim(next(iter(self._done_claims)))

    def _remember_sent(self: Any, ids: tuple[str, ...], token: int, spec: str) -> None:
        """A released request's sent token under each of its ids (``finished_memory`` kept)."""
        for rid in ids:
            self._sent_first[rid] = (token, spec)
        while len(self._sent_first) > self.config.finished_memory:
            self._sent_first.popitem(last=False)

    def _forget_done_claim(self: Any, rid: str) -> None:
        claim = self._done_claims.pop(rid, None)
        for aid in claim[3] if claim is not None else ():
            self._done_alias.pop(aid, None)
