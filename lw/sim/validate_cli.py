"""`lw validate`: check that a recorded run (an ``lw-trace`` file) is a behaviour of the world.

Exit status: 0 every request's trace is explained, 1 some recorded event is not (the first one
is named, with what the model allowed there), 2 bad input; a request the search could not
decide within its budget is reported ``undecided`` and does not change the exit status unless
``--strict``.
"""

from __future__ import annotations

import argparse
import math
import sys

from lw.contract.tracefile import TraceFormatError
from lw.sim.validate import RequestVerdict, load_trace, summary, validate, verdict_line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lw validate", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="an lw-trace file (lw demo --engine synthetic or vllm "
                                 "--timelines-out DIR)")
    p.add_argument("--request", action="append", default=None, metavar="ID",
                   help="validate only this request (repeatable)")
    p.add_argument("--max-states", type=int, default=200_000,
                   help="states searched per request before it is undecided")
    p.add_argument("--seconds", type=float, default=20.0,
                   help="search time per request before it is undecided")
    p.add_argument("--strict", action="store_true", help="an undecided request fails too")
    p.add_argument("-v", "--verbose", action="store_true", help="a line for every request")
    return p


def run(path: str, max_states: int = 200_000, seconds: float = 20.0,
        only: list[str] | None = None) -> list[RequestVerdict]:
    """Validate the trace at ``path``; TraceFormatError on malformed input, ValueError on a
    shape the world cannot take or a request the trace does not record."""
    return validate(load_trace(path), max_states, seconds, only)


def one_line(verdicts: list[RequestVerdict]) -> str:
    """The verdict of a whole trace in one line (the first unexplained event when rejected)."""
    n = summary(verdicts)
    head = ("valid" if not n["rejected"] and not n["undecided"] else
            "REJECTED" if n["rejected"] else "undecided")
    out = (f"{head}: {len(verdicts)} requests, {n['valid']} valid, {n['rejected']} rejected, "
           f"{n['undecided']} undecided")
    bad = next((v for v in verdicts if v.outcome == "rejected"), None) or next(
        (v for v in verdicts if v.outcome == "undecided"), None)
    return out + (f"; {verdict_line(bad)}" if bad is not None else "")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lw validate``."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.max_states < 1:
        ap.error(f"--max-states needs a positive number of states, got {args.max_states}")
    if not (math.isfinite(args.seconds) and args.seconds > 0):
        ap.error(f"--seconds needs a positive number of seconds, got {args.seconds}")
    try:
        verdicts = run(args.trace, args.max_states, args.seconds, args.request)
    except TraceFormatError as exc:
        print(f"lw validate: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # input the world cannot take: bad input (2), not a rejection (1)
        print(f"lw validate: {args.trace}: {exc}", file=sys.stderr)
        return 2
    if args.verbose:
        for v in verdicts:
            print(verdict_line(v))
    elif args.request is None:
        for v in verdicts:
            if v.outcome != "valid":
                print(verdict_line(v))
    print(one_line(verdicts))
    n = summary(verdicts)
    if n["rejected"]:
        return 1
    return 1 if args.strict and n["undecided"] else 0
