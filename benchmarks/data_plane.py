"""Data-plane benchmark: layerwise Mooncake transfer vs its best batch, send-after-forward, TCP.

Run: ``.venv/bin/python benchmarks/data_plane.py [--mib 64] [--layers 32]``. Two processes over
loopback (this one sends; a copy of this script started with ``--peer`` receives), same bytes for
every section, all measured in one run, the sections interleaved round by round (medians reported)
so that load from other processes hits them alike. Sections: (a) one ``batch_transfer_sync_write``
of large contiguous entries (own engine), (b) layerwise through MooncakeDataPlane with simulated
compute per layer, (c) send-after-forward, (d) a raw Python TCP socket. (b) and (c) run for each
``--modes`` wait mode; the first mode gives the headline (unsuffixed) keys. Compute per layer is
one layer's transfer alone through that plane (``--compute-ratio`` times it), or ``--compute-ms``
for every plane alike. With ``--data-plane nixl`` the same run also measures (a') NIXL's best batch
(one prepped request of all blocks, and of one contiguous entry) and (b), (c) through NixlDataPlane
(keys ``*_nixl``), under UCX_TLS=tcp unless the environment sets UCX_TLS. The last lines are ``key:
value`` for machines; the 1-minute load average is printed too, because on a small shared machine
it moves every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("UCX_TLS", "tcp")  # NIXL over TCP like Mooncake, not shared memory

from lw.transport.dataplane import Entry, MooncakeDataPlane  # noqa: E402
from lw.transport.hookcost import hook_cost_report  # noqa: E402

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# Receiver process


def run_peer(size: int, nixl: bool) -> None:
    """Receiver: register a buffer with Mooncake (and NIXL), then serve sha / tcp / quit
    commands on stdin."""
    plane = MooncakeDataPlane("127.0.0.1")
    buf = np.zeros(size, dtype=np.uint8)
    plane.register_memory(buf.ctypes.data, size)
    info = {"session": plane.session, "addr": buf.ctypes.data}
    if nixl:
        from lw.transport.dataplane.nixl import NixlDataPlane

        nixl_plane = NixlDataPlane("127.0.0.1")
        nixl_plane.register_memory(buf.ctypes.data, size)
        info["nixl_session"] = nixl_plane.session
    print(json.dumps(info), flush=True)
    view = memoryview(buf).cast("B")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "sha":
            off, length = int(cmd[1]), int(cmd[2])
            print(hashlib.sha256(view[off : off + length]).hexdigest(), flush=True)
        elif cmd[0] == "zero":
            buf[:] = 0
            print("ok", flush=True)
        elif cmd[0] == "tcp":  # receive `nbytes` bytes `times` times, ack each with one byte
            nbytes, times = int(cmd[1]), int(cmd[2])
            with socket.socket() as listener:
                listener.bind(("127.0.0.1", 0))
                listener.listen(1)
                print(listener.getsockname()[1], flush=True)
                conn, _ = listener.accept()
                with conn:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    for _ in range(times):
                        got = 0
                        while got < nbytes:
                            n = conn.recv_into(view[got:nbytes], nbytes - got)
                            if n == 0:
                                raise ConnectionError("sender closed early")
                            got += n
                        conn.sendall(b"k")
        elif cmd[0] == "quit":
            break
    plane.close()
    if nixl:
        nixl_plane.close()


class PeerProcess:
    """Handle on the receiver subprocess (always killed by ``close``)."""

    def __init__(self, size: int, nixl: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--peer", "--size", str(size)]
            + (["--nixl"] if nixl else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        info = json.loads(self.readline())
        self.session: str = info["session"]
        self.nixl_session: str = info.get("nixl_session", "")
        self.addr: int = info["addr"]

    def readline(self) -> str:
        """One line from the peer, or an error if it died."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait()}")
        return line.strip()

    def ask(self, command: str) -> str:
        """Send a command, return the one-line answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.readline()

    def close(self) -> None:
        """Ask the peer to quit, kill it if it does not."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------
# Shared context


@dataclass
class Mode:
    """One plane under test (a MooncakeDataPlane wait mode, "spin" or "poll", or "nixl"), the
    peer's session on it, and its calibration."""

    name: str
    plane: Any
    collector: Collector
    session: str
    layer_transfer_s: float = 0.0
    compute_s: float = 0.0


