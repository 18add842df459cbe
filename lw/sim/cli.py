"""`lw check`: model-check the protocol (exhaustive BFS or random walks) and print the verdict."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from lw.sim.config import PLANES
from lw.sim.explorer import Result, explore, random_walks
from lw.sim.properties import PROPERTIES
from lw.sim.trace import render_markdown, render_text
from lw.sim.variants import BASE_BOUNDS, DESIGNS
from lw.sim.world import FAULT_KINDS, WorldConfig

# The generated counterexample gallery: file name -> the `lw check` arguments that produce it
# (one per variant, at its default bounds).
GALLERY: dict[str, list[str]] = {f"{name}.md": ["--design", name]
                                 for name, d in DESIGNS.items() if d.expected != "holds"}

AHEAD_DESIGN = "compute-ahead"  # lw's protocol with prefills computed ahead of D's params
_CHUNKED = {"chunks": 2, "blocks_per_request": 2, "d_blocks": 2, "p_blocks": 2}
# The strong default check (`lw check` with no bound flags): d-first at these bounds, then at
# every variant's own bounds (so d-first is checked wherever a variant is caught).
STRONG: tuple[dict[str, Any], ...] = (
    dict(BASE_BOUNDS),
    {"dp": 2, "tp": 2, "requests": 2, "layers": 2},
    {"dp": 2, "d_tp": 2, "requests": 2, "layers": 2},
    {"dp": 2, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("drop", "dup"),
     "delays": False},
    {"dp": 2, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("crash",),
     "delays": False, "d_restarts": 1},
    {"dp": 2, "requests": 2, "layers": 2, "faults": True, "delays": False, "late_writes": True,
     "kv_checksum": True},
    # Chunked prefill (progressive push): two chunks per request. With one block per request
    # the first chunk completes none (the request claims D at its first step and writes in its
    # second); with two, each chunk pushes one, and the data plane may complete them out of
    # order (the core's out-of-order bookkeeping).
    {**BASE_BOUNDS, "chunks": 2},
    {**BASE_BOUNDS, **_CHUNKED, "unordered_writes": True},
    {"dp": 2, "requests": 2, "layers": 1, **_CHUNKED, "faults": True, "delays": False,
     "unordered_writes": True},
    {"dp": 1, "requests": 2, "layers": 1, **_CHUNKED, "faults": True, "fault_kinds": ("crash",),
     "delays": False, "d_restarts": 1},
    {"dp": 1, "requests": 2, "layers": 1, **_CHUNKED, "faults": True, "delays": False,
     "late_writes": True, "kv_checksum": True, "unordered_writes": True},
    # NIXL's measured semantics (lw.sim.config.PLANES): no fence, D's lease alone holds a failed
    # request's blocks; its in-doubt bytes are taken to land within the transfer timeout (with
    # late writes the lease is not enough: the counterexample of lease-frees-in-flight).
    {"dp": 1, "requests": 2, "layers": 1, "faults": True, "delays": False, "kv_checksum": True,
     "data_plane": "nixl"},
    {"dp": 2, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("rank-crash", "write"),
     "delays": False, "kv_checksum": True, "retry_prefill": 1, "data_plane": "nixl"},
    {"dp": 1, "requests": 1, "layers": 1, **_CHUNKED, "faults": True, "fault_kinds": (),
     "unordered_writes": True},
    # Shapes a bug class hid in before (issue 20): two senders per D rank (P TP 2 into D TP 1)
    # with duplicated and dropped messages, the mirror (one sender into two D ranks), MLA (one
    # writer per D rank; with TP on either side), and D prefix hits next to a full request.
    {"dp": 1, "tp": 2, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("drop", "dup"),
     "delays": False},
    {"dp": 1, "d_tp": 2, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("drop", "dup"), "delays": False},
    {"dp": 1, "tp": 2, "mla": True, "requests": 2, "layers": 2},
    {"dp": 1, "tp": 2, "mla": True, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("drop", "dup"), "delays": False},
    {"dp": 1, "d_tp": 2, "mla": True, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("dup", "crash"), "delays": False},
    {"dp": 2, "requests": 2, "layers": 1, "blocks_per_request": 2, "d_blocks": 2, "p_blocks": 2,
     "prefix_hits": (1, 0), "faults": True, "fault_kinds": ("drop", "dup"), "delays": False},
    # Prefill failover (issue 22): two P ranks as separate engines, one dies under a request
    # with writes in flight (or one fails in doubt) and D retries on the other; the old epoch's
    # in-doubt bytes land at any later time, checked by KV checksums. And the failover among
    # lost, duplicated messages and aborts.
    {"dp": 2, "requests": 2, "layers": 2, "faults": True, "fault_kinds": ("rank-crash", "write"),
     "delays": False, "late_writes": True, "kv_checksum": True, "retry_prefill": 1},
    {"dp": 2, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("rank-crash", "write", "drop", "dup", "abort"), "delays": False,
     "retry_prefill": 1},
    # ... and into fresh blocks (retry_fresh_blocks): with two blocks for two requests, D's pool
    # grants them or refuses (then FENCING); the old epoch's in-doubt bytes land at any later
    # time, in its quarantined blocks or, once released, in another request's.
    {"dp": 2, "requests": 2, "layers": 1, "d_blocks": 2, "faults": True,
     "fault_kinds": ("rank-crash", "write"), "delays": False, "late_writes": True,
     "kv_checksum": True, "retry_prefill": 1, "retry_fresh_blocks": True},
    # The same without late writes: an old sender's in-doubt bytes land within the transfer
    # timeout, so use-after-free judges who owns the old blocks until then. Where the sender
    # lives it answers D's abort "in doubt", and the ghost must keep its blocks (late writes
    # judge only stale bytes, which checksums catch: a ghost freed early passes there).
    {"dp": 2, "requests": 2, "layers": 1, "d_blocks": 2, "faults": True,
     "fault_kinds": ("rank-crash", "write"), "delays": False, "kv_checksum": True,
     "retry_prefill": 1, "retry_fresh_blocks": True},
    # Bad transfers (bytes corrupted in D's blocks, caught by the checksums) prefilled again
    # within the budget, with failed writes and a P rank crash besides: progress says a
    # request with a bad transfer and budget left ends DONE.
    {"dp": 2, "requests": 2, "layers": 1, "d_blocks": 2, "faults": True,
     "fault_kinds": ("corrupt", "write", "rank-crash"), "delays": False, "kv_checksum": True,
     "retry_prefill": 1},
    # Slow-but-alive peers (issue 40): any worker's needed peer goes silent well past the
    # heartbeat floor while its process lives; progress says no request fails for it. Then
    # with prefill failover, where D also watches the P a request was routed to, besides a
    # rank that really dies.
    {"dp": 2, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("stall",),
     "max_faults": 2, "delays": False},
    {"dp": 2, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("stall", "rank-crash"), "max_faults": 2, "delays": False,
     "retry_prefill": 1},
    # ... and as the drivers run P with heartbeats on: unanswered MetaRequests and DONEs are
    # resent until the request deadline, among lost and duplicated messages and a D crash.
    {"dp": 2, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("stall", "drop", "dup", "crash"), "max_faults": 2, "delays": False,
     "resend_until_deadline": True},
    # Computing ahead (issue 39): P computes before D's blocks are known and is bound when D
    # allocates; dropped at ahead_wait_s, a later bind is refused and the proxy starts the
    # request again D first. D's prefix hit computed but never written; restarts, aborts, lost
    # and duplicated messages; chunks whose writes complete out of order; two D TP ranks.
    {**BASE_BOUNDS, "design": AHEAD_DESIGN},
    {"design": AHEAD_DESIGN, "dp": 2, "d_tp": 2, "requests": 2, "layers": 2},
    {"design": AHEAD_DESIGN, "dp": 1, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("drop", "dup"), "delays": False},
    {"design": AHEAD_DESIGN, "dp": 1, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("crash", "abort"), "delays": False, "d_restarts": 1},
    {"design": AHEAD_DESIGN, "dp": 1, "requests": 2, "layers": 1, **_CHUNKED, "faults": True,
     "fault_kinds": ("write",), "delays": False, "unordered_writes": True},
    {"design": AHEAD_DESIGN, "dp": 1, "requests": 1, "layers": 1, **_CHUNKED,
     "prefix_hits": (1,), "faults": True, "fault_kinds": ()},
    # ... and with prefill failover: a P rank dies before or after the bind (before: the proxy
    # saw P's ahead request fail and starts it D first; after: D prefills it again elsewhere),
    # among failed writes, lost and duplicated messages and aborts.
    {"design": AHEAD_DESIGN, "dp": 2, "requests": 2, "layers": 1, "faults": True,
     "fault_kinds": ("rank-crash", "write", "drop", "dup", "abort"), "delays": False,
     "retry_prefill": 1},
    # P's first token (issue 59), handed to P's workers at any moment after the prefill: among
    # lost, duplicated tokens and failed writes, r1's sampled with other parameters than its
    # client asked for; under prefill failover (a rank's crash, a bad transfer: a token of the
    # epoch D gave up comes late); computed ahead (held until the bind); and with arbitrary
    # delays, where P's hold of DONE for the token ends at its timer and the token comes after
    # DONE, even after the release (a timely clock never moves while a token is due).
    {"dp": 1, "requests": 1, "layers": 1, "faults": True, "fault_kinds": (),
     "first_token_from_p": True},
    {"dp": 1, "requests": 2, "layers": 1, "faults": True, "fault_kinds": ("drop", "dup", "write"),
     "delays": False, "first_token_from_p": True, "first_token_other_spec": (1,)},
    {"dp": 2, "requests": 1, "layers": 1, "faults": True,
     "fault_kinds": ("rank-crash", "corrupt", "write"), "delays": False, "kv_checksum": True,
     "retry_prefill": 1, "first_token_from_p": True},
    {"design": AHEAD_DESIGN, "dp": 1, "requests": 2, "layers": 1, "first_token_from_p": True},
)
# Flags that set bounds: given any of them, `lw check` runs that one configuration.
BOUND_FLAGS = ("dp", "tp", "requests", "layers", "d_dp", "d_tp", "mla", "kv_heads", "d_blocks",
               "p_blocks", "blocks_per_request", "chunks", "prefix_hits", "faults", "fault_kinds",
               "max_faults", "retries", "no_atomic_layers", "no_p_loss_detection",
               "no_crash_zombies", "no_delays", "no_abstract_time", "d_restarts", "late_writes",
               "kv_checksum", "unordered_writes", "retry_prefill", "retry_fresh_blocks",
               "no_fence_data", "first_token", "data_plane")


def parser() -> argparse.ArgumentParser:
    """The argument parser of `lw check`."""
    ap = argparse.ArgumentParser(prog="lw check", description=__doc__)
    ap.add_argument("--design", choices=sorted(DESIGNS), default="d-first",
                    help="protocol variant (d-first is lw's protocol; see --list-designs). "
                         "Without bound flags a variant runs at its own bounds, and d-first "
                         "runs the strong check: its base bounds and every variant's")
    ap.add_argument("--list-designs", action="store_true",
                    help="list the variants: name, upstream reference, what it does, the "
                         "property that catches it")
    ap.add_argument("--bounds-of", choices=sorted(DESIGNS), default=None,
                    help="run --design at the default bounds of this variant")
    ap.add_argument("--dp", type=int, default=None, help="P DP ranks (lock-step; default 2)")
    ap.add_argument("--tp", type=int, default=None,
                    help="P TP workers per DP rank (each writes the D TP ranks kvmap assigns it)")
    ap.add_argument("--requests", type=int, default=None, help="default 2")
    ap.add_argument("--layers", type=int, default=None, help="default 2")
    ap.add_argument("--d-dp", type=int, default=None, help="D engines (DP ranks)")
    ap.add_argument("--d-tp", type=int, default=None,
                    help="D TP workers per D engine (one scheduler and block pool per engine)")
    ap.add_argument("--mla", action="store_true", default=None,
                    help="latent KV (MLA): one P writer per D TP worker, idle P ranks finish at "
                         "once")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="the model's KV heads (default lcm(tp, d-tp); fewer than --tp: "
                         "replicated heads)")
    ap.add_argument("--d-blocks", type=int, default=None, help="blocks per D engine")
    ap.add_argument("--p-blocks", type=int, default=None, help="blocks per P rank")
    ap.add_argument("--blocks-per-request", type=int, default=None)
    ap.add_argument("--chunks", type=int, default=None,
                    help="chunked prefill: P engine steps per request, one chunk each; its sent "
                         "blocks complete chunk by chunk (the first gets the remainder and may "
                         "complete none: needs blocks per request >= chunks - 1) and are pushed "
                         "layer by layer as each chunk computes them (default 1)")
    ap.add_argument("--prefix-hits", type=_hits, default=None, metavar="N,N,...",
                    help="per request: its first N blocks are in D's prefix cache (never written "
                         "by P); N = --blocks-per-request is a full hit (nothing to transfer)")
    ap.add_argument("--faults", action="store_true", default=None,
                    help="loss, duplication, failed writes, crashes, aborts, arbitrary delays")
    ap.add_argument("--fault-kinds", default=None,
                    help=f"comma-separated subset of {','.join(FAULT_KINDS)} (may be empty: "
                         "delays only)")
    ap.add_argument("--max-faults", type=int, default=None,
                    help="fault budget per run (default 1 exhaustive, 4 random)")
    ap.add_argument("--no-delays", action="store_true", default=None,
                    help="with --faults: timely clock (it moves only when nothing else can); "
                         "the progress property is checked")
    ap.add_argument("--no-abstract-time", action="store_true", default=None,
                    help="with --faults: timers fire only at their fixed values (no idling to "
                         "just before D's deadline; smaller, misses some interleavings)")
    ap.add_argument("--d-restarts", type=int, default=None,
                    help="a crashed D engine may restart (new incarnation, new layout)")
    ap.add_argument("--retries", type=int, default=None, help="P's meta/ack attempts")
    ap.add_argument("--retry-prefill", type=int, default=None,
                    help="D's prefill retry budget (prefill failover); each DP rank is a P "
                         "engine of its own, fault kind rank-crash kills one")
    ap.add_argument("--retry-fresh-blocks", action="store_true", default=None,
                    help="D's retry_fresh_blocks: a retry whose old senders may still write "
                         "receives into fresh blocks of D's pool when enough are free (else it "
                         "is fenced); the old ones are held until those senders stopped")
    ap.add_argument("--mode", choices=("exhaustive", "random"), default="exhaustive")
    ap.add_argument("--seconds", type=float, default=None,
                    help="time budget (random: default 10; exhaustive: none; strong check: "
                         "per configuration, default 30)")
    ap.add_argument("--max-states", type=int, default=None, help="exhaustive: state budget")
    ap.add_argument("--seed", type=int, default=0, help="random: seed")
    ap.add_argument("--no-atomic-layers", action="store_true", default=None,
                    help="explore each rank's layer hook and the barrier as separate actions")
    ap.add_argument("--no-p-loss-detection", action="store_true", default=None,
                    help="D never calls peer_lost for a crashed P (deadline and lease only)")
    ap.add_argument("--no-crash-zombies", action="store_true", default=None,
                    help="assume a crashed P's in-flight writes never land")
    ap.add_argument("--late-writes", action="store_true", default=None,
                    help="in-doubt bytes may land at any later time while D lives, past its "
                         "lease, into blocks of another claim (property stale-kv)")
    ap.add_argument("--no-fence-data", action="store_true", default=None,
                    help="D frees or reuses blocks when a lease ends, without fencing the data "
                         "plane from senders that may still have bytes in flight")
    ap.add_argument("--data-plane", choices=sorted(PLANES), default=None,
                    help="the data plane's measured semantics: whether D can fence it and "
                         "whether its fence stops in-flight bytes (default mooncake; nixl: "
                         "lease only)")
    ap.add_argument("--kv-checksum", action="store_true", default=None,
                    help="the endpoints' kv_checksum: D verifies what its blocks hold against "
                         "P's checksums")
    ap.add_argument("--unordered-writes", action="store_true", default=None,
                    help="the data plane may complete a P worker's writes in any order (lw's "
                         "reports each destination's writes in submission order)")
    ap.add_argument("--first-token", action="store_true", default=None,
                    help="first_token_from_p on both sides: P's sampled first token goes to D, "
                         "whose scheduler streams it and decodes on from it")
    ap.add_argument("--trace-out", type=Path, default=None,
                    help="write the counterexample as Markdown with a Mermaid sequence diagram")
    ap.add_argument("--counterexamples", action="store_true",
                    help="regenerate the counterexample gallery (docs/counterexamples)")
    ap.add_argument("--check", action="store_true",
                    help="with --counterexamples: exit 1 if the committed files are stale")
    ap.add_argument("--out", type=Path, default=None, help="gallery folder")
    return ap


def _hits(text: str) -> tuple[int, ...]:
    """Parse --prefix-hits: comma-separated block counts, one per request."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None


