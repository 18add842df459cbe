"""Compiled dispatch vs `transitions`' trigger on the same prefill event sequence, in one run.

256 requests x 61 layers through the prefill lifecycle: meta_accepted, then per layer
layer_computed + layer_sent, then ack. Prints per-event costs, the cost of creating a request's
machine both ways, the endpoint's real per-layer hot path, and last `ratio_vs_transitions: X`.
"""

from __future__ import annotations

import argparse
import time

from transitions import Machine

from lw.fsm.lifecycles import prefill_declaration
from lw.fsm.machine import ProtocolError
from lw.fsm.prefill import PrefillConfig, PrefillEndpoint, PrefillRequest
from lw.transport.wire import PROTOCOL_VERSION, KVLayout, LayerLayout, MetaReply, Sender


def event_sequence(num_requests: int, num_layers: int) -> list[tuple[int, str]]:
    """The (request index, event) sequence a prefill step of this size produces."""
    seq = [(i, "meta_accepted") for i in range(num_requests)]
    for _ in range(num_layers):
        seq += [(i, "layer_computed") for i in range(num_requests)]
        seq += [(i, "layer_sent") for i in range(num_requests)]
    seq += [(i, "ack") for i in range(num_requests)]
    return seq


class _Model:
    """A request as `transitions` sees it."""


def run_transitions(num_requests: int, num_layers: int, seq: list[tuple[int, str]]
                    ) -> tuple[float, float]:
    """Seconds per event through Machine.trigger, and per model creation."""
    decl = prefill_declaration(num_layers)
    models = [_Model() for _ in range(num_requests)]
    t0 = time.perf_counter()
    machine = decl.reference_machine(models[0])
    for m in models[1:]:
        machine.add_model(m)
    create = (time.perf_counter() - t0) / num_requests
    assert isinstance(machine, Machine)
    t0 = time.perf_counter()
    for i, ev in seq:
        models[i].trigger(ev)
    per_event = (time.perf_counter() - t0) / len(seq)
    assert all(m.state == "DONE" for m in models)
    return per_event, create


def run_compiled(num_requests: int, num_layers: int, seq: list[tuple[int, str]]
                 ) -> tuple[float, float]:
    """Seconds per event through the compiled dict table, and per record creation."""
    decl = prefill_declaration(num_layers)
    table = decl.compile()
    t0 = time.perf_counter()
    states = [decl.initial for _ in range(num_requests)]
    create = (time.perf_counter() - t0) / num_requests
    t0 = time.perf_counter()
    for i, ev in seq:
        try:
            states[i] = table[(states[i], ev)]
        except KeyError:
            raise ProtocolError("prefill", str(i), states[i], ev) from None
    per_event = (time.perf_counter() - t0) / len(seq)
    assert all(s == "DONE" for s in states)
    return per_event, create


def run_endpoint(num_requests: int, num_layers: int, timeline: bool = True
                 ) -> tuple[float, float, float]:
    """Real PrefillEndpoint: seconds per layer_computed call for the batch, per request added,
    and per layer of the whole hot path (layer_computed + every write's transfer_done)."""
    me = Sender("P", 0, 1, "tcp://p")
    ep = PrefillEndpoint(me, num_layers, PrefillConfig(timeline_entries=32768 if timeline else 0))
    layout = KVLayout("D", 1, "h:1", [LayerLayout(4096 * (i + 1), 64, 64, 1 << 20)
                                      for i in range(num_layers)])
    ids = tuple(f"r{i}" for i in range(num_requests))
    t0 = time.perf_counter()
    for i, rid in enumerate(ids):
        ep.add_request(PrefillRequest(rid, "tcp://d", (i,), (i,)), 0.0)
    create = (time.perf_counter() - t0) / num_requests
    for rid in ids:
        ep.on_message(MetaReply(PROTOCOL_VERSION, rid, "accepted", Sender("D", 0, 1, "tcp://d"),
                                layout), 0.0)
    t0 = time.perf_counter()
    computed = 0.0
    for layer in range(num_layers):
        t1 = time.perf_counter()
        ep.layer_computed(layer, ids, 0.0)
        computed += time.perf_counter() - t1
        for rid in ids:
            ep.transfer_done(rid, layer, True, "", 0.0)
    whole = (time.perf_counter() - t0) / num_layers
    return computed / num_layers, create, whole


def timeline_ratio(num_requests: int, num_layers: int, rounds: int = 5) -> tuple[float, float]:
    """Best-of-``rounds`` seconds per layer of the hot path with timelines on and off."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(rounds):
        for on in (True, False):
            best[on] = min(best[on], run_endpoint(num_requests, num_layers, on)[2])
    return best[True], best[False]


def main() -> None:
    """Run both dispatchers on the same sequence and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--layers", type=int, default=61)
    args = ap.parse_args()
    seq = event_sequence(args.requests, args.layers)
    print(f"events: {len(seq)} ({args.requests} requests x {args.layers} layers, prefill)")
    tr_ev, tr_create = run_transitions(args.requests, args.layers, seq)
    co_ev, co_create = run_compiled(args.requests, args.layers, seq)
    ep_layer, ep_create, _ = run_endpoint(args.requests, args.layers)
    tl_on, tl_off = timeline_ratio(args.requests, args.layers)
    print(f"{'':28}{'per event':>14}{'create machine':>18}")
    print(f"{'transitions.trigger':28}{tr_ev * 1e6:>11.3f} us{tr_create * 1e6:>15.2f} us")
    print(f"{'compiled table':28}{co_ev * 1e6:>11.3f} us{co_create * 1e6:>15.2f} us")
    print(f"endpoint layer_computed: {ep_layer * 1e6:.1f} us per layer for {args.requests} "
          f"requests ({ep_layer / args.requests * 1e6:.3f} us per request, incl. WriteLayer)")
    print(f"endpoint add_request: {ep_create * 1e6:.2f} us per request")
    print(f"endpoint hot path per layer (layer_computed + transfer_done of every request): "
          f"timelines on {tl_on * 1e6:.1f} us, off {tl_off * 1e6:.1f} us")
    print(f"endpoint_timeline_ratio: {tl_on / tl_off:.3f}")
    print(f"create_ratio_vs_transitions: {tr_create / co_create:.1f}")
    print(f"ratio_vs_transitions: {tr_ev / co_ev:.1f}")


if __name__ == "__main__":
    main()