@dataclass
class Ctx:
    """Everything the sections share: options, source bytes, the peer, the planes, and the
    samples each section appends to (one per round; the report takes medians)."""

    args: argparse.Namespace
    src: np.ndarray
    peer: PeerProcess
    layers: list[list[Entry]]
    expected_sha: str
    modes: list[Mode]
    raw: MooncakeDataPlane
    nixl_best: NixlBest | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)
    """Extra ``key: value`` lines a section wants in the report (printed before the ratios)."""

    @property
    def nbytes(self) -> int:
        """Bytes moved by every section."""
        return self.src.nbytes

    def add(self, key: str, value: float) -> None:
        """Record one sample of ``key``."""
        self.samples.setdefault(key, []).append(value)

    def median(self, key: str) -> float:
        """Median of the samples of ``key``."""
        return statistics.median(self.samples[key])


def make_layers(
    src_addr: int,
    dst_addr: int,
    total: int,
    n_layers: int,
    block: int,
    scatter: bool,
    seed: int = 0,
) -> tuple[list[list[Entry]], np.ndarray]:
    """Per-layer entries (blocks of a layer go to a permuted place in the same layer at the
    peer when ``scatter``) and the byte permutation: dst[perm_index] = src."""
    layer_bytes = total // n_layers
    blocks = layer_bytes // block
    rng = np.random.default_rng(seed)
    layers: list[list[Entry]] = []
    order = np.arange(total // block)
    for k in range(n_layers):
        perm = rng.permutation(blocks) if scatter else np.arange(blocks)
        base = k * layer_bytes
        layers.append(
            [
                (src_addr + base + i * block, dst_addr + base + int(p) * block, block)
                for i, p in enumerate(perm)
            ]
        )
        order[k * blocks : (k + 1) * blocks] = k * blocks + perm
    return layers, order


class Collector:
    """Thread that waits on the plane's fd and timestamps every completion as it arrives."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self.times: dict[Any, float] = {}
        self.failures: list[str] = []
        self.cond = threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            select.select([self.plane.fileno()], [], [], 0.05)
            got = self.plane.poll()
            now = time.perf_counter()
            if got:
                with self.cond:
                    for c in got:
                        self.times[c.xfer_id] = now
                        if not c.ok:
                            self.failures.append(f"{c.xfer_id}: {c.reason}")
                    self.cond.notify_all()

    def wait(self, ids: list[Any], timeout: float = 60.0) -> dict[Any, float]:
        """Block until all ``ids`` completed; return their completion times (and forget them)."""
        deadline = time.perf_counter() + timeout
        with self.cond:
            while not all(i in self.times for i in ids):
                if not self.cond.wait(deadline - time.perf_counter()):
                    raise TimeoutError(f"completions missing after {timeout}s")
            if self.failures:
                raise RuntimeError("transfer failed: " + "; ".join(self.failures))
            return {i: self.times.pop(i) for i in ids}

    def stop(self) -> None:
        """Stop the thread."""
        self._stop = True
        self.thread.join()


def simulate_compute(until: float) -> None:
    """Stand-in for a layer's compute on an accelerator: the CPU sleeps until ``until``."""
    while True:
        left = until - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


def mbps(nbytes: int, seconds: float) -> float:
    """MB/s (10^6 bytes per second)."""
    return nbytes / seconds / 1e6


# ---------------------------------------------------------------------------------------------
# Sections: each runs ONE trial and records samples; main() interleaves them round by round so
# that load from other processes hits every section alike.


def section_mooncake_best(ctx: Ctx) -> None:
    """(a) ONE batch_transfer_sync_write of contiguous entries, for several entry sizes.

    Uses its own engine: after large entries an engine's later small writes were seen to slow
    down (not pinned down on this loaded 2-core machine), which must not leak into (b)/(c)."""
    engine = ctx.raw.engine
    total = ctx.nbytes
    for entry_mib in (64, 16, 4, 1):
        size = min(entry_mib * MiB, total)
        count = total // size
        srcs = [ctx.src.ctypes.data + i * size for i in range(count)]
        dsts = [ctx.peer.addr + i * size for i in range(count)]
        t0 = time.perf_counter()
        rc = engine.batch_transfer_sync_write(ctx.peer.session, srcs, dsts, [size] * count)
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
        ctx.add(f"mooncake 1 batch {count}x{size // MiB}MiB", elapsed)


class NixlBest:
    """NIXL's own best batch, for (a'): one request of all blocks (the layers' entries, as
    scattered), and one of a single contiguous entry, each prepared once and posted per round
    (own agent, as (a) has its own engine)."""

    def __init__(self, src: np.ndarray, peer: PeerProcess, layers: list[list[Entry]]) -> None:
        from lw.transport.dataplane.nixl import NixlDataPlane, parse_session

        self.plane = NixlDataPlane("127.0.0.1")
        self.plane.register_memory(src.ctypes.data, src.nbytes)
        self.plane.connect(peer.nixl_session)
        deadline = time.monotonic() + 30
        while self.plane.is_connected(peer.nixl_session) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.plane.is_connected(peer.nixl_session):
            raise RuntimeError("NIXL best batch: no first contact with the peer")
        agent, remote = self.plane.agent, parse_session(peer.nixl_session)[0]
        self.handles: dict[str, Any] = {}
        self._keep: list[Any] = []
        blocks = [e for layer in layers for e in layer]
        for key, entries in ((f"nixl 1 request of all {len(blocks)} blocks", blocks),
                             (f"nixl 1 request 1x{src.nbytes // MiB}MiB",
                              [(src.ctypes.data, peer.addr, src.nbytes)])):
            rows = np.array(entries, dtype=np.uint64)
            zero = np.zeros(len(rows), dtype=np.uint64)
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                          np.column_stack((rows[:, 0], rows[:, 2], zero)), "DRAM")
            far = agent.prep_xfer_dlist(remote, np.column_stack((rows[:, 1], rows[:, 2], zero)),
                                        "DRAM")
            idx = np.arange(len(rows), dtype=np.int32)
            self.handles[key] = agent.make_prepped_xfer("WRITE", local, idx, far, idx)
            self._keep += [local, far]

    def run(self, ctx: Ctx) -> None:
        """Post each prepared request once; time post -> DONE."""
        agent = self.plane.agent
        for key, handle in self.handles.items():
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                time.sleep(2e-5)
                state = agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - t0
            if state != "DONE":
                raise RuntimeError(f"{key}: NIXL request ended {state}")
            ctx.add(key, elapsed)

    def close(self) -> None:
        """Free the requests and the agent."""
        for handle in self.handles.values():
            handle.release()
        for dlist in self._keep:
            dlist.release()
        self.plane.close()