def explicit_bounds(args: argparse.Namespace) -> bool:
    """Whether any bound flag was given (then exactly one configuration runs)."""
    return any(getattr(args, name) is not None for name in BOUND_FLAGS)


def config_from(args: argparse.Namespace, base: dict[str, Any] | None = None) -> WorldConfig:
    """The world configuration the arguments describe: ``base`` (default: the bounds of
    --bounds-of, else of --design), then every explicit flag."""
    if base is None:
        base = DESIGNS[args.bounds_of or args.design].config_overrides()
    kw: dict[str, Any] = dict(base)
    flags = {"dp": "dp", "tp": "tp", "requests": "requests", "layers": "layers", "d_dp": "d_dp",
             "d_tp": "d_tp", "mla": "mla", "kv_heads": "heads", "d_blocks": "d_blocks",
             "p_blocks": "p_blocks", "blocks_per_request": "blocks_per_request",
             "chunks": "chunks",
             "prefix_hits": "prefix_hits", "faults": "faults", "retries": "retries",
             "d_restarts": "d_restarts", "max_faults": "max_faults",
             "retry_prefill": "retry_prefill"}
    for flag, field in flags.items():
        if getattr(args, flag) is not None:
            kw[field] = getattr(args, flag)
    if args.fault_kinds is not None:
        kw["fault_kinds"] = tuple(k for k in args.fault_kinds.split(",") if k)
    if args.no_delays:
        kw["delays"] = False
    if args.no_abstract_time:
        kw["abstract_time"] = False
    if args.no_atomic_layers:
        kw["atomic_layers"] = False
    if args.no_crash_zombies:
        kw["crash_zombies"] = False
    if args.late_writes:
        kw["late_writes"] = True
    if args.no_fence_data:
        kw["fence_data"] = False
    if args.kv_checksum:
        kw["kv_checksum"] = True
    if args.data_plane is not None:
        kw["data_plane"] = args.data_plane
    if args.retry_fresh_blocks:
        kw["retry_fresh_blocks"] = True
    if args.unordered_writes:
        kw["unordered_writes"] = True
    if args.first_token:
        kw["first_token_from_p"] = True
    if args.no_p_loss_detection:
        kw["p_loss_detection"] = False
    if "max_faults" not in kw:
        kw["max_faults"] = 1 if args.mode == "exhaustive" else 4
    design = kw.pop("design", args.design)  # a strong configuration may name its own
    return WorldConfig(design=design, **kw)


