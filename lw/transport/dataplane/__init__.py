"""Data planes: the part of lw that moves KV-cache bytes from this process into a peer's memory.

The contract, its pure helpers and the queueing base shared by both implementations are in
:mod:`.base`; :class:`InProcessDataPlane` (tests, simulations) is in :mod:`.inprocess`;
:class:`MooncakeDataPlane` (real transfers), with the Mooncake facts and residual risks it lives
with, is in :mod:`.mooncake`. The names are re-exported here.
"""

from __future__ import annotations

from lw.transport.dataplane.base import DEFAULT_MAX_BATCH_ENTRIES as DEFAULT_MAX_BATCH_ENTRIES
from lw.transport.dataplane.base import (
    Completion,
    DataPlane,
    Entry,
    coalesce,
    split_batches,
)
from lw.transport.dataplane.inprocess import InProcessDataPlane
from lw.transport.dataplane.mooncake import MooncakeDataPlane

__all__ = [
    "Completion",
    "DataPlane",
    "Entry",
    "InProcessDataPlane",
    "MooncakeDataPlane",
    "coalesce",
    "split_batches",
]