def section_nixl_best(ctx: Ctx) -> None:
    """(a') NIXL's best batch (only with --data-plane nixl)."""
    if ctx.nixl_best is not None:
        ctx.nixl_best.run(ctx)


def section_layerwise(ctx: Ctx) -> None:
    """(b) Layer k submitted through MooncakeDataPlane as soon as its simulated compute ends."""
    n = len(ctx.layers)
    for mode in ctx.modes:
        key = f"layerwise [{mode.name}]"
        r = len(ctx.samples.get(key, []))
        ids = [("lw", r, k) for k in range(n)]
        t_submit = []
        t = time.perf_counter()
        for k in range(n):
            t += mode.compute_s
            simulate_compute(t)
            t0 = time.perf_counter()
            mode.plane.submit(ids[k], mode.session, ctx.layers[k])
            ctx.add(f"submit [{mode.name}]", time.perf_counter() - t0)
            t_submit.append(t0)
        done = mode.collector.wait(ids)
        last = max(done.values())
        ctx.add(key, last - t_submit[0])
        ctx.add(f"tail layerwise [{mode.name}]", last - t_submit[-1])


def section_send_after_forward(ctx: Ctx) -> None:
    """(c) Baseline: compute every layer first, then submit all the bytes at once."""
    n = len(ctx.layers)
    everything = [e for layer in ctx.layers for e in layer]
    for mode in ctx.modes:
        key = f"send-after-forward [{mode.name}]"
        r = len(ctx.samples.get(key, []))
        t = time.perf_counter()
        for _ in range(n):
            t += mode.compute_s
            simulate_compute(t)
        compute_end = time.perf_counter()
        mode.plane.submit(("saf", r), mode.session, everything)
        done = mode.collector.wait([("saf", r)])
        ctx.add(key, done[("saf", r)] - compute_end)


def section_tcp_socket(ctx: Ctx) -> None:
    """(d) Raw loopback TCP: sendall of the same bytes into a recv_into loop, 1-byte ack."""
    port = int(ctx.peer.ask(f"tcp {ctx.nbytes} 1"))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(memoryview(ctx.src).cast("B"))
        if sock.recv(1) != b"k":
            raise RuntimeError("no ack from peer")
        ctx.add("python socket sendall/recv_into", time.perf_counter() - t0)