def strong_configs(design: str) -> list[tuple[str, dict[str, Any]]]:
    """The strong check's configurations: STRONG, then each variant's bounds (deduplicated)."""
    out: list[tuple[str, dict[str, Any]]] = []
    seen: list[dict[str, Any]] = []
    cands = [("strong", c) for c in STRONG]
    # each variant's bounds, with the design it is a variant of (computing ahead, or d-first)
    cands += [(f"bounds of {d.name}", {**d.config_overrides(),
                                       **({"design": AHEAD_DESIGN} if d.ahead else {})})
              for d in DESIGNS.values() if d.expected != "holds"]
    for label, kw in cands:
        if kw not in seen:
            seen.append(kw)
            out.append((label, kw))
    return out


def list_designs() -> list[str]:
    """One line per design: name, reference, expected verdict, summary."""
    lines = []
    for d in DESIGNS.values():
        ref = d.ref or "lw"
        verdict = "holds" if d.expected == "holds" else f"caught by {d.expected}"
        lines.append(f"{d.name:28} {ref:34} {verdict}")
        lines.append(f"{'':28} {d.summary}")
    return lines


def run_strong(args: argparse.Namespace) -> int:
    """`lw check` without bound flags for d-first: every strong configuration, each within
    its time budget; exit 1 on the first violation."""
    budget = args.seconds if args.seconds is not None else 30.0
    configs = strong_configs(args.design)
    print(f"lw check: strong check of design {args.design}: {len(configs)} configurations "
          f"(exhaustive, at most {budget:g} s each; `lw check --design NAME` runs one variant)")
    t0 = time.perf_counter()
    partial = 0
    for n, (label, kw) in enumerate(configs, 1):
        cfg = config_from(args, base=kw)
        res = run_check(cfg, "exhaustive", budget, args.max_states, args.seed)
        verdict = ("holds" if res.complete else "PARTIAL") if res.counterexample is None else (
            f"VIOLATION {res.counterexample.violation.prop}")
        partial += res.counterexample is None and not res.complete
        own = f" (design {cfg.design})" if cfg.design != args.design else ""
        print(f"[{n}/{len(configs)}] {label}{own}: {cfg.bounds()}: {res.states} states, "
              f"{res.seconds:.1f} s: {verdict}")
        if res.counterexample is not None:
            for line in report(cfg, res):
                print(line)
            return 1
    done = "every configuration explored completely" if not partial else (
        f"{partial} configuration(s) stopped at the time budget (no violation in their part)")
    print(f"RESULT: all properties hold in {len(configs)} configurations ({done}), "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def run_check(cfg: WorldConfig, mode: str, seconds: float | None, max_states: int | None,
              seed: int) -> Result:
    """Explore ``cfg`` in the given mode."""
    if mode == "exhaustive":
        return explore(cfg, max_states=max_states, max_seconds=seconds, check_cycles=True)
    return random_walks(cfg, seconds if seconds is not None else 10.0, seed=seed)


def report(cfg: WorldConfig, res: Result) -> list[str]:
    """What was checked and what was found, as printable lines."""
    design = DESIGNS[cfg.design]
    lines = [f"lw check: design {design.name} ({design.title})", f"  {design.summary}"]
    if res.mode == "exhaustive":
        lines.append("mode: exhaustive breadth-first search (a counterexample is a shortest one), "
                     "states hashed to 64 bits")
    else:
        lines.append("mode: random walks, each ended by a fair drain; counterexamples shrunk")
    lines.append(f"bounds: {cfg.bounds()}")
    red = ("lock-step layer of all DP ranks as one atomic action" if cfg.atomic_layers
           else "none (each rank's hook and the barrier are separate actions)")
    lines.append(f"reduction: {red}; message copies merged; times relative to now")
    if res.mode == "exhaustive":
        lines.append("partial-order reduction: " + (
            f"on (persistent singletons at {res.reduced} states, lw/sim/reduce.py)"
            if not cfg.d_restarts else "off (D restarts: a dead D does not stay dead)"))
    if not cfg.crash_zombies:
        lines.append("assumption: a crashed P's in-flight writes never land")
    lines.append("late writes: " + (
        "the bytes of a write that failed in doubt may land at any later time while that D "
        "lives (past every deadline and lease); fencing is checked by stale-kv" if cfg.late_writes
        else f"in-doubt bytes may land up to transfer_timeout_s={cfg.transfer_timeout_s:g} s "
             "after the failure; use-after-free keeps them off reused blocks"))
    if not cfg.p_loss_detection:
        lines.append("assumption: D never calls peer_lost for the P engine (finding 2)")
    plane = cfg.plane()
    lines.append("fences: " + (
        "a lease that ends with senders not known stopped fences the data plane from them "
        "before their blocks are freed or reused; a fence completes at any later moment"
        + ("" if cfg.fence_holds() else ", and the bytes it was to cut may land after it")
        if cfg.fences() else "none: a lease's end frees or reuses the blocks at once"
        + (f" ({plane.title} has no fence: {plane.measured})"
           if cfg.fence_data and not plane.fence else "")))
    lines.append("properties:")
    for p in PROPERTIES:
        if p.id == "sometimes-deadline" and not cfg.faults:
            continue
        lines.append(f"  [{p.kind:10}] {p.id} ({p.item}): {p.text}")
    if res.mode == "exhaustive":
        lines.append(f"explored {res.states} states, {res.transitions} transitions, "
                     f"{res.terminal} terminal state(s), depth {res.max_depth}, in "
                     f"{res.seconds:.2f} s ({res.states_per_s:,.0f} states/s)")
        if res.acyclic:
            lines.append("  state graph acyclic: every run ends, so the checks at terminal states "
                         "establish the 'eventually' properties")
        if res.states > 1000:
            p = res.states ** 2 / 2 ** 65
            lines.append(f"  hash-collision probability (64-bit fingerprints) <= {p:.1e}")
    else:
        lines.append(f"ran {res.walks} walks, {res.transitions} steps ({res.states} distinct "
                     f"states), max depth {res.max_depth}, in {res.seconds:.2f} s "
                     f"({res.states_per_s:,.0f} steps/s)")
    seen = ", ".join(sorted(res.seen)) or "nothing"
    lines.append(f"sometimes-events observed: {seen}")
    ce = res.counterexample
    if ce is None:
        if res.mode == "exhaustive" and not res.complete:
            lines.append(f"RESULT: PARTIAL - no violation in the explored part ({res.stopped_by})")
        else:
            lines.append("RESULT: all properties hold"
                         + (" (every reachable state explored)" if res.mode == "exhaustive"
                            else ""))
        return lines
    lines.append("RESULT:")
    if ce.actions or ce.violation.prop.startswith("sometimes"):
        if ce.actions:
            lines += render_text(cfg, ce, shortest=res.mode == "exhaustive")
        else:
            lines.append(ce.violation.headline())
    return lines


def gallery(out_dir: Path, check: bool) -> int:
    """Regenerate (or check) docs/counterexamples; returns the exit code."""
    stale: list[str] = []
    for name, argv in GALLERY.items():
        args = parser().parse_args(argv)
        cfg = config_from(args)
        res = run_check(cfg, "exhaustive", None, None, 0)
        if res.counterexample is None or not res.counterexample.actions:
            print(f"{name}: `lw check {shlex.join(argv)}` finds no counterexample any more; "
                  "remove it from lw.sim.cli.GALLERY", file=sys.stderr)
            stale.append(name)
            continue
        text = render_markdown(cfg, res.counterexample, f"lw check {shlex.join(argv)}", True)
        path = out_dir / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
                print(f"stale counterexample: {path} (run `lw check --counterexamples`)",
                      file=sys.stderr)
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if check and not stale:
        print(f"counterexamples up to date in {out_dir}")
    return 1 if stale else 0


def default_gallery_dir() -> Path:
    """docs/counterexamples of the source checkout this package lives in."""
    return Path(__file__).resolve().parent.parent.parent / "docs" / "counterexamples"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `lw check`: exit 0 when every property holds, 1 on a violation."""
    ap = parser()
    args = ap.parse_args(argv)
    # a budget of nothing searches nothing and would read as "all properties hold" (or, for
    # random walks, as a vacuity violation): refuse it as a bad argument
    if args.seconds is not None and not (math.isfinite(args.seconds) and args.seconds > 0):
        ap.error(f"--seconds needs a positive number of seconds, got {args.seconds}")
    if args.max_states is not None and args.max_states < 1:
        ap.error(f"--max-states needs a positive number of states, got {args.max_states}")
    if args.list_designs:
        for line in list_designs():
            print(line)
        return 0
    if args.counterexamples:
        return gallery(args.out or default_gallery_dir(), args.check)
    try:
        if (args.design == "d-first" and args.bounds_of is None and args.mode == "exhaustive"
                and not explicit_bounds(args)):
            return run_strong(args)
        cfg = config_from(args)
        # the cores' settings check themselves (e.g. --retry-prefill's range) when built: build
        # them here, so that a bad flag is exit 2 and not a traceback read as a violation
        cfg.prefill_config()
        cfg.decode_config()
    except ValueError as exc:
        print(f"lw check: {exc}", file=sys.stderr)
        return 2
    res = run_check(cfg, args.mode, args.seconds, args.max_states, args.seed)
    for line in report(cfg, res):
        print(line)
    if args.trace_out is not None and res.counterexample is not None and (
            res.counterexample.actions):
        command = "lw check " + shlex.join(sys.argv[2:] if argv is None else argv)
        text = render_markdown(cfg, res.counterexample, command, res.mode == "exhaustive")
        args.trace_out.parent.mkdir(parents=True, exist_ok=True)
        args.trace_out.write_text(text)
        print(f"wrote {args.trace_out}")
    return 0 if res.counterexample is None else 1
