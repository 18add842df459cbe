"""The one effect interpreter (lw.fsm.interpreter): order, batching, feedback, checksums, errors."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lw.fsm.effects import (
    ArmTimer,
    CancelTimer,
    Effect,
    KeptSums,
    RecvDone,
    Send,
    SendFinished,
    SumBlocks,
    SumPlan,
    Sums,
    TimerKey,
    WriteLayer,
)
from lw.fsm.interpreter import Report, perform
from lw.fsm.messages import DoneSending, KVFormat, KVLayout, LayerLayout, Message, Sender

SENDER = Sender("p", 0, 1, "tcp://p:1")
LAYOUT = KVLayout("d", 1, "d:1", [LayerLayout(0, 64, 64, 4)], KVFormat())


def write(rid: str, layer: int) -> WriteLayer:
    return WriteLayer(rid, layer, LAYOUT, (0,), (1,), target="tcp://d:1")


def done(rid: str) -> DoneSending:
    return DoneSending(version=3, req_id=rid, sender=SENDER, expected_senders=1, num_layers=1)


class Ports:
    """Records what the interpreter asked for, in order."""

    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.log: list[tuple] = []
        self.fail = fail

    def send(self, dest: str, msg: Message) -> None:
        self.log.append(("send", dest, msg))

    def write(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        self.log.append(("write", [(w.req_id, w.layer) for w in writes]))
        return [[SendFinished(w.req_id, False, "no plane")] for w in writes
                if w.req_id in self.fail]

    def arm(self, key: TimerKey, at: float) -> None:
        self.log.append(("arm", key, at))

    def cancel(self, key: TimerKey) -> None:
        self.log.append(("cancel", key))

    def report(self, effect: Report) -> None:
        if isinstance(effect, RecvDone) and effect.req_id == "boom":
            raise RuntimeError("port broke")
        self.log.append(("report", effect))

    def sum_blocks(self, layout: KVLayout, plan: SumPlan) -> Sequence[Sequence[int]]:
        self.log.append(("sum", layout, plan))
        return [[b + 10 for b in plan.blocks]]

    def kept_sums(self, req_id: str, target: str, layers: int) -> Sequence[Sequence[int]]:
        self.log.append(("kept", req_id, target, layers))
        return [[7]] * layers

    def answer(self, sums: Sums) -> list[Effect]:
        self.log.append(("answer", sums))
        return [Send("tcp://d:1", done(sums.ask.req_id))]


def test_writes_of_a_batch_go_out_together_after_the_rest() -> None:
    ports = Ports()
    perform([write("a", 0), ArmTimer(("deadline", "a"), 5.0), write("b", 0),
             Send("tcp://d:1", done("c")), CancelTimer(("meta", "a"))], ports)
    assert [x[0] for x in ports.log] == ["arm", "send", "cancel", "write"]
    assert ports.log[-1] == ("write", [("a", 0), ("b", 0)])


def test_writes_that_cannot_start_feed_the_cores_answer_back() -> None:
    ports = Ports(fail={"b"})
    perform([write("a", 0), write("b", 0)], ports)
    assert ports.log == [("write", [("a", 0), ("b", 0)]),
                         ("report", SendFinished("b", False, "no plane"))]


def test_a_checksum_question_is_answered_to_the_core_within_the_same_call() -> None:
    ports = Ports()
    plan = SumPlan(("p", 0), (1, 2), (((0, 64),),))
    ask_d, ask_p = SumBlocks("r", LAYOUT, (plan,)), KeptSums("q", ("tcp://d:1", "tcp://d:2"), 2)
    perform([ask_d, ask_p, ArmTimer(("ack", "q"), 1.0)], ports)
    assert ports.log == [
        ("sum", LAYOUT, plan), ("answer", Sums(ask_d, ([[11, 12]],))),
        ("kept", "q", "tcp://d:1", 2), ("kept", "q", "tcp://d:2", 2),
        ("answer", Sums(ask_p, ([[7], [7]], [[7], [7]]))),
        ("arm", ("ack", "q"), 1.0),
        ("send", "tcp://d:1", done("r")), ("send", "tcp://d:1", done("q"))]


def test_a_failing_port_stops_the_checker_but_not_the_runtime() -> None:
    effects: list[Effect] = [RecvDone("boom"), RecvDone("ok")]
    with pytest.raises(RuntimeError, match="port broke"):
        perform(effects, Ports())
    errors: list[tuple[Effect, Exception]] = []
    ports = Ports()
    perform(effects, ports, lambda e, exc: errors.append((e, exc)))
    assert [e for e, _ in errors] == [RecvDone("boom")] and ports.log == [
        ("report", RecvDone("ok"))]


def test_an_unknown_effect_is_an_error() -> None:
    with pytest.raises(TypeError, match="unknown effect"):
        perform(["not an effect"], Ports())  # type: ignore[list-item]