def hook_costs(ctx: Ctx) -> None:
    """(e) Forward-hook cost per layer (WorkerLoop.layer_computed on a live P/D loop pair)."""
    for n in (64, 256):
        r = hook_cost_report(n, layers=61)
        ctx.figures[f"hook_{n}req_mean_us"] = round(r["hook_mean_s"] * 1e6, 2)
        ctx.figures[f"hook_{n}req_p99_us"] = round(r["hook_p99_s"] * 1e6, 2)
        ctx.figures[f"loop_work_{n}req_per_layer_us"] = round(r["loop_per_layer_s"] * 1e6, 1)
    ctx.figures["hook_256req_vs_goal_50us"] = round(ctx.figures["hook_256req_mean_us"] / 50, 3)
    timeline_costs(ctx.figures)
    checksum_cost(ctx.figures, ctx.args.layers, ctx.args.block_kib * 1024, ctx.nbytes)


def checksum_cost(figures: dict[str, float], layers: int, block: int, total: int,
                  rounds: int = 5) -> None:
    """(g) kv_checksum: CRC-32C of every block, as P computes it per write and D per DONE
    (blockruns.block_sums over a (layers, blocks, block) array); seconds per GB."""
    from lw.transport.blockruns import block_sums

    nblk = total // (layers * block)
    mem = np.random.default_rng(3).integers(0, 256, (layers, nblk, block), dtype=np.uint8)
    base = mem.ctypes.data
    blocks = list(range(nblk))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for layer in range(layers):
            block_sums(base + layer * nblk * block, block, nblk, blocks, ((0, block),))
        best = min(best, time.perf_counter() - t0)
    figures["kv_checksum_ms_per_gb"] = round(best / (total / 1e9) * 1e3, 1)
    figures["kv_checksum_gb_per_s"] = round(total / 1e9 / best, 2)


def timeline_costs(figures: dict[str, float], rounds: int = 3) -> None:
    """(f) The same at 256 requests with lifecycle timelines on and off, interleaved rounds
    (the goal: timelines add at most 5 % to the forward hook)."""
    sums = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for _ in range(rounds):
        for on in (True, False):
            r = hook_cost_report(256, layers=61, timeline=on)
            sums[on][0] += r["hook_mean_s"] / rounds
            sums[on][1] += r["loop_per_layer_s"] / rounds
    for on, tag in ((True, "on"), (False, "off")):
        figures[f"hook_256req_timeline_{tag}_us"] = round(sums[on][0] * 1e6, 2)
        figures[f"loop_work_256req_timeline_{tag}_us"] = round(sums[on][1] * 1e6, 1)
    figures["hook_256req_timeline_ratio"] = round(sums[True][0] / sums[False][0], 3)
    figures["loop_work_256req_timeline_ratio"] = round(sums[True][1] / sums[False][1], 3)


SECTIONS: list[Callable[[Ctx], None]] = [
    section_mooncake_best,
    section_nixl_best,
    section_layerwise,
    section_send_after_forward,
    section_tcp_socket,
]


def prepare(ctx: Ctx) -> None:
    """Warm up (first-touch page faults, connections), then time one layer's transfer alone
    through each plane and size that mode's simulated compute per layer from it."""
    everything = [e for layer in ctx.layers for e in layer]
    for mode in ctx.modes:
        mode.plane.submit("warm", mode.session, everything)
        mode.collector.wait(["warm"])
    for mode in ctx.modes:
        times = []
        for r in range(3):
            for k in range(len(ctx.layers)):
                t0 = time.perf_counter()
                mode.plane.submit(("cal", r, k), mode.session, ctx.layers[k])
                done = mode.collector.wait([("cal", r, k)])
                times.append(done[("cal", r, k)] - t0)
        mode.layer_transfer_s = statistics.median(times)
        mode.compute_s = (ctx.args.compute_ms / 1e3 if ctx.args.compute_ms
                          else mode.layer_transfer_s * ctx.args.compute_ratio)


