"""A vLLM run as an ``lw-trace`` for ``lw validate``: every P and D worker's timeline, asked of
the running engines over lw's status protocol, with each request in the shape its cores saw.

This is the one place a vLLM run's requests are mapped to the checker's world of one request
(lw.sim.validate_world). What a vLLM request is to the core, from the adapter's code:

- Its id is the transfer id of one vLLM request, ``<proxy request id>@<D's vLLM request id>``
  (transfer_ids.sub_transfer_id): D's connector registers it, the proxy hands it to P as
  ``transfer_id``. Each child of ``n`` > 1 and each prompt of a list is a request of its own, with
  the same id on P and D; its claim epoch (``lw_epoch``) is 0 unless D has it prefilled again
  (``retry_prefill``), which the world models under the same id.
- Its blocks are those P writes. D registers with its core only the blocks after its own
  prefix-cache hit (scheduler_side ``after_alloc``: ``blocks_to_receive``), so the hit never
  reaches a core, and a request whose short uncached tail D computes itself
  (``local_tail_tokens``) reaches neither: ``blocks`` is D's "allocated N blocks", with no
  prefix hit. (P's "... N in all" says the same when D recorded nothing.)
- Its chunks are the pushes P's scheduler announced to the core (``PushCursor``): the
  ``add_request`` of its first push ("admitted K blocks to ..."), possibly of no block when D's
  hit covers the chunk, then one ``add_chunk`` per later step that completed a block
  ("chunk_scheduled", detail K). vLLM's chunks before the push started (``push_mode`` auto or
  last_chunk) and steps that complete no new block are no chunks of the core's. A request
  released before its last chunk (it failed) gets its remaining blocks as one more chunk: the core
  records nothing of the chunks after its release, so any split of them explains the same events.
  A request prefilled again on another P engine (``retry_prefill``) has its first attempt's
  chunks: the world splits every attempt alike (an attempt chunked otherwise is rejected there).
- A prompt P computed ahead of D's params (``lw proxy --start-mode compute-ahead``) is admitted
  under the proxy's id ("admitted K blocks computed ahead of D's parameters") and renamed to the
  transfer id at its bind: its entries are joined under the latter (tracefile.joined), and its
  blocks in all are D's allocation.
- Its layers are the KV cache's planes, which P reports computed one by one: one per model layer
  on vLLM-CPU (lw.lab.vllm_demo.block_layer_bytes).

Otherwise the events need no renaming: the runtime records the endpoints' own timelines, which
the world's endpoints record too.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lw.contract import tracefile
from lw.contract.tracefile import RequestShape, WorkerTrace
from lw.ops.client import MAX_TIMELINE, query

__all__ = ["model_kv", "request_shapes", "validate_trace", "write_cluster_trace"]

_ADMITTED = re.compile(r"^(\d+) blocks to .*?(?: \(first chunk; (\d+) in all\))?$")
# computed ahead of D's params: how many blocks in all is D's to say (its allocation)
_AHEAD = re.compile(r"^(\d+) blocks computed ahead of D's parameters")
_ALLOCATED = re.compile(r"^(\d+) blocks,")


def request_shapes(workers: list[WorkerTrace]) -> tuple[dict[str, RequestShape], list[str]]:
    """Each request's shape in the core, from what P's and D's cores recorded of it (see the
    module docstring), and the problems found: P's workers or P and D disagreeing on it."""
    sent: dict[str, int] = {}  # D: blocks allocated for P to write
    # P: (when admitted, engine, blocks per announced chunk, blocks in all) of its first attempt
    chunks: dict[str, tuple[float, str, list[int], int]] = {}
    problems: list[str] = []
    ahead: set[str] = set()  # computed ahead: the blocks in all are D's
    for w in tracefile.joined(workers):
        mine: dict[str, tuple[float, str, list[int], int]] = {}
        for e in w.entries:
            rid = e.reqs[0]
            if w.role == "decode" and e.event == "allocated":
                m = _ALLOCATED.match(e.detail)
                if m is not None:
                    sent.setdefault(rid, int(m.group(1)))
            elif w.role == "prefill" and e.event == "admitted" and rid not in mine:
                m = _ADMITTED.match(e.detail)
                if m is not None:
                    first = int(m.group(1))
                    mine[rid] = (e.t, w.engine, [first], int(m.group(2) or first))
                elif (m := _AHEAD.match(e.detail)) is not None:
                    ahead.add(rid)
                    mine[rid] = (e.t, w.engine, [int(m.group(1))], 0)
            elif w.role == "prefill" and e.event == "chunk_scheduled" and rid in mine:
                mine[rid][2].append(int(e.detail))
        for rid, got in mine.items():
            had = chunks.setdefault(rid, got)
            if had[1] == got[1] and had[2:] != got[2:]:
                # every TP worker of one P engine is told of the same chunks
                problems.append(f"{rid}: P workers disagree on its chunks: {had[2]} and "
                                f"{got[2]} ({w.name})")
            elif had[1] != got[1] and got[0] < had[0]:
                chunks[rid] = got  # a re-prefill's attempts: the first one's (the world has one)
    out: dict[str, RequestShape] = {}
    for rid in dict.fromkeys([*sent, *chunks]):
        _t, _eng, sizes, total = chunks.get(rid, (0.0, "", [], sent.get(rid, 0)))
        if rid in ahead:
            total = sent.get(rid, sum(sizes))
        blocks = sent.get(rid, total)
        if rid in sent and rid in chunks and total != blocks:
            problems.append(f"{rid}: P was told of {total} blocks to write, D allocated {blocks}")
        if blocks < 1:
            problems.append(f"{rid}: no block to write (D allocated {blocks})")
            continue
        left = blocks - sum(sizes)
        if left < 0:
            problems.append(f"{rid}: P's chunks {sizes} complete more than its {blocks} blocks")
            continue
        sizes = [*sizes, left] if left else sizes  # released before its last chunk(s)
        if not sizes:
            out[rid] = RequestShape(blocks)  # never reached P's core: its chunks do not matter
            continue
        if 0 in sizes[1:]:
            problems.append(f"{rid}: P announced an empty chunk after the first: {sizes}")
            continue
        out[rid] = RequestShape(blocks, len(sizes), 0, tuple(sizes))
    return out, problems


