"""Failure kinds are data: each way a D request fails, driven through the core, carries the
:class:`FailureKind` the core gave it where it decided the failure, on its ``RecvFailed`` (and
``Quarantine``) and on its timeline's ``fail`` event, whatever the words of its reason; metrics'
labels, ``lw status`` and the proxy's client errors read that field (tests/proxy, tests/ops)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from lw.fsm import (
    FAILURE_KINDS,
    DecodeConfig,
    DecodeEndpoint,
    Failure,
    FailureKind,
    Quarantine,
    RecvFailed,
)

from .harness import Pair
from .test_endpoints import L, compute_all, done_unsent, make_pair, send_done, start

# Reasons from outside the core (the driver's abort, P's failure report, a peer's loss) worded
# as every other kind: the core never reads them.
DECOY = ("KV checksum mismatch, DONE covers, prefill deadline, prefill engine, prefill sender, "
         "aborted locally: metaserver")


def _failed(pair: Pair) -> RecvFailed:
    """r1's RecvFailed; its timeline's ``fail`` event holds the same kind and reason."""
    (failed,) = [r for r in pair.recv if isinstance(r, RecvFailed)]
    (fail,) = [e[5] for e in pair.d.timeline.of("r1") if e[2] == "fail" and e[5]]
    assert fail == Failure(failed.kind, failed.reason) and str(fail) == failed.reason
    assert type(failed.kind) is FailureKind
    return failed


def test_a_checksum_mismatch() -> None:
    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    sums = list(range(3 * 3))
    sums[4] += 1
    send_done(pair, sums, list(range(3 * 3)))
    assert _failed(pair).kind is FailureKind.CHECKSUM_MISMATCH
    (q,) = [e for e in pair.other if isinstance(e, Quarantine)]  # P's writes may still land
    assert q.kind is FailureKind.CHECKSUM_MISMATCH


def test_a_done_without_checksums() -> None:
    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True))
    send_done(pair, [], list(range(3 * 3)))
    assert _failed(pair).kind is FailureKind.BAD_DONE


def test_a_done_of_other_layers() -> None:
    from msgspec.structs import replace

    pair = make_pair()
    msg = done_unsent(pair)
    pair.absorb("d", pair.d.on_message(replace(msg, num_layers=L + 1), pair.now))
    pair.deliver_all()
    assert _failed(pair).kind is FailureKind.BAD_DONE


@pytest.mark.parametrize("words", ["peer closed", DECOY])
def test_a_failed_write_on_p(words: str) -> None:
    pair = make_pair()
    start(pair)
    pair.deliver_all()
    compute_all(pair)
    pair.writes.pop(0)
    pair.absorb(0, pair.ps[0].transfer_done("r1", 0, False, words, 0.0))
    pair.complete_writes()
    pair.deliver_all()
    failed = pair.recv[0]
    assert isinstance(failed, RecvFailed) and failed.kind is FailureKind.PREFILL_FAILED
    if words == "peer closed":
        _failed(pair)


def test_the_prefill_deadline() -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=5, lease_s=100))
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 1, 0.0))
    pair.advance(6.0)  # nobody claimed: reported at once
    assert _failed(pair).kind is FailureKind.PREFILL_DEADLINE


@pytest.mark.parametrize("words", ["no message or heartbeat answer for 3.0s", DECOY])
def test_a_lost_prefill_worker(words: str) -> None:
    pair = make_pair(dcfg=DecodeConfig(prefill_timeout_s=50, lease_s=100))
    start(pair)
    pair.deliver_all()  # claimed: P's bytes may still land, so the lease decides
    pair.absorb("d", pair.d.peer_lost("P", words, 1.0))
    pair.advance(102.0)
    (failed,) = pair.recv
    assert isinstance(failed, RecvFailed) and failed.kind is FailureKind.PREFILL_LOST


@pytest.mark.parametrize(("why", "kind"), [
    ("request FINISHED_ABORTED", FailureKind.ABORTED),
    (DECOY, FailureKind.ABORTED),
    ("metaserver: POST http://proxy/v1/metaserver answered 503: no prefill server",
     FailureKind.METASERVER),
    ("request FINISHED_ABORTED", FailureKind.METASERVER),
])
def test_local_aborts_and_a_failed_metaserver_call_are_the_drivers_kind(
        why: str, kind: FailureKind) -> None:
    """The driver says why it aborts (``kind``; ABORTED unless it says otherwise): its words
    decide nothing."""
    pair = make_pair()
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 1, 0.0))
    kw = {} if kind is FailureKind.ABORTED else {"kind": kind}
    pair.absorb("d", pair.d.abort("r1", why, 0.0, **kw))
    (failed,) = pair.recv
    assert isinstance(failed, RecvFailed) and failed.kind is kind
    assert failed.reason == f"aborted locally: {why}"


def test_kinds_are_bounded_metric_labels_each_with_a_meaning() -> None:
    assert set(FAILURE_KINDS) == set(FailureKind)
    assert all(k.value == k.value.lower() and " " not in k.value and FAILURE_KINDS[k]
               for k in FailureKind)


def test_a_checksum_mismatch_with_budget_left_is_prefilled_again_in_the_same_blocks() -> None:
    """A bad transfer loses its epoch as a lost P does (issue 40): the mismatching sender is
    aborted and, once it said it stopped, D asks for a new prefill of the same blocks under
    the next epoch, avoiding that P's engine; the request does not fail (with no budget it
    does: test_a_checksum_mismatch)."""
    from lw.fsm import Reprefill

    pair = make_pair(dcfg=DecodeConfig(kv_checksum=True, retry_prefill=1, prefill_timeout_s=30,
                                       lease_s=100))
    sums = list(range(3 * 3))
    sums[4] += 1
    send_done(pair, sums, list(range(3 * 3)))  # the refused DONE: P stops, says so
    assert pair.recv == []
    (again,) = [e for e in pair.other if isinstance(e, Reprefill)]
    assert (again.req_id, again.epoch, again.avoid) == ("r1", 1, ("P",))
    assert "KV checksum mismatch" in again.reason
    assert pair.d.counters["checksum_mismatches"] == 1 and pair.d.record("r1").epoch == 1
    assert pair.d.state_of("r1") == "PREFILL_REQUESTED"


# ---------------------------------------------------------------------------------------------
# A new failure without a kind fails here.

_DECODE = [Path(inspect.getfile(DecodeEndpoint)).parent / f"{m}.py"
           for m in ("decode", "decode_failover", "decode_first_token", "decode_ghosts")]
_KIND_AT = {"_fail": 1, "_lose": 1, "RecvFailed": 3, "Quarantine": 3}  # where the kind goes


def test_every_failure_report_has_a_kind_and_no_default_one() -> None:
    for cls in (RecvFailed, Quarantine):
        (kind,) = [f for f in dataclasses.fields(cls) if f.name == "kind"]
        assert kind.default is dataclasses.MISSING, cls
    for name in ("_fail", "_lose"):
        param = inspect.signature(getattr(DecodeEndpoint, name)).parameters["kind"]
        assert param.default is inspect.Parameter.empty, name


def test_every_failure_the_decode_core_decides_names_its_kind() -> None:
    """Each call that fails a D request, or reports one failed, passes a kind where the
    signature wants it: a ``FailureKind.X``, or a kind decided earlier (``kind``, ``bad.kind``,
    ``rec.kind``)."""
    found = 0
    for path in _DECODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name not in _KIND_AT:
                continue
            found += 1
            at = _KIND_AT[name]
            assert len(node.args) > at, f"{path.name}:{node.lineno}: {name} without a kind"
            arg = ast.unparse(node.args[at])
            assert arg.startswith("FailureKind.") or arg in ("kind", "bad.kind", "rec.kind"), \
                f"{path.name}:{node.lineno}: {name}'s kind is {arg}"
    assert found >= 8
