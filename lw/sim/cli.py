"""`lw check`: model-check the protocol (exhaustive BFS or random walks) and print the verdict."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lw.sim.explorer import Result, explore, random_walks
from lw.sim.properties import PROPERTIES
from lw.sim.trace import render_markdown, render_text
from lw.sim.variants import DESIGNS
from lw.sim.world import FAULT_KINDS, WorldConfig

# The generated counterexample gallery: file name -> the `lw check` arguments that produce it.
GALLERY: dict[str, list[str]] = {
    "p-first.md": ["--design", "p-first", "--dp", "2", "--requests", "2", "--layers", "2"],
    "eager-free.md": ["--design", "eager-free", "--dp", "2", "--requests", "2", "--layers", "2"],
}


def parser() -> argparse.ArgumentParser:
    """The argument parser of `lw check`."""
    ap = argparse.ArgumentParser(prog="lw check", description=__doc__)
    ap.add_argument("--design", choices=sorted(DESIGNS), default="d-first",
                    help="protocol variant (d-first is lw's protocol)")
    ap.add_argument("--dp", type=int, default=2, help="P DP ranks (lock-step)")
    ap.add_argument("--tp", type=int, default=1,
                    help="P TP workers per DP rank (each writes the D TP ranks kvmap assigns it)")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-dp", type=int, default=1, help="D engines (DP ranks)")
    ap.add_argument("--d-tp", type=int, default=1,
                    help="D TP workers per D engine (one scheduler and block pool per engine)")
    ap.add_argument("--mla", action="store_true",
                    help="latent KV (MLA): one P writer per D TP worker, idle P ranks finish at "
                         "once")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="the model's KV heads (default lcm(tp, d-tp); fewer than --tp: "
                         "replicated heads)")
    ap.add_argument("--d-blocks", type=int, default=1, help="blocks per D engine")
    ap.add_argument("--p-blocks", type=int, default=1, help="blocks per P rank")
    ap.add_argument("--blocks-per-request", type=int, default=1)
    ap.add_argument("--prefix-hits", type=_hits, default=(), metavar="N,N,...",
                    help="per request: its first N blocks are in D's prefix cache (never written "
                         "by P); N = --blocks-per-request is a full hit (nothing to transfer)")
    ap.add_argument("--faults", action="store_true",
                    help="loss, duplication, failed writes, crashes, aborts, arbitrary delays")
    ap.add_argument("--fault-kinds", default=",".join(FAULT_KINDS),
                    help=f"comma-separated subset of {','.join(FAULT_KINDS)}")
    ap.add_argument("--max-faults", type=int, default=None,
                    help="fault budget per run (default 1 exhaustive, 4 random)")
    ap.add_argument("--retries", type=int, default=2, help="P's meta/ack attempts")
    ap.add_argument("--mode", choices=("exhaustive", "random"), default="exhaustive")
    ap.add_argument("--seconds", type=float, default=None,
                    help="time budget (random: default 10; exhaustive: none)")
    ap.add_argument("--max-states", type=int, default=None, help="exhaustive: state budget")
    ap.add_argument("--seed", type=int, default=0, help="random: seed")
    ap.add_argument("--no-atomic-layers", action="store_true",
                    help="explore each rank's layer hook and the barrier as separate actions")
    ap.add_argument("--no-p-loss-detection", action="store_true",
                    help="D never calls peer_lost for a crashed P (deadline and lease only)")
    ap.add_argument("--no-crash-zombies", action="store_true",
                    help="assume a crashed P's in-flight writes never land")
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


def config_from(args: argparse.Namespace) -> WorldConfig:
    """The world configuration the arguments describe."""
    max_faults = args.max_faults
    if max_faults is None:
        max_faults = 1 if args.mode == "exhaustive" else 4
    kinds = tuple(k for k in args.fault_kinds.split(",") if k)
    return WorldConfig(
        design=args.design, dp=args.dp, tp=args.tp, requests=args.requests, layers=args.layers,
        d_dp=args.d_dp, d_tp=args.d_tp, d_blocks=args.d_blocks, p_blocks=args.p_blocks,
        blocks_per_request=args.blocks_per_request, mla=args.mla, heads=args.kv_heads,
        prefix_hits=args.prefix_hits, faults=args.faults,
        fault_kinds=kinds, max_faults=max_faults, retries=args.retries,
        atomic_layers=not args.no_atomic_layers, crash_zombies=not args.no_crash_zombies,
        p_loss_detection=not args.no_p_loss_detection,
    )


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
    if not cfg.crash_zombies:
        lines.append("assumption: a crashed P's in-flight writes never land")
    if not cfg.p_loss_detection:
        lines.append("assumption: D never calls peer_lost for the P engine (finding 2)")
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
    args = parser().parse_args(argv)
    if args.counterexamples:
        return gallery(args.out or default_gallery_dir(), args.check)
    try:
        cfg = config_from(args)
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
