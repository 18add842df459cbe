"""``lw status``: what every live request on the given P and D workers waits for.

Examples::

    lw status --workers 127.0.0.1:5600-5601,127.0.0.1:6600      # the table (then, per engine,
                                                                   # the first token from P)
    lw status --workers ... --watch 2                              # refreshed every 2 s
    lw status --workers ... --json                                 # for scripts
    lw status --workers ... REQUEST_ID                             # one request's whole history
    lw status --proxy http://127.0.0.1:8001 X_REQUEST_ID           # a client request's (why it
                                                                   # failed, on which worker)
    lw status --workers ... --timeline REQUEST_ID                  # as a Mermaid diagram
    lw status --workers ... --trace-out trace.json                 # Chrome trace of the timelines
    lw status --proxy http://127.0.0.1:8001                        # the workers a proxy has seen

The cluster key comes from ``--cluster-key`` or ``LW_CLUSTER_KEY`` (the side channel refuses
unauthenticated queries when the workers have one). ``--proxy`` takes the workers from an lw
proxy's control port: D's as its signed metaserver calls name them, P's as its prefill responses
do, so a worker shows once a request went through it. Exit status: 0 when every worker answered,
1 when some did not (or the proxy could not say), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from lw.ops.client import MAX_TIMELINE, Snapshot, expand_addrs, query, workers_from_proxy
from lw.ops.render import chrome_trace, history, mermaid_timeline, table, to_json
from lw.transport.sidechannel import parse_cluster_key


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lw status", description=__doc__.splitlines()[0])
    p.add_argument("request", nargs="?", default="",
                   help="show this request's whole history (a proxy's transfer id, the "
                        "client's x-request-id, shows each of its sub-transfers)")
    p.add_argument("--workers", "-w", action="append", default=[],
                   help="side-channel addresses: tcp://HOST:PORT, HOST:PORT or HOST:FIRST-LAST, "
                        "comma separated or repeated (default: $LW_STATUS_WORKERS)")
    p.add_argument("--proxy", default="", metavar="URL",
                   help="ask an lw proxy's control port (lw proxy --control-port) for the "
                        "workers it has seen in its traffic, instead of --workers")
    p.add_argument("--cluster-key", default=None, help="side-channel key (default: "
                   "$LW_CLUSTER_KEY); text, or hex:...")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for answers")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until interrupted")
    p.add_argument("--json", action="store_true", help="print the raw answers as JSON")
    p.add_argument("--timeline", metavar="REQUEST", default="",
                   help="render one request across P and D as a Mermaid sequence diagram")
    p.add_argument("--trace-out", metavar="FILE", default="",
                   help="write every worker's timeline as Chrome trace-event JSON")
    p.add_argument("--width", type=int, default=0, help="table width (default: terminal)")
    return p


def snapshot(args: argparse.Namespace, addrs: list[str]) -> Snapshot:
    """One round of questions, with the timeline depth the chosen output needs."""
    rid = args.timeline or args.request
    depth = MAX_TIMELINE if (rid or args.trace_out) else 0
    return query(addrs, args.cluster_key, req_id=rid if not args.trace_out else "",
                 timeline=depth, timeout_s=args.timeout)


def render(args: argparse.Namespace, snap: Snapshot) -> str:
    """The output the flags ask for."""
    if args.json:
        return to_json(snap)
    if args.timeline:
        return mermaid_timeline(snap, args.timeline)
    if args.request:
        return history(snap, args.request)
    width = args.width or os.get_terminal_size(sys.stdout.fileno()).columns \
        if sys.stdout.isatty() else args.width or 160
    return table(snap, width)


def _from_proxy(args: argparse.Namespace) -> list[str]:
    return workers_from_proxy(args.proxy, args.timeout)


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad flags up front (exit 2) rather than with a traceback mid-query."""
    if not _positive(args.timeout):
        ap.error(f"--timeout needs a positive number of seconds, got {args.timeout}")
    if args.watch is not None and not _positive(args.watch):
        ap.error(f"--watch needs a positive interval, got {args.watch}")
    source = "--cluster-key"
    if args.cluster_key is None:
        source = "LW_CLUSTER_KEY"
        args.cluster_key = os.environ.get("LW_CLUSTER_KEY") or None
    try:
        args.cluster_key = parse_cluster_key(args.cluster_key)
    except ValueError as exc:  # bad hex, or too short: the user's typo, not a crash
        ap.error(f"{source}: {exc}")
    if args.trace_out:
        folder = os.path.dirname(os.path.abspath(args.trace_out))
        if not os.path.isdir(folder):  # found out only after the query otherwise
            ap.error(f"--trace-out {args.trace_out}: no such directory {folder}")


def main(argv: list[str] | None = None) -> int:
    """Run ``lw status``."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.proxy and args.workers:
        ap.error("give --workers or --proxy, not both")
    _check_args(ap, args)
    specs = args.workers or [os.environ.get("LW_STATUS_WORKERS", "")]
    try:
        addrs = expand_addrs(specs) if not args.proxy else _from_proxy(args)
    except ValueError as exc:
        if args.proxy:
            print(f"lw status: {exc}", file=sys.stderr)
            return 1
        ap.error(str(exc))
    if not addrs:
        ap.error("no workers given: pass --workers HOST:PORT[-LAST],... or set "
                 "LW_STATUS_WORKERS")
    try:
        while True:
            if args.proxy and args.watch is not None:  # workers seen since the last round
                try:
                    addrs = _from_proxy(args)
                except ValueError as exc:
                    print(f"lw status: {exc} (keeping the last list)", file=sys.stderr)
            snap = snapshot(args, addrs)
            if args.trace_out:
                try:
                    with open(args.trace_out, "w", encoding="utf-8") as f:
                        json.dump(chrome_trace(snap), f)
                except OSError as exc:  # e.g. not writable: say so, not a traceback
                    print(f"lw status: --trace-out {args.trace_out}: {exc}", file=sys.stderr)
                    return 1
                print(f"wrote {args.trace_out}: timelines of {len(snap.replies)} worker(s)",
                      file=sys.stderr)
            out = render(args, snap)
            if args.watch is None:
                print(out)
                return 0 if not snap.silent else 1
            print("\x1b[2J\x1b[H" + time.strftime("%H:%M:%S ") + " ".join(addrs[:4])
                  + (" ..." if len(addrs) > 4 else ""))
            print(out, flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
