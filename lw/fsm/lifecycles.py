"""The two per-request lifecycles of lw, declared as data.

Prefill side (per request and P worker rank)::

    AWAIT_DECODER_META -> META_READY -> LAYER_0_SENT -> ... -> LAYER_{L-1}_SENT -> DONE
    (FAILED from every non-final state)

A prefill computed ahead (before D's parameters reached P) starts in AHEAD: its layers are
computed into P's own blocks and remembered; ``bind`` (D's blocks known) leads on to
AWAIT_DECODER_META, where the earlier layers' writes catch up once D accepts. Not bound in time,
it fails and its blocks go back; a bind after that is refused (no write from freed blocks).

With progressive push a prompt computed in chunks sends each chunk's complete blocks layer by
layer: LAYER_k_SENT then counts the layers of the chunk being written, and a chunk that is not
the prompt's last goes from LAYER_{L-1}_SENT to CHUNK_SENT and on to the next chunk's
LAYER_0_SENT. DONE is sent only after the last chunk's last layer (every earlier write has
completed: layers are counted in (chunk, layer) order).

Decode side (per request)::

    PREFILL_REQUESTED -> RECEIVING -> DONE      (FAILED from every non-final state)

With a prefill retry budget, a request whose P was lost goes back to PREFILL_REQUESTED under a
new claim epoch (the one edge back: progress is (epoch, state)), through FENCING while a sender
of the old epoch may still write into its blocks.

Rows whose destination is STAY are *declared* no-ops: duplicates, late completions and events
after a final state. A (state, event) pair with no row is a protocol error.
"""

from __future__ import annotations

from functools import lru_cache

from lw.fsm.machine import STAY, Declaration, rows

AHEAD = "AHEAD"
AWAIT_DECODER_META = "AWAIT_DECODER_META"
META_READY = "META_READY"
CHUNK_SENT = "CHUNK_SENT"
DONE = "DONE"
FAILED = "FAILED"


def layer_sent(k: int) -> str:
    """Name of the prefill state reached when layers 0..k have been written to D."""
    return f"LAYER_{k}_SENT"


@lru_cache(maxsize=64)
def prefill_declaration(num_layers: int) -> Declaration:
    """The prefill-side lifecycle of one request on one P worker, for a model of L layers."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    sent = [layer_sent(k) for k in range(num_layers)]
    last = sent[-1]
    live = (AHEAD, AWAIT_DECODER_META, META_READY, *sent, CHUNK_SENT)
    return Declaration(
        name="prefill",
        states=(*live, DONE, FAILED),
        initial=AWAIT_DECODER_META,
        entries=(AHEAD,),
        finals=frozenset({DONE, FAILED}),
        transitions=(
            # A prefill computed ahead learns D's blocks (the proxy bound it to D's call).
            rows("bind", [AHEAD], AWAIT_DECODER_META),
            rows("bind", [FAILED], STAY, "refused: dropped before D's parameters came"),
            # Every target D worker accepted this sender (its layout is cached or came with it).
            rows("meta_accepted", [AWAIT_DECODER_META], META_READY),
            # This rank holds nothing any D rank takes from it (MLA: another P rank writes it).
            rows("no_target", [AWAIT_DECODER_META], DONE),
            rows("meta_accepted", [META_READY, *sent, CHUNK_SENT, DONE, FAILED], STAY,
                 "duplicate reply"),
            # One target D worker accepted (or accepted again) while another has not yet.
            rows("target_accepted", [AWAIT_DECODER_META], STAY, "other targets pending"),
            # D does not know the request yet: ask again on the next retry tick.
            rows("meta_unknown", [AWAIT_DECODER_META], STAY, "retry soon, backing off"),
            rows("meta_unknown", [META_READY, *sent, CHUNK_SENT, DONE, FAILED], STAY,
                 "stale reply"),
            # The scheduler computes another chunk of the prompt (progressive push): its
            # complete blocks are written layer by layer as it computes them.
            rows("chunk_scheduled", [AHEAD, AWAIT_DECODER_META, META_READY, *sent[:-1],
                                     CHUNK_SENT], STAY, "more blocks to write"),
            rows("chunk_scheduled", [FAILED], STAY, "computation goes on; nothing is sent"),
            # The forward pass finished a layer: remembered, never waited for.
            rows("layer_computed", [AHEAD, AWAIT_DECODER_META, META_READY, *sent[:-1],
                                    CHUNK_SENT], STAY),
            rows("layer_computed", [FAILED], STAY, "computation goes on; nothing is sent"),
            # A layer write completed (in (chunk, layer) order).
            rows("layer_sent", [META_READY, CHUNK_SENT], sent[0]),
            *(rows("layer_sent", [sent[k]], sent[k + 1]) for k in range(num_layers - 1)),
            rows("layer_sent", [FAILED], STAY, "write that was in flight when we failed"),
            # Every layer of a chunk that is not the prompt's last has been written.
            rows("chunk_sent", [last], CHUNK_SENT),
            # A retry tick while waiting for D's metadata or for the DONE acknowledgement.
            rows("meta_timer", [AWAIT_DECODER_META], STAY, "resend MetaRequest"),
            rows("meta_timer", [META_READY, *sent, CHUNK_SENT, DONE, FAILED], STAY,
                 "stale timer"),
            rows("ack_timer", [last], STAY, "resend DoneSending"),
            rows("ack_timer", [DONE, FAILED], STAY, "stale timer"),
            # D acknowledged DONE.
            rows("ack", [last], DONE),
            rows("ack", [DONE, FAILED], STAY, "duplicate or late acknowledgement"),
            # The scheduler hands over the token it sampled as the request's first: it goes to
            # D once D accepted the claim (META_READY on), never for a failed request.
            rows("first_token", [AHEAD, AWAIT_DECODER_META], STAY, "held until D accepts"),
            rows("first_token", [META_READY, *sent, CHUNK_SENT, DONE], STAY, "sent to D"),
            rows("first_token", [FAILED], STAY, "dropped: the request failed"),
            # Failure: transfer error, D refused or aborted, deadline, local abort, peer lost.
            rows("fail", live, FAILED),
            rows("fail", [DONE, FAILED], STAY, "already final"),
        ),
    )


PREFILL_REQUESTED = "PREFILL_REQUESTED"
RECEIVING = "RECEIVING"
FENCING = "FENCING"
DECODE_LIVE = (PREFILL_REQUESTED, RECEIVING)
"""D's states of an epoch whose prefill is under way (claimed or not)."""


