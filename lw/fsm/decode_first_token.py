"""D's endpoint, first token: what it makes of P's :class:`~lw.fsm.messages.FirstToken`. A part
of :class:`lw.fsm.decode.DecodeEndpoint`, split from it as a concern of its own.

A token is taken (reported as :class:`~lw.fsm.effects.FirstTokenTaken`) only for the request's
current claim epoch, from a sender D accepted for that epoch, for the prompt the blocks are for,
and once per (request, epoch): a duplicate is dropped. It is bound like a claim because the
client may see it at once: the scheduler streams it before the KV lands and decodes on from it.
A request DONE on D still takes it (P's scheduler hears of the token after the prefill, often
after the DONE): its claim is remembered at the DONE (``finished_memory`` of them) and the
scheduler decides whether the token came too late. An epoch D gave up (FENCING, FAILED) takes
none. The token never moves the KV lifecycle: no state, deadline or lease depends on it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from lw.fsm.decode_request import DecodeRecord, SenderKey
from lw.fsm.effects import Effect, FirstTokenTaken
from lw.fsm.lifecycles import DONE, RECEIVING
from lw.fsm.machine import ProtocolError
from lw.fsm.messages import FirstToken

__all__ = ["FirstTokenIntake"]

DoneClaim = tuple[int, frozenset[SenderKey], str]
"""What a request DONE on D leaves for its first token: (claim epoch, the senders accepted for
it, prompt digest)."""


class FirstTokenIntake:
    """The first token's methods DecodeEndpoint takes from here (they use its ``_reqs``,
    ``_finished``, ``_fire``, ``_other_epoch``, ``config``, timeline and counters)."""

    _done_claims: OrderedDict[str, DoneClaim]  # DONE requests whose token was not taken yet

    def _on_first_token(self: Any, msg: FirstToken, now: float, out: list[Effect]) -> None:
        rid = msg.req_id
        key = (msg.sender.engine_id, msg.sender.rank)
        rec: DecodeRecord | None = self._reqs.get(rid)
        if not self.config.first_token_from_p:
            self._refuse_token(rid, self.state_of(rid) or "UNKNOWN",
                               "first_token_from_p is off on this worker", now)
            return
        if rec is None:
            self._token_of_done(msg, key, now, out)
            return
        if self._other_epoch(rec, msg.epoch, now):  # counted and recorded as stale_epoch
            self.counters["first_tokens_refused"] += 1
            return
        self._check_token_sender(rid, rec.state, key, rec.claimers, rec.prompt, msg)
        if rec.state != RECEIVING:  # a claimer of this epoch: it is being fenced, or failed
            self.counters["first_tokens_refused"] += 1
            self._fire(rec, "first_token", now, f"token {msg.token} of epoch {msg.epoch}: "
                       f"the epoch was given up")
            return
        if rec.token_epoch == msg.epoch:
            self.counters["stale_messages"] += 1  # a duplicate: reported once
            return
        rec.token_epoch = msg.epoch
        self._take_token(rec, msg, now, out)

    def _token_of_done(self: Any, msg: FirstToken, key: SenderKey, now: float,
                       out: list[Effect]) -> None:
        """A token for a request no longer live: taken if it ended DONE under the token's
        epoch and its token was not taken yet."""
        rid = msg.req_id
        claim = self._done_claims.get(rid)
        fin = self._finished.get(rid)
        if claim is None:
            if fin == DONE:
                self.counters["stale_messages"] += 1  # taken already, or forgotten
                return
            if fin is None:  # we restarted, or never had it (no timeline: ids a peer chose)
                self.counters["unknown_requests"] += 1
                self.counters["first_tokens_refused"] += 1
                return
            self._refuse_token(rid, fin, "the request failed", now)
            return
        epoch, claimers, prompt = claim
        if msg.epoch != epoch:
            self.counters["stale_epoch"] += 1
            self._refuse_token(rid, DONE, f"epoch {msg.epoch}, the request was DONE under "
                               f"epoch {epoch}", now)
            return
        self._check_token_sender(rid, DONE, key, claimers, prompt, msg)
        del self._done_claims[rid]
        self._take_token(None, msg, now, out)

    @staticmethod
    def _check_token_sender(rid: str, state: str, key: SenderKey, claimers: Any, prompt: str,
                            msg: FirstToken) -> None:
        """Refuse (ProtocolError: only a forged or broken peer sends it) a token from a sender
        not accepted for the epoch, or for another prompt than the request's."""
        if key not in claimers:
            raise ProtocolError("decode", rid, state, "first_token",
                                f"first token from {key}, never accepted for epoch {msg.epoch}")
        if prompt and msg.prompt and msg.prompt != prompt:
            raise ProtocolError("decode", rid, state, "first_token",
                                f"first token for prompt {msg.prompt[:8]}, the request's is "
                                f"{prompt[:8]}")

    def _take_token(self: Any, rec: DecodeRecord | None, msg: FirstToken, now: float,
                    out: list[Effect]) -> None:
        detail = f"token {msg.token} of epoch {msg.epoch} from P {msg.sender.engine_id}"
        if rec is not None:
            self._fire(rec, "first_token", now, detail)
        else:
            self.timeline.record(now, msg.req_id, "first_token", DONE, DONE, detail)
        self.counters["first_tokens_taken"] += 1
        out.append(FirstTokenTaken(msg.req_id, msg.token, msg.spec, msg.epoch))

    def _refuse_token(self: Any, rid: str, state: str, why: str, now: float) -> None:
        self.counters["first_tokens_refused"] += 1
        self.timeline.record(now, rid, "first_token", state, state, f"refused: {why}")

    def _keep_done_claim(self: Any, rec: DecodeRecord) -> None:
        """A request DONE whose current epoch's token has not come: remember its claim."""
        if not self.config.first_token_from_p or rec.token_epoch == rec.epoch:
            return
        self._done_claims[rec.req_id] = (rec.epoch, frozenset(rec.claimers), rec.prompt)
        while len(self._done_claims) > self.config.finished_memory:
            self._done_claims.popitem(last=False)