def model_kv(model: Path) -> tuple[int, int, bool]:
    """(layers, KV heads, MLA) of a Hugging Face model folder: the world's KV shape. Layers are
    the KV planes P reports: one per model layer on vLLM-CPU; MLA has one latent head."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    mla = "kv_lora_rank" in cfg
    heads = 1 if mla else int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    return int(cfg["num_hidden_layers"]), heads, mla


def write_cluster_trace(cluster: Any, path: str, source: str = "lw demo --engine vllm"
                        ) -> tuple[int, list[str], list[str]]:
    """Ask every P and D worker of ``cluster`` (a LocalCluster) for its whole timeline and write
    the run as an ``lw-trace`` at ``path``, in the per-request shapes of :func:`request_shapes`.
    (workers that answered, workers that did not, problems with the requests' shapes)."""
    from lw.vllm_adapter.config import LwConfig

    layers, kv_heads, mla = model_kv(cluster.model)
    snap = query(cluster.status_workers(), cluster.cluster_key, timeline=MAX_TIMELINE,
                 timeout_s=10.0)
    workers = tracefile.from_snapshot(snap)
    shapes, problems = request_shapes(workers)

    def core(role: str, tp: int, dp: int, peer_tp: int, extra: dict[str, Any]) -> LwConfig:
        return LwConfig.build(role=role, engine_id=role, kv_port=1, tp_size=tp, pp_size=1,
                              dp_size=dp, dp_rank=0, load_failure_policy=cluster.policy,
                              extra={"peer_tp_size": peer_tp, **extra})

    p = core("kv_producer", cluster.p_tp, cluster.p_dp, cluster.d_tp, cluster.p_extra)
    d = core("kv_consumer", cluster.d_tp, cluster.d_dp, cluster.p_tp, cluster.d_extra)
    # The run's own shape for requests without one (none: every request has its own here).
    first = next(iter(shapes.values()), RequestShape(1))
    shape = {"layers": layers, "prefill_tp": cluster.p_tp, "decode_tp": cluster.d_tp,
             "blocks_per_request": first.blocks, "chunks": first.chunks, "mla": mla,
             "kv_heads": kv_heads, "transfer_timeout_s": p.transfer_timeout_s}
    # A clean run: no fault is injected, so the world gets none but aborts (its timers still
    # fire at any moment: a deadline that fires on a loaded machine is a behaviour of the
    # world). A request that ends at P's first token (max_tokens 1, EOS, a stop id) while its
    # KV still arrives is aborted on D, as a client's abort is: a clean run has those.
    tracefile.dump(path, source, shape, asdict(p.prefill_config()), asdict(d.decode_config()),
                   workers, faults=("abort",), requests=shapes)
    return len(workers), sorted(snap.silent), problems


def validate_trace(path: str, seconds: float = 60.0, only: list[str] | None = None
                   ) -> tuple[bool, str, list[str]]:
    """Validate the trace at ``path`` (or its requests ``only``): (valid, the one-line verdict,
    a line per request that is not valid, naming its first unexplained event)."""
    from lw.sim.validate import summary, verdict_line
    from lw.sim.validate_cli import one_line, run

    verdicts = run(path, max_states=200_000, seconds=seconds, only=only)
    n = summary(verdicts)
    return (not n["rejected"] and not n["undecided"], one_line(verdicts),
            [verdict_line(v) for v in verdicts if v.outcome != "valid"])
