"""The output oracle's drift figures: honest P/D against planted wrong KV, on real engines.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/oracle_drift.py [--kind llama|mla] [--prompts 8]

Starts a local cluster (reference engine, P, D, lw's proxy) on a tiny random model, with P's data
plane wrapped in ``lw.transport.dataplane.planted.TruncatingPlane``. It sends ``--prompts``
prompts of 12..700 words one at a time and the same number four at a time (honest), then as
many with P writing only the first 64 bytes of each block (planted), all with top-5 logprobs,
and prints for each group the largest logprob drift per request (|difference| of a token both
sides list, at the positions up to and including the first divergence) and the oracle's
verdicts with and without the drift check. The figures in ``lw/lab/oracle.py``'s
docstring come from it. About five minutes here.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lw.lab.demo_client import Result, complete, make_prompt  # noqa: E402
from lw.lab.oracle import DRIFT, TOP_K, compare  # noqa: E402
from lw.lab.tiny_model import make_tiny_model  # noqa: E402
from lw.lab.vllm_demo import LocalCluster  # noqa: E402
from lw.transport.dataplane.planted import TRUNCATE_ENV  # noqa: E402

LENGTHS = (12, 90, 300, 700)


def drift(ref: Result, got: Result) -> float:
    """The largest logprob difference of a token both list, up to the first divergence."""
    most = 0.0
    for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=False)):
        theirs, mine = ref.top_logprobs[i] or {}, got.top_logprobs[i] or {}
        most = max([most, *(abs(theirs[t] - mine[t]) for t in theirs.keys() & mine.keys())])
        if a != b:
            break
    return most


def report(name: str, pairs: list[tuple[Result, Result]], allowed: float | None) -> None:
    """One line per group: drifts, and verdicts without and with the drift check."""
    errors = [g.error for _r, g in pairs if g.error]
    ok = [(r, g) for r, g in pairs if not g.error]
    drifts = sorted(round(drift(r, g), 4) for r, g in ok)
    tie_only = sum(compare(r, g).same for r, g in ok)
    with_drift = sum(compare(r, g, drift=allowed).same for r, g in ok)
    print(f"{name:<9} requests={len(pairs)} errors={len(errors)} drift max={max(drifts or [0])} "
          f"all={drifts} same(tie rule)={tie_only} same(drift {allowed})={with_drift}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=("llama", "mla"), default="llama")
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lw-oracle-"))
    flag = work / "truncate"
    os.environ[TRUNCATE_ENV] = str(flag)
    cluster = LocalCluster(model=make_tiny_model(work / "model", kind=args.kind),
                           workdir=work / "logs", reference=True)

    def ask(url: str, prompt: str) -> Result:
        return complete(url, prompt, 16, stream=False, logprobs=TOP_K)

    try:
        cluster.start(timeout=600)
        os.environ.pop(TRUNCATE_ENV)
        ref, pd = cluster.url("reference"), cluster.url("proxy")
        n = args.prompts
        prompts = [make_prompt(LENGTHS[i % 4], seed=2000 + i) for i in range(3 * n)]
        seq = [(ask(ref, p), ask(pd, p)) for p in prompts[:n]]
        batch = prompts[n:2 * n]
        refs = [ask(ref, p) for p in batch]
        with ThreadPoolExecutor(4) as ex:
            conc = list(zip(refs, ex.map(lambda p: ask(pd, p), batch), strict=True))
        planted = []
        for p in prompts[2 * n:]:
            want = ask(ref, p)
            flag.write_text("64")
            try:
                planted.append((want, ask(pd, p)))
            finally:
                flag.unlink()
        allowed = DRIFT[args.kind] if DRIFT[args.kind] is not None else 0.05
        report("honest", seq, allowed)
        report("4-at-once", conc, allowed)
        report("planted", planted, allowed)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
