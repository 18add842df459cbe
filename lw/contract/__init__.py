"""What P, D and the proxy speak to each other, as declared types: the ``kv_transfer_params``
in both directions, the metaserver calls and their signatures, and what a client may send.

Each boundary decodes into one of these types once and refuses anything else with a
:class:`~lw.contract.params.ContractError` that names the field. Imports nothing of lw above it.

Contract (the KV connectors on both sides rely on it)
====================================================

1. Client -> proxy: ``POST /v1/completions`` or ``POST /v1/chat/completions`` (streaming SSE or
   not). The proxy assigns ``request_id`` (a uuid4 hex string) and picks the decode server with the
   fewest outstanding requests (ties: round robin).
2. Proxy -> decode server (D): the client's body, with ``kv_transfer_params`` replaced by a
   :class:`~lw.contract.params.DecodeParams`: ``do_remote_prefill`` true, the metaserver URL
   (``http://<control host>:<control port>/v1/metaserver``), ``transfer_id`` = request_id,
   ``metaserver_grant`` (a random secret of this transfer), ``lw_contract`` (the version) and
   ``lw_sig``, the proxy's HMAC over all of them with the cluster key. D acts on no params
   without that signature (lw.contract.client: what a client may send).

   and the header ``X-Request-Id: <request_id>`` (vLLM then names the request
   ``cmpl-<request_id>`` / ``chatcmpl-<request_id>``), plus the client's ``Authorization``,
   ``traceparent`` and ``tracestate`` (so vLLM's spans and lw's join the client's trace; also
   on P's requests). A client-supplied ``kv_transfer_params`` (top level or in
   ``vllm_xargs``) is dropped when it is an object and refused with a 400 naming it
   otherwise, on every path.
3. One client request becomes several vLLM requests on D (``n`` > 1 children, each prompt of a
   ``prompt`` list), all carrying the proxy's ``transfer_id``; a *sub-transfer* is one of them.
   For each vLLM request whose prefill it wants, D's connector (scheduler side, once it has
   allocated the blocks) -> ``POST /v1/metaserver`` with::

       {"transfer_id": <request_id>, "sub_transfer_id": str, "prompt_token_ids": [int, ...],
        "kv_transfer_params": {...}, "grant": <metaserver_grant>}

   signed with the cluster key (headers of lw.contract.auth: timestamp, nonce,
   HMAC-SHA256 over them and the body). The proxy refuses an unsigned, forged, stale or replayed
   call (401), and a call without the transfer's grant, for a sub-transfer id not of the form
   ``<request_id>@...``, or beyond the sub-transfers the client request allows (``n`` x prompts)
   (403); refusals are counted (``metaserver_refused``) and logged. Without a cluster key the
   proxy starts only with ``--insecure-trusted-network`` (calls then go unsigned; the grant is
   still required).

   ``sub_transfer_id`` is unique per vLLM request (lw: ``<request_id>@<D's vLLM request id>``,
   at most 256 characters), ``prompt_token_ids`` are that request's prompt tokens, and the params
   are whatever P needs to push the KV (``remote_engine_id``, ``remote_host``, ``remote_port``,
   ``remote_block_ids``, ``remote_first_block``, ``remote_dp_rank``, ...). D posts nothing for a
   request it computes itself (e.g. a prefix-cache hit with a short tail): a client request may
   have zero, one or several sub-transfers. A decode engine with a prefill retry budget adds
   ``"retry_prefill": n`` (0..64): it may ask for up to n re-prefills of that sub-transfer
   (see *Re-prefill* below). Replies:

   - ``202 {"status": "ok", "transfer_id", "sub_transfer_id", "prefill_url", "detail",
     "epoch"}``: the prefill request of that sub-transfer was started (or had already been
     started: repeated posts for one sub-transfer and epoch are idempotent and start nothing
     new); once the proxy has learned that prefill server's lw engine id and TP rank 0 side
     channel (from its earlier prefill responses) the reply also names them
     (``"prefill_engine_id"``, ``"prefill_worker"``), and D's core watches that P before it
     claims the request (``prefill_routed``).
   - ``404 {"status": "error", ...}``: unknown transfer (the client request already ended).
   - ``400 {"status": "error", ...}``: malformed body.
   - ``401`` / ``403 {"status": "error", ...}``: refused (see above); D fails the request.

   *Re-prefill* (prefill failover, D's ``retry_prefill``): when D's core lost the P of a
   sub-transfer and keeps its blocks, D posts, signed and with the same grant,
   ``{"transfer_id", "sub_transfer_id", "grant", "epoch": e, "avoid": [engine id, ...],
   "reason": str}`` with claim epoch e > 0. The proxy starts the same prefill (the first call's
   token ids and params, plus ``"lw_epoch": e``) on a prefill server none of whose engines is in
   ``avoid`` (and, when ``avoid`` is not empty, not an earlier attempt's server whose engine id
   it never learned), closes the old attempt's request and ignores its outcome, counts it
   (``prefill_failovers``) and answers 202 as above. Refused: a sub-transfer it never started
   (404), an epoch lower than the current one (409), an epoch beyond the first call's
   ``retry_prefill`` (403); no server left outside ``avoid``: 503 (D retries, then fails the
   request). The same epoch again is idempotent (202, nothing new).

   **The reply does not wait for the prefill.** The prefill request runs in a background task:
   the connector's scheduler-side call must stay short, and the outcome of the transfer reaches D
   through the KV connector itself (DONE from P, or D's own deadline), not through this reply.
4. Proxy -> prefill server (P), one request per sub-transfer, each picked by fewest outstanding
   requests: ``POST /v1/completions`` with ``{"model": <client's model>, "prompt":
   <prompt_token_ids>, "max_tokens": 1, "n": 1, "stream": false, "kv_transfer_params": ...}``
   (plus the client's ``cache_salt`` / ``priority`` if given), so P computes exactly D's tokens
   whatever the client's API (chat, ``n`` > 1, prompt lists); ``kv_transfer_params`` = D's params
   turned into a :class:`~lw.contract.params.PrefillParams` (``do_remote_decode`` true, the
   ``transfer_id`` = sub_transfer_id, ``lw_epoch`` = e for a re-prefill) and signed; header
   ``X-Request-Id: <request_id>``. P names its workers and engine id in its answer's
   ``kv_transfer_params`` (``lw_prefill_workers``, ``lw_prefill_engine_id``).
   *Admit-ahead* (``lw proxy --start-mode admit-ahead``; lw.contract.ahead): for a client
   request of one sub-transfer, the proxy also sends P, together with the request to D, the
   client's own body (``max_tokens`` 1, ``n`` 1, not streamed) with
   :class:`~lw.contract.ahead.AheadParams` signed for the role "prefill-ahead" (the control
   plane's ``/v1/ahead`` URL and a grant only P gets). P admits it, keeps it unscheduled and
   posts ``{"transfer_id", "grant", "prompt_digest"}`` there, signed like a metaserver
   call; once D's first metaserver call for that transfer arrives the proxy answers
   ``{"status": "go", "kv_transfer_params": <the signed PrefillParams of step 4>}`` if the two
   prompt digests agree, and P schedules the request with them (checking them as in step 4).
   Otherwise (another digest, no fetch or no call within ``--ahead-wait``, P's request ended)
   P is answered ``{"status": "fallback", "detail"}``, its request is closed, and the prefill
   starts as in step 4.
5. Streaming: the proxy sends the client its response head (200, D's SSE content type) as soon
   as D answers with its head (D accepted the request), not with the first token, which waits for
   the whole P/D round trip. From then on every error is sent in-band, as a final SSE event
   ``data: {"error": {...}}``.
6. Failures. If a prefill request fails (connection error, timeout, non-2xx) the proxy records it;
   if no byte of D's answer has been relayed yet, the proxy abandons the D request (closing the
   connection makes vLLM abort it) and reports the error naming the prefill server: HTTP 502 (504
   if the prefill timed out), or the final SSE event if the stream's head is already out. Once D's
   answer has started a prefill error is only logged: either that KV had arrived, or (another
   choice of the same answer streaming) D's own deadline fails the vLLM request whose KV never
   comes. A sub-transfer whose D declared a retry budget not yet spent (its epoch below
   ``retry_prefill``) is left to D when its P did not answer, timed out or answered 5xx (P may be
   gone: D's core finds that out and re-prefills, or fails the request itself), counted in
   ``prefill_failures_left_to_decode``; a 4xx from P ends the request as above. A failed attempt a
   re-prefill replaced is only logged. D unreachable, dropping the connection or answering 5xx
   before any byte of its answer reached the client -> the request starts afresh on another decode
   server (a new transfer id and grant; the old one's prefills cancelled), at most
   ``--decode-failovers`` times, then 502 naming the servers tried; after a byte was relayed -> 502
   (in-band). D timing out -> 504 (not retried: D may still be computing); D answering 4xx ->
   passed through unchanged. A server that failed so is avoided for new requests for 1 s, doubling
   per consecutive failure up to 30 s (jittered), unless every server is. Every outgoing call has a
   timeout.
7. Client disconnect (streaming or not) -> the D request is closed (vLLM aborts it) and every
   in-flight prefill request of the client request is cancelled (closed, so P aborts it too).
   Prefills still running when D's answer completed normally are left to finish.
"""