def report(ctx: Ctx) -> None:
    """Print the table, then every figure and the ratios as ``key: value`` lines."""
    a, total = ctx.args, ctx.nbytes
    print(
        f"\n{a.mib} MiB, {a.layers} layers, blocks of {a.block_kib} KiB "
        f"({'scattered' if a.scatter else 'contiguous'} at the peer), {a.repeats} rounds, "
        f"{os.cpu_count()} CPUs, simulated compute per layer = "
        + (f"{a.compute_ms} ms for every plane" if a.compute_ms
           else f"{a.compute_ratio} x one layer's transfer alone")
    )
    for mode in ctx.modes:
        print(
            f"  [{mode.name}] one layer alone {mode.layer_transfer_s * 1e3:.3f} ms, "
            f"compute per layer {mode.compute_s * 1e3:.3f} ms"
        )
    print(f"{'section (median of rounds)':40} {'ms':>9} {'MB/s':>9} {'min ms':>9} {'max ms':>9}")
    for key, values in ctx.samples.items():
        if key.startswith(("tail", "submit")):
            continue
        med = statistics.median(values)
        print(
            f"{key:40} {med * 1e3:9.2f} {mbps(total, med):9.1f} "
            f"{min(values) * 1e3:9.2f} {max(values) * 1e3:9.2f}"
        )
    print(
        "(layerwise: first submit -> last completion; send-after-forward: compute end -> "
        "completion, i.e. its tail)"
    )
    best_key = min((k for k in ctx.samples if k.startswith("mooncake 1 batch")), key=ctx.median)
    best = mbps(total, ctx.median(best_key))
    # NIXL's best batch as issue 60 defines it: one prepped request of all the blocks
    nixl_key = next((k for k in ctx.samples if k.startswith("nixl 1 request")), "")
    socket_rate = mbps(total, ctx.median("python socket sendall/recv_into"))
    out: dict[str, object] = {
        "loadavg_1min_start_end": f"{ctx.notes['load_start']} {os.getloadavg()[0]:.2f}",
        "mooncake_best_variant": best_key,
        "mooncake_best_MBps": round(best, 1),
        "tcp_socket_MBps": round(socket_rate, 1),
        "bytes_verified": ctx.notes.get("verified", "false"),
    }
    ratios: dict[str, object] = {"mooncake_best_vs_tcp_socket": round(best / socket_rate, 3)}
    if nixl_key:
        nixl_best = mbps(total, ctx.median(nixl_key))
        contiguous = next(k for k in ctx.samples if k.startswith("nixl 1 request 1x"))
        out.update({"ucx_tls": os.environ.get("UCX_TLS", ""), "nixl_best_variant": nixl_key,
                    "nixl_best_MBps": round(nixl_best, 1),
                    "nixl_contiguous_MBps": round(mbps(total, ctx.median(contiguous)), 1)})
        ratios["nixl_best_vs_mooncake_best"] = round(nixl_best / best, 3)
    for mode in ctx.modes:
        sfx = "" if mode is ctx.modes[0] else f"_{mode.name}"
        m = f" [{mode.name}]"
        rate = mbps(total, ctx.median("layerwise" + m))
        if mode.name == "nixl":
            ratios["layerwise_nixl_vs_nixl_best"] = round(rate / nixl_best, 3)
            ratios["layerwise_nixl_vs_layerwise"] = round(
                rate / mbps(total, ctx.median(f"layerwise [{ctx.modes[0].name}]")), 3)
        tail_lw = ctx.median("tail layerwise" + m)
        tail_saf = ctx.median("send-after-forward" + m)
        out.update(
            {
                f"layerwise{sfx}_MBps": round(rate, 1),
                f"layerwise{sfx}_ideal_MBps": round(
                    mbps(total, len(ctx.layers) * mode.compute_s), 1
                ),
                f"layer_transfer{sfx}_ms": round(mode.layer_transfer_s * 1e3, 3),
                f"tail_layerwise{sfx}_ms": round(tail_lw * 1e3, 3),
                f"tail_send_after_forward{sfx}_ms": round(tail_saf * 1e3, 3),
                f"submit{sfx}_median_us": round(ctx.median("submit" + m) * 1e6, 1),
                f"submit{sfx}_max_us": round(max(ctx.samples["submit" + m]) * 1e6, 1),
            }
        )
        ratios.update(
            {
                f"layerwise{sfx}_vs_mooncake_best": round(rate / best, 3),
                f"tail_layerwise{sfx}_in_layer_transfer_times": round(
                    tail_lw / mode.layer_transfer_s, 3
                ),
                f"tail{sfx}_vs_send_after_forward": round(tail_lw / tail_saf, 3),
            }
        )
    print()
    for key, value in {**out, **ctx.figures, **ratios}.items():
        print(f"{key}: {value}")


