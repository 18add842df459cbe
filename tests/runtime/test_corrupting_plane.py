"""The test faults' data planes: ``corrupt-write`` lands wrong bytes and never fails a write;
the truncating plane plants short writes for the e2e output oracle.

A trace of the fault table's corrupt-write row was rejected by ``lw validate`` (issue 20): the
plane read one byte past P's registered memory for the last block, the data plane refused that
write at once, and a failed write is not among the faults the row declares to the checker.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from pathlib import Path

from lw.lab.synthetic.corrupt import CorruptingPlane
from lw.transport.dataplane.planted import HELD_SUFFIX, HoldingPlane, TruncatingPlane

Entry = tuple[int, int, int]


class _Recorder:
    """Stands for the wrapped data plane: keeps what was submitted."""

    def __init__(self) -> None:
        self.submitted: list[list[Entry]] = []
        self.sent: list[tuple[Hashable, list[Entry]]] = []

    def submit(self, xfer_id: Hashable, session: str, entries: Sequence[Entry],
               within_s: float = 0.0) -> None:
        self.submitted.append(list(entries))
        self.sent.append((xfer_id, list(entries)))


def test_a_shifted_read_stays_inside_the_registered_memory() -> None:
    inner = _Recorder()
    plane = CorruptingPlane(inner, every=1, memory=(1000, 300))
    plane.submit("a", "s", [(1000, 5, 100)])  # room after it: one byte further on
    plane.submit("b", "s", [(1200, 5, 100)])  # ends at the memory's end: one byte earlier
    plane.submit("c", "s", [(1100, 5, 100), (1200, 9, 100)])  # only the first entry moves
    assert inner.submitted == [[(1001, 5, 100)], [(1199, 5, 100)],
                               [(1101, 5, 100), (1200, 9, 100)]]
    assert all(1000 <= s and s + n <= 1300 for e in inner.submitted for s, _d, n in e)
    assert plane.corrupted == 3


def test_every_nth_transfer_only() -> None:
    inner = _Recorder()
    plane = CorruptingPlane(inner, every=3, memory=(0, 1 << 20))
    for i in range(6):
        plane.submit(i, "s", [(4096, 0, 64)])
    assert [e[0][0] for e in inner.submitted] == [4096, 4096, 4097, 4096, 4096, 4097]
    assert plane.corrupted == 2


def test_truncating_plane_cuts_writes_only_while_its_file_exists(tmp_path: Path) -> None:
    inner = _Recorder()
    flag = tmp_path / "truncate"
    plane = TruncatingPlane(inner, str(flag))
    plane.submit("a", "s", [(0, 0, 4096), (8192, 8192, 32)])
    flag.write_text("64")
    plane.submit("b", "s", [(0, 0, 4096), (8192, 8192, 32)])
    flag.unlink()
    plane.submit("c", "s", [(0, 0, 4096)])
    assert inner.submitted == [[(0, 0, 4096), (8192, 8192, 32)],
                               [(0, 0, 64), (8192, 8192, 32)], [(0, 0, 4096)]]
    assert plane.truncated == 1


def test_truncating_plane_can_cut_only_the_next_transfers(tmp_path: Path) -> None:
    """``N K`` in the file: the next K transfers are cut, later ones go whole although the file
    stays (a request's first attempt is bad, its retry clean); writing the file again plants
    anew."""
    inner = _Recorder()
    flag = tmp_path / "truncate"
    plane = TruncatingPlane(inner, str(flag))
    flag.write_text("64 1")
    for x in "ab":
        plane.submit(x, "s", [(0, 0, 4096)])
    assert inner.submitted == [[(0, 0, 64)], [(0, 0, 4096)]] and plane.truncated == 1
    flag.write_text("32 1 ")  # another plant (other text): one more cut
    plane.submit("c", "s", [(0, 0, 4096)])
    plane.submit("d", "s", [(0, 0, 4096)])
    assert inner.submitted[2:] == [[(0, 0, 32)], [(0, 0, 4096)]] and plane.truncated == 2


def test_holding_plane_sends_what_it_held_once_its_file_is_gone_without_a_poll(
        tmp_path: Path) -> None:
    """Held writes go out, in order, when the flag file is removed, even if nobody polls the
    plane (a worker's loop polls it only when the inner plane's pipe is readable)."""
    flag = tmp_path / "hold"
    flag.touch()
    inner = _Recorder()
    plane = HoldingPlane(inner, str(flag))
    plane.submit("a", "s", [(0, 0, 10)])
    plane.submit("b", "s", [(0, 0, 20)])
    assert inner.sent == [] and Path(str(flag) + HELD_SUFFIX).exists()
    flag.unlink()
    deadline = time.monotonic() + 5
    while len(inner.sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [x for x, _ in inner.sent] == ["a", "b"]
    plane.submit("c", "s", [(0, 0, 30)])  # nothing held any more: straight through
    assert [x for x, _ in inner.sent] == ["a", "b", "c"]
