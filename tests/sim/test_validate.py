"""``lw validate``: recorded runs of the synthetic cluster are behaviours of the world, a driver
defect the checker cannot see is not, and malformed trace files are refused by file and line."""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest

from lw.lab.synthetic import ClusterConfig, prefill_rank, run_cluster
from lw.sim import validate_cli

from ..runtime.conftest import needs_mooncake

SMALL = dict(requests=6, prefill_dp=2, layers=3, blocks_per_request=2, block_bytes=4096,
             d_blocks=8, p_blocks=8, layer_ms=1.0, data_plane="inprocess", run_timeout_s=30.0)


class EarlyPlane:
    """A planted driver defect: the data plane reports each write complete at once, before any
    of its bytes land (here they never do: a late landing would outlive the test's memory). The
    checker's world takes a completion to mean the bytes landed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[tuple[int, int, int]],
               within_s: float = float("inf")) -> None:
        self._inner.submit(xfer_id, session, [], within_s)  # complete, nothing copied

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _run(tmp_path: Path, **kw: Any) -> str:
    out = str(tmp_path / "run.jsonl")
    res = run_cluster(ClusterConfig(**{**SMALL, **kw, "timelines_out": out}))  # type: ignore[arg-type]
    assert not res.errors, res.errors
    assert res.counters.get("timeline_workers") == 3
    return out


def test_clean_run_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run(tmp_path, kv_checksum=True)
    assert validate_cli.main([path]) == 0
    out = capsys.readouterr().out
    assert "valid: 6 requests, 6 valid, 0 rejected" in out


@pytest.mark.parametrize("shape", [dict(prefill_tp=2), dict(decode_tp=2),
                                   dict(prefill_tp=2, decode_tp=2, mla=True), dict(chunks=2)])
def test_tp_mla_and_chunked_runs_are_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           shape: dict[str, Any]) -> None:
    """Each D TP worker carries its own incarnation number: they are matched per rank."""
    out = str(tmp_path / "run.jsonl")
    res = run_cluster(ClusterConfig(**{**SMALL, **shape, "timelines_out": out}))  # type: ignore[arg-type]
    assert not res.errors, res.errors
    assert validate_cli.main([out]) == 0, capsys.readouterr().out


def test_a_recorded_step_the_model_cannot_take_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One write completion removed from P's timeline: its next completion skips a layer."""
    path = _run(tmp_path)
    lines = Path(path).read_text().splitlines()
    gone = next(i for i, line in enumerate(lines)
                if '"req": "req-2"' in line and '"layer_sent"' in line and '"detail": "1"' in line)
    del lines[gone]
    Path(path).write_text("\n".join(lines) + "\n")
    assert validate_cli.main([path, "--request", "req-2"]) == 1
    out = capsys.readouterr().out
    # the next completion is the first entry the model cannot explain, and the model's own next
    # step there is the missing one
    nxt = next(i for i, line in enumerate(lines) if '"req": "req-2"' in line
               and '"layer_sent"' in line and '"detail": "2"' in line)
    assert f"line {nxt + 1} " in out and "layer_sent LAYER_1_SENT->LAYER_2_SENT (2)" in out
    assert "the model allowed there: " in out and "layer_sent LAYER_0_SENT->LAYER_1_SENT (1)" in out


def test_search_budget_gives_undecided_not_a_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run(tmp_path)
    assert validate_cli.main([path, "--max-states", "3"]) == 0
    assert "undecided" in capsys.readouterr().out
    assert validate_cli.main([path, "--max-states", "3", "--strict"]) == 1


def test_write_complete_before_bytes_land_is_rejected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real = prefill_rank.data_plane_for

    def planted(cfg: ClusterConfig, name: str, host: str = "127.0.0.1",
                writer: bool = False) -> Any:
        dp = real(cfg, name, host, writer=writer)
        return EarlyPlane(dp) if name.startswith("p") else dp

    monkeypatch.setattr(prefill_rank, "data_plane_for", planted)
    path = _run(tmp_path, kv_checksum=True)
    assert validate_cli.main([path]) == 1
    out = capsys.readouterr().out
    assert "REJECTED" in out
    # the first event no behaviour explains: D refusing the sender's DONE on its checksums
    assert "first unexplained: decode-0/0" in out
    assert "fail RECEIVING->FAILED (KV checksum" in out


def _write(tmp_path: Path, lines: list[str]) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


HEAD = {"format": "lw-trace", "version": 1, "source": "test",
        "shape": {"layers": 1, "prefill_tp": 1, "decode_tp": 1, "blocks_per_request": 1,
                  "chunks": 1, "mla": False, "kv_heads": 1},
        "prefill": {"meta_retry_s": 1.0, "meta_attempts": 2, "ack_retry_s": 1.0,
                    "ack_attempts": 2, "request_timeout_s": 30.0},
        "decode": {"prefill_timeout_s": 60.0, "lease_s": 90.0}}