def main() -> None:
    """Parse options, start the peer, run every section round by round, print the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="bytes moved by every section (MiB)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-kib", type=int, default=64, help="KV block size within a layer")
    p.add_argument(
        "--contiguous",
        dest="scatter",
        action="store_false",
        help="blocks keep their order at the peer (coalesce to one entry per layer)",
    )
    p.add_argument(
        "--compute-ratio",
        type=float,
        default=1.0,
        help="simulated compute per layer, in units of one layer's transfer time",
    )
    p.add_argument(
        "--compute-ms",
        type=float,
        default=0.0,
        help="simulated compute per layer in ms, the same for every plane (instead of "
             "--compute-ratio): a faster plane then gets no tighter pace than a slower one",
    )
    p.add_argument(
        "--modes",
        default="poll,spin",
        help="MooncakeDataPlane wait modes to run; the first is the headline",
    )
    p.add_argument("--data-plane", choices=("mooncake", "nixl"), default="mooncake",
                   help="nixl: also measure NIXL's best batch and NixlDataPlane (mode 'nixl', "
                        "after --modes), interleaved with Mooncake")
    p.add_argument("--repeats", type=int, default=9, help="rounds of every section")
    p.add_argument("--hooks-only", action="store_true",
                   help="only the forward-hook costs (with and without timelines) and the cost "
                        "of KV checksums")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--nixl", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer:
        run_peer(args.size, args.nixl)
        return
    if args.hooks_only:
        figures: dict[str, float] = {}
        timeline_costs(figures)
        checksum_cost(figures, args.layers, args.block_kib * 1024, args.mib * MiB)
        for key, value in figures.items():
            print(f"{key}: {value}")
        return
    total = args.mib * MiB
    block = args.block_kib * 1024
    if total % (args.layers * block):
        p.error("--mib must be a multiple of --layers x --block-kib")
    if not args.compute_ms >= 0 or not args.compute_ratio > 0:
        p.error(f"--compute-ms must be >= 0 and --compute-ratio > 0, got {args.compute_ms} "
                f"and {args.compute_ratio}")
    nixl = args.data_plane == "nixl"
    peer = PeerProcess(total, nixl)
    modes: list[Mode] = []
    nixl_best: NixlBest | None = None
    raw = MooncakeDataPlane("127.0.0.1", wait="spin")  # only its engine is used, by (a)
    try:
        src = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
        raw.register_memory(src.ctypes.data, total)
        for name in args.modes.split(",") + (["nixl"] if nixl else []):
            if name == "nixl":
                from lw.transport.dataplane.nixl import NixlDataPlane

                # built as P's worker builds it: a writer without UCX's progress thread
                plane: Any = NixlDataPlane("127.0.0.1", progress_thread=False)
                session = peer.nixl_session
            else:
                plane = MooncakeDataPlane("127.0.0.1", wait=name)  # type: ignore[arg-type]
                session = peer.session
            modes.append(Mode(name, plane, Collector(plane), session))
            plane.register_memory(src.ctypes.data, total)
            plane.connect(session)
        layers, order = make_layers(
            src.ctypes.data, peer.addr, total, args.layers, block, args.scatter
        )
        if nixl:
            nixl_best = NixlBest(src, peer, layers)
        expected = np.empty_like(src)
        expected.reshape(-1, block)[order] = src.reshape(-1, block)
        ctx = Ctx(args, src, peer, layers, hashlib.sha256(expected).hexdigest(), modes, raw,
                  nixl_best)
        ctx.notes["load_start"] = f"{os.getloadavg()[0]:.2f}"
        prepare(ctx)
        for _ in range(args.repeats):
            for section in SECTIONS:
                section(ctx)
        verified = []
        for mode in modes:  # one more layerwise transfer per mode, then check the bytes
            ctx.peer.ask("zero")
            mode.plane.submit("check", mode.session, [e for layer in layers for e in layer])
            mode.collector.wait(["check"])
            verified.append(ctx.peer.ask(f"sha 0 {total}") == ctx.expected_sha)
        ctx.notes["verified"] = str(all(verified)).lower()
        hook_costs(ctx)
        report(ctx)
    finally:
        for mode in modes:
            mode.collector.stop()
            mode.plane.close()
        if nixl_best is not None:
            nixl_best.close()
        raw.close()
        peer.close()


if __name__ == "__main__":
    main()
