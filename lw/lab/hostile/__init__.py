"""``lw hostile``: send hostile inputs to a local P/D cluster of real vLLM engines and print what
each one did, as a table (like ``lw demo --fault-table`` does for faults).

It makes the tiny random model, starts a prefill and a decode ``vllm serve`` with lw's connector
and the D-first proxy (:class:`~lw.lab.local_cluster.LocalCluster`), ``lw proxy
--sidecar`` in front of D (llm-d's routing sidecar; its allowlist admits only P), plus a
*canary*: an HTTP listener on loopback that records every connection and request it gets.
Hostile transfer parameters and headers name the canary (as a metaserver, as the decode engine P
should write to, or as the prefill server), so a call there proves that something acted on a
client's parameters.

Each case is sent to the proxy's public port, its control port, the sidecar's port (cases
``s1``..: a client's transfer fields, prefill servers named by ``x-prefiller-host-port``, a
passthrough path, an oversized body), or straight to D's or P's vLLM port, and printed as one
row: what was sent, the HTTP status and the start of the message that came back, what of it
*reached* an engine or the canary (the engines' ``lw_refused_params_total`` and the counters
that show transfer parameters being used, the ``/metrics-json`` counters
``client_transfer_params_dropped``, ``client_transfer_params_refused``, ``bodies_too_large`` and
``metaserver_refused`` of the proxy, or of the sidecar for its cases, the canary's count), the
RSS of the proxy (the sidecar, for its cases) before and after (and its peak during the case),
the verdict, and whether an honest request through the proxy still succeeded afterwards. A
``!`` marks a status the case did not expect, or another expectation it did not meet (the
``param`` an error names, how much a counter moved; also listed after the table as ``unmet``).

The run ends with one line::

    summary cases=N refused=R reached_engine=E engine_errors=X leaked_blocks=B max_rss_growth_mb=M

``refused``: cases answered 4xx, or served without acting on the hostile part (the row says
which); ``reached_engine``: cases whose hostile transfer field reached an engine and was acted on
(a canary contact, a prefill the proxy started for a forged call, or an engine counter showing
the parameters used), plus one if, over the whole run, P finished or failed more pushes than the
proxy and the sidecar started prefills; ``engine_errors``: 5xx answers, cases after which D, P,
the proxy or the sidecar stopped answering ``/health`` or an honest request failed;
``leaked_blocks``: KV blocks D still holds after the run; ``max_rss_growth_mb``: the largest
growth of the proxy's RSS (the sidecar's, in its cases) during one case (peak or end, over its
value before). Exit status 0 iff reached_engine=0, engine_errors=0, leaked_blocks=0 and
max_rss_growth_mb < 20.
"""

from __future__ import annotations

from lw.lab.hostile.run import main

__all__ = ["main"]