WORKER = {"worker": 0, "engine": "prefill-dp0", "role": "prefill", "rank": 0, "incarnation": 1}


@pytest.mark.parametrize("lines, says", [
    ([json.dumps({**HEAD, "version": 7})], ":1: field 'version' is 7"),
    ([json.dumps(HEAD), "{not json"], ":2: not JSON"),
    ([json.dumps(HEAD), json.dumps(WORKER),
      json.dumps({"w": 0, "t": 0.0, "req": "r", "src": "", "dst": "", "detail": ""})],
     ":3: field 'event' missing"),
    ([json.dumps(HEAD), json.dumps({"w": 0, "t": 0.0, "req": "r", "event": "admitted",
                                    "src": "", "dst": "", "detail": ""})],
     ":2: field 'w' is 0: no such worker"),
    ([json.dumps({**HEAD, "shape": {**HEAD["shape"], "layers": "8"}})],  # type: ignore[dict-item]
     ":1: shape: field 'layers' must be int"),
])
def test_malformed_trace_exits_2_naming_line_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], says: str) -> None:
    path = _write(tmp_path, lines)
    assert validate_cli.main([path]) == 2
    err = capsys.readouterr().err
    assert path + says in err, err


def test_claim_before_the_routing_notice_is_valid(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The proxy's routing notice reaches each D worker on its own, and P, started at the same
    moment, may claim first (about one run in ten with D TP 2): planted here in a real trace by
    moving one D worker's notice after its claim."""
    out = str(tmp_path / "run.jsonl")
    res = run_cluster(ClusterConfig(**{**SMALL, "decode_tp": 2, "timelines_out": out}))  # type: ignore[arg-type]
    assert not res.errors, res.errors
    lines = Path(out).read_text().splitlines()
    d0 = next(json.loads(x)["worker"] for x in lines if '"role": "decode"' in x
              and '"rank": 0' in x)
    at = {json.loads(x)["event"]: i for i, x in enumerate(lines)
          if f'"w": {d0},' in x and '"req": "req-3"' in x
          and ('"routed"' in x or '"claim"' in x)}
    r, c = at["routed"], at["claim"]
    assert r < c
    routed, claim = json.loads(lines[r]), json.loads(lines[c])
    routed["t"], claim["t"] = claim["t"], routed["t"]
    routed["src"] = routed["dst"] = "RECEIVING"  # D records the notice in the state it is in
    lines[r], lines[c] = json.dumps(claim), json.dumps(routed)
    Path(out).write_text("\n".join(lines) + "\n")
    assert validate_cli.main([out, "--request", "req-3"]) == 0, capsys.readouterr().out


def test_claim_before_d_registers_is_valid(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """D's scheduler posts a request to the metaserver in the step whose metadata registers it
    on each D worker, so P's first claim may reach a worker before it registered: D answers
    "unknown" and P asks again at its next retry tick (an MLA run of the e2e shapes did, CI of
    2026-12-03). Planted in a real trace: P's first claim of req-3 is answered "unknown"."""
    out = str(tmp_path / "run.jsonl")
    res = run_cluster(ClusterConfig(**{**SMALL, "decode_tp": 2, "timelines_out": out}))  # type: ignore[arg-type]
    assert not res.errors, res.errors
    lines = Path(out).read_text().splitlines()
    i = next(k for k, x in enumerate(lines) if '"req": "req-3"' in x and '"admitted"' in x)
    admitted = json.loads(lines[i])
    lines[i + 1:i + 1] = [json.dumps(dict(admitted, event=ev, src="AWAIT_DECODER_META",
                                          dst="AWAIT_DECODER_META", detail=""))
                          for ev in ("meta_unknown", "meta_timer")]
    Path(out).write_text("\n".join(lines) + "\n")
    assert validate_cli.main([out, "--request", "req-3"]) == 0, capsys.readouterr().out


# A recorded prefill failover (kept from `lw demo --engine synthetic --requests 40 --prefill-dp 2
# --fault kill-prefill-rank --retry-prefill 2 --timelines-out DIR`, 2026-12-01): P rank 1 was
# killed, its timeline is absent; four of its requests: req-0 on the live rank, req-1 done on
# the killed rank before it died, req-23 routed to it and prefilled again at once on the live
# rank (epoch 1), req-16 claimed by it, fenced for the lease, then prefilled again.
FAILOVER = Path(__file__).parent / "data" / "failover-kill-prefill-rank.jsonl"


def test_prefill_failover_trace_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_cli.main([str(FAILOVER), "-v"]) == 0
    out = capsys.readouterr().out
    assert "valid: 4 requests, 4 valid, 0 rejected" in out


@pytest.mark.slow
@needs_mooncake
def test_a_live_prefill_failover_run_is_valid(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The same row run here: a P rank killed, its requests prefilled again on the other."""
    out = str(tmp_path / "run.jsonl")
    res = run_cluster(ClusterConfig(requests=40, prefill_dp=2, fault="kill-prefill-rank",
                                    retry_prefill=2, timelines_out=out))
    assert res.dead_ranks == [1] and res.reprefills > 0 and not res.errors, res.errors
    assert validate_cli.main([out, "--seconds", "60"]) == 0, capsys.readouterr().out
    assert "0 rejected, 0 undecided" in capsys.readouterr().out


def _failover_lines() -> list[dict[str, Any]]:
    return [json.loads(x) for x in FAILOVER.read_text().splitlines()]


def _entry(objs: list[dict[str, Any]], req: str, event: str, epoch_detail: str = "") -> int:
    return next(i for i, o in enumerate(objs) if o.get("req") == req and o.get("event") == event
                and epoch_detail in o.get("detail", ""))


def _planted(tmp_path: Path, objs: list[dict[str, Any]]) -> str:
    return _write(tmp_path, [json.dumps(o) for o in objs])


def test_a_done_of_the_old_epoch_accepted_is_rejected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """D counts a DONE of the killed rank, to which epoch 0 was routed, as epoch 1's (req-23;
    in req-16, fenced, the same plant is undecided within the test's budget: its search space,
    the dead rank's retries and write failures through the lease, is not exhausted in 400 s)."""
    objs = _failover_lines()
    i = _entry(objs, "req-23", "sender_done")
    assert objs[i]["detail"] == "P prefill-dp0 rank 0"
    objs[i]["detail"] = "P prefill-dp1 rank 0"  # the engine of epoch 0, lost and replaced
    path = _planted(tmp_path, objs)
    assert validate_cli.main([path, "--request", "req-23", "--seconds", "120"]) == 1
    out = capsys.readouterr().out
    assert "first unexplained: decode-0/0#" in out and f"line {i + 1} " in out, out
    assert "sender_done RECEIVING->RECEIVING (P prefill-dp1 rank 0)" in out
    # what the model allowed there: the DONE of the epoch's own sender, or one of the old
    # epoch refused as stale
    assert "sender_done RECEIVING->RECEIVING (P prefill-dp0 rank 0)" in out
    assert "stale_epoch RECEIVING->RECEIVING (epoch 0, current 1)" in out


def test_a_retry_with_no_loss_is_rejected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """D prefills again while the P it was routed to lives on and finishes the request."""
    objs = _failover_lines()
    i = _entry(objs, "req-0", "routed")
    planted = {**objs[i], "t": objs[i]["t"] + 1e-6, "event": "retry",
               "detail": "epoch 1: prefill engine prefill-dp0 lost: no message or heartbeat "
                         "answer for 1.7s"}
    objs.insert(i + 1, planted)
    path = _planted(tmp_path, objs)
    assert validate_cli.main([path, "--request", "req-0", "--seconds", "120"]) == 1
    out = capsys.readouterr().out
    assert f"line {i + 2} " in out and "retry PREFILL_REQUESTED->PREFILL_REQUESTED" in out, out
    assert "the model allowed there: claim PREFILL_REQUESTED->RECEIVING (P prefill-dp0 rank 0)" \
        in out


# Two requests of a kill-prefill-rank row with retry_fresh_blocks (2026-12-02): req-19, claimed
# by the killed rank, goes on at once in fresh blocks ("fresh"), its old blocks held until the
# lease ("ghost_released"); req-27, routed to the killed rank before it claimed, is prefilled
# again into its own blocks.
FRESH = Path(__file__).parent / "data" / "failover-fresh-blocks.jsonl"


def _fresh_lines() -> list[dict[str, Any]]:
    return [json.loads(x) for x in FRESH.read_text().splitlines()]


def test_a_retry_into_fresh_blocks_trace_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_cli.main([str(FRESH), "-v"]) == 0
    out = capsys.readouterr().out
    assert "valid: 2 requests, 2 valid, 0 rejected" in out


def test_a_ghost_released_twice_is_rejected(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    objs = _fresh_lines()
    i = _entry(objs, "req-19", "ghost_released")
    objs.insert(i + 1, dict(objs[i]))
    path = _planted(tmp_path, objs)
    # not valid; whether rejected or undecided depends on exhausting the search (the dead
    # rank's retries through the lease), which this test does not wait for
    assert validate_cli.main([path, "--request", "req-19", "--seconds", "15", "--strict"]) == 1
    out = capsys.readouterr().out
    assert " 0 valid" in out and "first unexplained: decode-0/0#" in out, out
    assert f"line {i + 2} " in out, out


def test_fresh_blocks_without_the_setting_are_rejected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's D settings decide: a D without retry_fresh_blocks fences instead."""
    objs = _fresh_lines()
    objs[0]["decode"]["retry_fresh_blocks"] = False
    i = _entry(objs, "req-19", "fresh")
    path = _planted(tmp_path, objs)
    assert validate_cli.main([path, "--request", "req-19", "--seconds", "15", "--strict"]) == 1
    out = capsys.readouterr().out
    assert " 0 valid" in out and f"line {i + 1} " in out and "fence RECEIVING->FENCING" in out, \
        out


def test_a_d_crash_detected_after_the_restart_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    """One request of a kill-decoder run (2026-12-01): allocated by the restarted D, failed by P
    for the old D's death (its heartbeats noticed it 1.7 s late), then by the new D on P's
    FailedSending. The killed process left no timeline."""
    path = Path(__file__).parent / "data" / "kill-decoder-late-detection.jsonl"
    assert validate_cli.main([str(path), "--strict", "--seconds", "120"]) == 0, \
        capsys.readouterr().out
    assert "valid: 1 requests, 1 valid" in capsys.readouterr().out


def test_a_write_completing_just_before_ps_deadline_is_valid(
        capsys: pytest.CaptureFixture[str]) -> None:
    """One request of a slow-link run (2026-12-02, rejected there at 1,499 states): P's last
    writes completed 17 ms before its 4 s deadline, it sent DONE, and the deadline fired before
    the ack's retry timer (P failed; D had accepted the DONE and decoded). The world moved its
    clock only to timers, so a write could not complete just before P's own deadline."""
    path = Path(__file__).parent / "data" / "slow-link-deadline-after-done.jsonl"
    assert validate_cli.main([str(path), "--strict", "--seconds", "120"]) == 0, \
        capsys.readouterr().out
    assert "valid: 1 requests, 1 valid" in capsys.readouterr().out


def test_ack_retries_then_ps_deadline_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    """One request of a lossy-link run (2026-12-02, rejected there): P's last write completed
    3.01 s into its 4 s deadline, four of its DONE's 0.2 s ack timers fired, then the deadline.
    The world's clock idled only to just before the next deadline, where no ack timer fits."""
    path = Path(__file__).parent / "data" / "lossy-link-deadline-after-acks.jsonl"
    args = [str(path), "--request", "req-1", "--strict", "--seconds", "120"]
    assert validate_cli.main(args) == 0, capsys.readouterr().out
    assert "valid: 1 requests, 1 valid" in capsys.readouterr().out


def test_a_progress_deadline_postponed_by_other_requests_writes_is_valid(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two requests of a lossy-link run (2026-12-03, rejected there; the other requests' events
    cut out): req-2 failed for no progress at 10.1 s, 2 s past its own last progress, and req-9
    at its 20 s cap: other requests' writes landing on their D postponed P's progress deadline.
    The one-request world holds no other request (now it lets their writes land), and the
    deadline timer re-armed itself for ever at 8.2 s - 0.2 s < 8 s."""
    path = Path(__file__).parent / "data" / "lossy-link-progress-elsewhere.jsonl"
    args = [str(path), "--request", "req-2", "--request", "req-9", "--strict", "--seconds", "120"]
    assert validate_cli.main(args) == 0, capsys.readouterr().out
    assert "valid: 2 requests, 2 valid" in capsys.readouterr().out


def test_first_token_entries_leave_a_valid_run_valid(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The token moves no KV state: P's and D's first_token entries are not projected."""
    lines = FAILOVER.read_text().splitlines()
    out = []
    for line in lines:
        out.append(line)
        e = json.loads(line)
        if e.get("event") == "meta_accepted":
            out.append(json.dumps({**e, "event": "first_token", "src": "META_READY",
                                   "dst": "META_READY", "detail": "token 7 to tcp://d (epoch 0)"}))
        elif e.get("event") == "all_done":
            out.append(json.dumps({**e, "event": "first_token", "src": "DONE", "dst": "DONE",
                                   "detail": "token 7 of epoch 0 from P x"}))
    path = tmp_path / "tokens.jsonl"
    path.write_text("\n".join(out) + "\n")
    assert validate_cli.main([str(path)]) == 0
    assert "valid: 4 requests, 4 valid, 0 rejected" in capsys.readouterr().out