@lru_cache(maxsize=1)
def decode_declaration() -> Declaration:
    """The decode-side lifecycle of one request on D (blocks allocated before prefill starts)."""
    live = DECODE_LIVE
    every = (*live, FENCING, DONE, FAILED)
    return Declaration(
        name="decode",
        states=(*live, FENCING, DONE, FAILED),
        initial=PREFILL_REQUESTED,
        finals=frozenset({DONE, FAILED}),
        transitions=(
            # A P sender was accepted (MetaRequest): from now on its writes may land in our blocks.
            rows("claim", [PREFILL_REQUESTED], RECEIVING),
            rows("claim", [RECEIVING], STAY, "another or a duplicate sender"),
            rows("claim", [DONE, FAILED], STAY, "answered refused or as duplicate"),
            rows("claim", [FENCING], STAY, "refused: the epoch is being fenced"),
            # One accepted sender reported every layer written; all of them: DONE.
            rows("sender_done", [RECEIVING], STAY, "still waiting for other senders"),
            rows("sender_done", [DONE], STAY, "duplicate DONE"),
            rows("sender_done", [FAILED, FENCING], STAY, "late DONE: that sender has stopped"),
            rows("all_done", [RECEIVING], DONE),
            # Failure: a sender failed, our deadline fired, local abort, peer lost (with the
            # prefill retry budget spent).
            rows("fail", [*live, FENCING], FAILED),
            rows("fail", [DONE, FAILED], STAY, "already final"),
            # While FAILED, the blocks are quarantined until every sender stopped or the lease ends.
            rows("sender_stopped", [FAILED], STAY, "quarantine shrinks"),
            rows("lease_expired", [FAILED], STAY, "quarantine ends"),
            # Prefill failover: the epoch's P was lost and the budget allows another attempt.
            # A sender of it may still write: keep the blocks, abort it, wait (as quarantine).
            rows("fence", live, FENCING),
            rows("sender_stopped", [FENCING], STAY, "the old epoch quietens"),
            # Nothing of the old epoch can land any more: a new epoch into the same blocks.
            rows("retry", [*live, FENCING], PREFILL_REQUESTED),
            # P's first token for the current epoch, from a sender accepted for it: reported
            # (once per epoch); it never moves the KV lifecycle. A given-up epoch takes none.
            rows("first_token", [RECEIVING, DONE], STAY, "taken"),
            rows("first_token", [PREFILL_REQUESTED, FENCING, FAILED], STAY, "refused"),
            # A message of another epoch: never counts for the current one (refused or dropped).
            rows("stale_epoch", every, STAY, "another epoch's claim, DONE or failure"),
        ),
    )
