"""The synthetic cluster under faults: real processes, real sockets, real Mooncake transfers.

Each case checks the issue's promises: every request is accounted for (done or failed) within its
deadlines, no request finishes with wrong bytes, every block returns to its pool, and no P rank's
step waits on the network (the longest step stays far below the fault's duration).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lw.lab.synthetic import ClusterConfig, ClusterResult, run_cluster
from lw.lab.synthetic.config import LINK_DEADLINES
from lw.transport.loopconfig import LoopConfig

from .conftest import needs_mooncake

KEY = b"synthetic-cluster-key-0123456789"
ROOT = Path(__file__).resolve().parents[2]

# Short deadlines: Mooncake's transfer timeout cannot go below 5 s, so the lease is >= 7.5 s.
FAST = dict(
    requests=16,
    prefill_dp=2,
    layers=4,
    blocks_per_request=2,
    block_bytes=16 * 1024,
    d_blocks=16,
    p_blocks=16,
    layer_ms=2.0,
    meta_retry_s=0.1,
    meta_attempts=10,
    ack_retry_s=0.1,
    request_timeout_s=2.0,
    prefill_timeout_s=3.0,
    transfer_timeout_s=5.0,
    lease_margin_s=0.5,
    freeze_s=4.0,
    cluster_key=KEY,
    run_timeout_s=60.0,
)
# timing: the property (no P step waits on the network) is a wall-clock bound; this one is
# below every fault's duration (>= 4 s) and generous for a loaded 2-core box
STEP_BOUND_S = 3.0


def run(fault: str, data_plane: str = "mooncake", **kw: object) -> ClusterResult:
    cfg = ClusterConfig(**{**FAST, "fault": fault, "data_plane": data_plane, **kw})  # type: ignore[arg-type]
    res = run_cluster(cfg)
    assert not res.errors, (res.errors, res.log_dir)
    assert res.accounted == cfg.requests, res
    assert res.double_reports == 0
    assert res.corrupt == 0, res.reasons
    assert res.leaked == 0, (res.leaked_p, res.leaked_d)
    assert res.p_unreported == 0
    assert res.max_step_s < STEP_BOUND_S, res.max_step_s
    dcfg = cfg.decode_config()
    # timing: every request the decoder reported on ended within its deadline (+ quarantine
    # lease), with 2 s for the loops to act on the timers. A frozen decoder acts on no timer
    # until it thaws: a deadline that fell inside the freeze fires at the thaw (measured: a
    # request allocated just before a 6 s freeze ended at 6 + 7.5 s, past 3 + 7.5 + 2)
    frozen = cfg.freeze_s if "freeze" in fault else 0.0
    # a lease that ends with a sender in doubt then waits for the data-plane fence, and a fence
    # that failed (its cut connections not closed in time) keeps the blocks and is asked again
    # after fence_retry_s, as the model's bound counts them (lw.sim.config). CI saw one lossy-link
    # run end a request at 70 s against 35.5 (stop 67; not reproduced in 7 runs, loaded or not)
    fence = LoopConfig.fence_timeout_s if dcfg.fence_data else 0.0
    fails = res.counters["d.core.fence_failures"]
    bound = (max(dcfg.prefill_timeout_s, frozen) + dcfg.lease_s + fence
             + fails * (dcfg.fence_retry_s + fence) + 2.0)
    assert res.max_outcome_s < bound, (res.max_outcome_s, bound, dict(res.counters))
    assert res.ok
    return res


# ----------------------------------------------------------------------------- in-process
@pytest.mark.parametrize("fault", ["none", "drop-messages", "duplicate-messages",
                                   "garbage-messages", "no-cluster-key"])
def test_inprocess_cluster(fault: str) -> None:
    res = run(fault, "inprocess", transfer_timeout_s=1.0, requests=12)
    if fault in ("none", "duplicate-messages"):
        assert res.done == 12 and res.failed == 0
    if fault == "no-cluster-key":
        assert res.counters["d.side.unauthenticated"] > 0 and res.done > 0


def test_inprocess_refuses_process_faults() -> None:
    with pytest.raises(ValueError, match="mooncake"):
        ClusterConfig(fault="kill-decoder", data_plane="inprocess")


# ----------------------------------------------------------------------------- tensor parallel
@pytest.mark.parametrize(("p_tp", "d_tp", "mla"), [(4, 2, False), (1, 2, False), (2, 4, False),
                                                   (4, 2, True), (1, 2, True)])
def test_inprocess_tensor_parallel(p_tp: int, d_tp: int, mla: bool) -> None:
    """Every D TP worker gets exactly its head slices (MLA: the whole latent, one writer)."""
    res = run("none", "inprocess", transfer_timeout_s=1.0, requests=12, prefill_tp=p_tp,
              decode_tp=d_tp, mla=mla)
    assert res.done == 12 and res.failed == 0
    per_request = FAST["layers"] * FAST["blocks_per_request"] * FAST["block_bytes"]  # type: ignore[operator]
    assert res.bytes_moved == 12 * per_request * (d_tp if mla else 1)


@pytest.mark.parametrize("fault", ["drop-messages", "duplicate-messages"])
def test_inprocess_tensor_parallel_under_faults(fault: str) -> None:
    res = run(fault, "inprocess", transfer_timeout_s=1.0, requests=12, prefill_tp=2,
              decode_tp=2)
    if fault == "duplicate-messages":
        assert res.done == 12


def test_a_wrong_head_slice_is_corrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """P fills its two heads swapped: each D TP worker gets one wrong head, every block counts."""
    from lw.lab.synthetic.pattern import Pattern

    real = Pattern.fill_heads

    def swapped(self: Pattern, block: object, rid: str, layer: int, index: int, lo: int,
                hi: int) -> None:
        real(self, block, rid, layer, index, lo, hi)  # type: ignore[arg-type]
        if hi - lo == 2:
            n = self.block_bytes
            self.fill(block[:n], rid, layer, index, lo + 1)  # type: ignore[index]

    monkeypatch.setattr(Pattern, "fill_heads", swapped)
    cfg = ClusterConfig(**{**FAST, "data_plane": "inprocess", "transfer_timeout_s": 1.0,  # type: ignore[arg-type]
                           "requests": 4, "prefill_tp": 1, "decode_tp": 2})
    res = run_cluster(cfg)
    assert res.corrupt == 4 and res.done == 0 and res.leaked == 0, res
    blocks = FAST["layers"] * FAST["blocks_per_request"]  # type: ignore[operator]
    assert res.reasons[f"corrupt: {blocks} of {blocks} blocks wrong"] == 4


def test_tensor_parallel_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="decode: 3 KV heads do not split evenly over TP 2"):
        ClusterConfig(prefill_tp=3, decode_tp=2)
    assert ClusterConfig(prefill_tp=4, decode_tp=2, mla=True).kv_heads == 1
    assert ClusterConfig(prefill_tp=1, decode_tp=4, kv_heads=2).head_bytes == 32 * 1024


# ----------------------------------------------------------------------------- processes
@pytest.mark.slow
@needs_mooncake
def test_mooncake_cluster_no_fault() -> None:
    res = run("none")
    assert res.done == 16 and res.failed == 0
    assert res.bytes_moved == 16 * 4 * 2 * 16 * 1024


@pytest.mark.slow
@needs_mooncake
def test_kill_decoder_mid_transfer() -> None:
    res = run("kill-decoder")
    assert res.decoder_generations == 2  # the new incarnation served the rest
    assert res.failed > 0 and res.done > 4


@pytest.mark.slow
@needs_mooncake
def test_freeze_decoder_before_contact() -> None:
    res = run("freeze-decoder-before-contact")
    assert res.failed > 0 and res.done > 0


@pytest.mark.slow
@needs_mooncake
def test_freeze_decoder_mid_transfer() -> None:
    res = run("freeze-decoder-mid-transfer", freeze_s=6.0)  # past Mooncake's 5 s timeout
    assert res.done > 0


@pytest.mark.slow
@needs_mooncake
def test_freeze_then_kill_decoder() -> None:
    res = run("freeze-kill-decoder", freeze_s=6.0)  # writes to the frozen peer time out first
    assert res.decoder_generations == 2 and res.failed > 0 and res.done > 0


@pytest.mark.slow
@needs_mooncake
def test_kill_prefill_rank() -> None:
    res = run("kill-prefill-rank")
    assert res.dead_ranks == [1]
    assert res.done > 0


@pytest.mark.slow
@needs_mooncake
def test_kill_prefill_rank_with_prefill_failover() -> None:
    """Issue 22: the dead rank's requests are prefilled again on the live one, none fails;
    those it had not written into go over within the heartbeat budget plus a prefill."""
    res = run("kill-prefill-rank", requests=40, retry_prefill=2)
    assert res.dead_ranks == [1]
    assert (res.done, res.failed, res.leaked, res.corrupt) == (40, 0, 0, 0) and res.ok
    assert res.reprefills > 0
    if res.reprefills > res.reprefills_fenced:
        cfg = res.config
        assert res.failover_s < cfg.heartbeat_s * (cfg.heartbeat_misses + 1) + 2.0


@pytest.mark.slow
@needs_mooncake
@pytest.mark.parametrize("fault", ["drop-messages", "duplicate-messages", "garbage-messages",
                                   "no-cluster-key"])
def test_side_channel_faults_between_processes(fault: str) -> None:
    res = run(fault, requests=10)
    if fault == "duplicate-messages":
        assert res.done == 10
    if fault == "garbage-messages":
        assert res.counters["p.side.wire_errors"] + res.counters["d.side.wire_errors"] > 0
    if fault == "no-cluster-key":
        assert res.counters["d.side.unauthenticated"] > 0


@pytest.mark.slow
@needs_mooncake
@pytest.mark.parametrize("fault", ["kill-decoder", "freeze-decoder-before-contact"])
def test_process_faults_with_tensor_parallel(fault: str) -> None:
    res = run(fault, prefill_tp=2, decode_tp=2, requests=12)
    assert res.failed > 0 and res.done > 0


@pytest.mark.slow
@needs_mooncake
def test_demo_command_line() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "lw", "demo", "--engine", "synthetic", "--requests", "8",
         "--prefill-dp", "2", "--layers", "4", "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == (
        "summary done=8 failed=0 leaked_blocks=0 corrupt=0")


@pytest.mark.slow
@needs_mooncake
def test_demo_command_line_tensor_parallel() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "lw", "demo", "--engine", "synthetic", "--requests", "8",
         "--prefill-dp", "2", "--prefill-tp", "4", "--decode-tp", "2", "--layers", "4",
         "--quiet"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "P TP 4 x D TP 2" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == (
        "summary done=8 failed=0 leaked_blocks=0 corrupt=0")


def test_demo_main_inprocess(capsys: pytest.CaptureFixture[str]) -> None:
    from lw.lab.demo import main

    rc = main(["--engine", "synthetic", "--data-plane", "inprocess", "--requests", "6",
               "--layers", "3", "--fault", "duplicate", "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, "\n".join(out)
    assert out[-1] == "summary done=6 failed=0 leaked_blocks=0 corrupt=0"
    assert any("blocks held at end: P / D" in line and line.endswith("0 / 0") for line in out)
    assert main(["--engine", "synthetic", "--fault", "no-such-fault"]) == 2


def test_vllm_engine_gets_its_own_options() -> None:
    from lw.lab.demo import _without_engine

    assert _without_engine(["--engine", "vllm", "--requests", "3"]) == ["--requests", "3"]
    assert _without_engine(["--engine=vllm", "--keep"]) == ["--keep"]


@needs_mooncake
def test_status_table_while_the_decoder_is_frozen_names_state_peer_and_deadline(
        tmp_path: Path) -> None:
    tables: list[str] = []
    cfg = ClusterConfig(**{**FAST, "fault": "freeze-decoder-mid-transfer",  # type: ignore[arg-type]
                           "status": True, "trace_out": str(tmp_path / "t.json")})
    res = run_cluster(cfg, on_status=tables.append)
    assert res.accounted == cfg.requests and res.leaked == 0 and res.corrupt == 0
    (text,) = tables
    assert "into fault freeze-decoder-mid-transfer" in text
    assert "no status from" in text and "frozen" in text  # the frozen decoder cannot answer
    rows = [ln for ln in text.splitlines() if ln.startswith("P ")]
    for row in rows:  # each P request waiting on the frozen D names it and its deadline
        assert "tcp://" in row and "s " in row, row
    assert res.counters["trace_workers"] >= 1  # (a loaded machine may miss the 5 s answer)


def test_trace_out_has_spans_named_after_declared_states_on_both_sides(tmp_path: Path) -> None:
    import json

    from lw.fsm.lifecycles import decode_declaration, prefill_declaration

    out = tmp_path / "trace.json"
    tables: list[str] = []
    cfg = ClusterConfig(**{**FAST, "requests": 6, "data_plane": "inprocess",  # type: ignore[arg-type]
                           "trace_out": str(out), "status": True})
    res = run_cluster(cfg, on_status=tables.append)
    assert res.done == 6
    assert len(tables) == 1 and "live request(s)" in tables[0]
    events = json.loads(out.read_text())["traceEvents"]
    declared = set(prefill_declaration(cfg.layers).states) | set(decode_declaration().states)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    sides: dict[str, set[str]] = {}
    for e in events:
        if e["ph"] == "X":
            assert e["name"] in declared and e["dur"] >= 0
            sides.setdefault(names[(e["pid"], e["tid"])], set()).add(e["cat"])
    assert len(sides) == 6 and all(s == {"prefill", "decode"} for s in sides.values())


@pytest.mark.parametrize("checksum", [False, True])
def test_corrupt_writes_reach_the_decoder_only_without_kv_checksums(checksum: bool) -> None:
    cfg = ClusterConfig(**{**FAST, "fault": "corrupt-write",  # type: ignore[arg-type]
                           "data_plane": "inprocess", "kv_checksum": checksum})
    res = run_cluster(cfg)
    assert res.accounted == cfg.requests and res.leaked == 0, res
    if not checksum:
        assert res.corrupt > 0  # the fault is real: D's pattern check sees wrong KV
        return
    assert res.corrupt == 0 and res.failed > 0, res.reasons
    assert any(why.startswith("D: KV checksum mismatch") for why in res.reasons), res.reasons


def _netns_missing() -> str:
    from lw.lab.synthetic.netns import unavailable

    return unavailable()


@needs_mooncake
@pytest.mark.skipif(bool(_netns_missing()), reason=f"no network namespaces: {_netns_missing()}")
@pytest.mark.parametrize("fault", ["partition-before-contact", "partition-mid-transfer",
                                   "partition-long"])
def test_real_network_partitions_between_p_and_d(fault: str) -> None:
    """The decoder in its own network namespace behind a veth pair; the link is cut (and healed)
    in the kernel. Every request ends, nothing leaks, nothing corrupt; a short cut heals."""
    res = run(fault, long_partition_s=8.0, partition_s=0.4)
    assert res.config.d_netns and res.config.d_host.startswith("10.77.")
    if fault == "partition-mid-transfer":  # 0.4 s: under every budget, TCP retransmits
        assert res.done >= res.config.requests // 2, res.reasons
    else:
        assert res.failed > 0
        assert res.detect_s < 3.0, res.detect_s  # timing: heartbeats, not the 2-6 s deadlines


def _tun_missing() -> str:
    from lw.lab.synthetic.netem import unavailable

    return unavailable()


needs_tun = pytest.mark.skipif(bool(_tun_missing()),
                               reason=f"no TUN devices or namespaces: {_tun_missing()}")


def _udp_pair(link: object) -> tuple[socket.socket, socket.socket]:
    """A UDP socket on P's side of ``link`` and one inside the decoder's namespace."""
    from lw.lab.synthetic.netem import Link, in_netns

    assert isinstance(link, Link)
    p = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    p.bind((link.host_ip, 0))
    d = in_netns(link.name, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    d.bind((link.ns_ip, 0))
    for s in (p, d):
        s.settimeout(1.0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    return p, d


def _loss_one_way(tx: socket.socket, rx: socket.socket, n: int) -> float:
    """Send ``n`` numbered datagrams in bursts (under the TUN's queue of 500, so only the relay
    drops) and return the fraction that did not arrive."""
    got: set[int] = set()
    for burst in range(0, n, 100):
        for i in range(burst, min(n, burst + 100)):
            tx.sendto(i.to_bytes(4, "big"), rx.getsockname())
        # the relay drains a burst in a few ms; the queue overflows only if it falls 4 bursts
        # (0.2 s) behind
        time.sleep(0.05)
    rx.settimeout(1.0)  # the last survivors are in by then, also from a relay that is late
    try:
        while True:
            got.add(int.from_bytes(rx.recv(64)[:4], "big"))
    except TimeoutError:
        pass
    return 1 - len(got) / n


@needs_tun
def test_the_link_relay_drops_the_configured_fraction_each_way() -> None:
    from lw.lab.synthetic.netem import Link

    with Link(loss=0.3, seed=1) as link:
        p, d = _udp_pair(link)
        with p, d:
            assert 0.25 < _loss_one_way(p, d, 2000) < 0.35
            assert 0.25 < _loss_one_way(d, p, 2000) < 0.35
    assert link.stats.dropped_pd + link.stats.dropped_dp > 1000
    assert link.stats.foreign == 0  # nothing but the two link addresses crossed it
    _assert_link_gone(link)


@needs_tun
def test_the_link_relay_delays_one_way_and_keeps_order() -> None:
    from lw.lab.synthetic.netem import Link

    with Link(delay_pd_s=0.2) as link:
        p, d = _udp_pair(link)
        with p, d:
            rtts = []
            for _ in range(3):  # an echo: 200 ms out (P -> D), undelayed back
                t0 = time.monotonic()
                p.sendto(b"ping", d.getsockname())
                data, src = d.recvfrom(64)
                d.sendto(data, src)
                p.recv(64)
                rtts.append(time.monotonic() - t0)
            assert 0.2 <= min(rtts) < 0.45, rtts  # timing: the 0.2 s delay, applied once
            for i in range(200):  # a constant delay keeps the order of a direction
                p.sendto(i.to_bytes(4, "big"), d.getsockname())
            order = [int.from_bytes(d.recv(64), "big") for _ in range(200)]
            assert order == list(range(200))
    _assert_link_gone(link)


def _assert_link_gone(link: object) -> None:
    """The namespace and both TUN devices of ``link`` are gone."""
    from lw.lab.synthetic.netem import Link

    assert isinstance(link, Link)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert link.name not in names and link.host_if not in links


@needs_mooncake
@needs_tun
@pytest.mark.parametrize("fault", ["lossy-link", "slow-link"])
def test_lossy_and_slow_links_between_p_and_d(fault: str) -> None:
    """The decoder behind two TUN devices and a relay that drops 30 % of the packets or delays
    them 200 ms, with deadlines sized for such a link (the slow link's as the fault table runs
    it, the lossy link's halved): every request ends, nothing leaks, nothing corrupt, nothing
    to detect; on the slow link every request completes (slow is not dead: issue 40)."""
    # Two waves of 8 requests (16 blocks, 2 a request): a first wave failed by D's deadline
    # (24 s) keeps its blocks in doubt for the lease (30.5 s), and the second then needs up to
    # its own 24 s: about 80 s before every request is accounted, not the 60 s of the others
    # (one suite run ran out at 14 of 16). The lossy link runs one wave (8 requests): what it
    # shows, requests failed by their deadlines, blocks in doubt for the lease, nothing
    # leaked, needs no second wave behind the first (69 s of the suite's time otherwise).
    # Its deadlines are halved too (Mooncake's transfer timeout stays above its 5 s floor): at
    # 30 % loss hardly a byte crosses, so every request fails by them whatever their length,
    # and the lease that follows is what the row waits for (63 s of the suite at full length).
    lossy = {"requests": 8, "request_timeout_s": 10.0, "progress_timeout_s": 4.0,
             "prefill_timeout_s": 12.0, "transfer_timeout_s": 6.0, "settle_timeout_s": 30.0}
    waves = lossy if fault == "lossy-link" else {}
    res = run(fault, **{**LINK_DEADLINES, **waves}, run_timeout_s=120.0)
    if fault == "slow-link":
        assert res.done == res.config.requests, res.reasons
    assert res.config.d_netns and res.config.d_host.startswith("10.77.")
    assert res.detect_s == 0  # nothing dies: no injection moment, no detection
    # the transfers crossed the relay (in bytes: under 30 % loss less than a MiB may get through)
    assert res.counters["link.bytes"] > 0
    if fault == "lossy-link":
        assert res.counters["link.dropped"] > 0
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert res.config.d_netns not in names


def test_client_aborts_under_the_fault_mix_leak_nothing_and_corrupt_nothing() -> None:
    cfg = ClusterConfig(**{**FAST, "requests": 40, "fault": "mix",  # type: ignore[arg-type]
                           "data_plane": "inprocess", "kv_checksum": True, "abort_rate": 0.5,
                           "layer_ms": 5.0})  # transfers long enough for aborts to land in
    res = run_cluster(cfg)
    assert res.accounted == cfg.requests and res.leaked == 0 and res.corrupt == 0, res
    assert res.aborts > 0 and res.double_reports == 0 and not res.errors
