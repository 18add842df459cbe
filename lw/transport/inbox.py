"""A worker loop's inbox: how engine threads hand it work without waiting (a part of
:class:`lw.transport.runtime.WorkerLoop`).

Engine threads append to a queue and, at most once per loop turn, write one byte to a pipe the
loop polls. Two policies keep those wake-ups rare on a busy forward thread: layer events that
come closer than the hot poll interval keep the loop polling for a window (hooks then skip the
write), and a layer event wakes the loop only if the last one to wake it is ``layer_batch_s``
old (or longer, while the data plane's link drains a backlog) or it is the last layer, the
rest going out with it as one transfer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from lw.transport.loopconfig import LoopConfig
from lw.transport.wakepipe import WakePipe

__all__ = ["CALL", "FN", "LAYER", "Inbox"]

# item kinds: (LAYER, layer, req_ids, t), (CALL, method, (args, kwargs), future),
# (FN, fn, None, future)
LAYER = 0
CALL = 1
FN = 2

IDLE_POLL_MS = 200  # the longest a loop polls with nothing due
MAX_BACKLOG_BATCH_S = 0.1
"""The longest a layer event waits for company while the link drains a backlog: half that
backlog, up to this (the last layer never waits)."""


class Inbox:
    """Engine -> loop queue, its wake pipe and its polling policy (hooks on any thread; the
    rest on the loop thread)."""

    def __init__(self, config: LoopConfig, num_layers: int,
                 counters: dict[str, int | float],
                 backlog_s: Callable[[], float] | None = None) -> None:
        self.items: deque[tuple] = deque()
        self.max_items = config.max_inbox
        self.counters = counters  # the loop's: inbox_overflow
        self.pipe = WakePipe()
        self.wake_pending = False
        self.finished = False  # the loop thread is gone: what comes now fails at once
        # While layer events come faster than 2 * hot_poll_s, the loop polls every hot_poll_s
        # for hot_window_s after each, and hooks skip the wake-up write: a write wakes the loop
        # thread, and on a busy machine the context switch it triggers costs the forward thread
        # tens of microseconds per layer.
        self.hot_poll_ms = round(config.hot_poll_s * 1000)
        self.hot_window_s = config.hot_window_s if self.hot_poll_ms else 0.0
        self.hot_until = 0.0
        # layer events closer than this keep the loop polling
        self.hot_gap_s = 2 * config.hot_poll_s
        self.last_layer_ev = -1e9
        # A layer event wakes the loop only if the last one to wake it is layer_batch_s old (or
        # it is the last layer): the rest wait in the inbox and go out with it as one transfer.
        # Each wake-up costs the forward's core a context switch, the core's work and a data
        # plane submit and polls: with CPU layers ms apart, batching at 15 ms halved lw's
        # thread CPU on P and took 6-18 % off a 1,024-token prefill (benchmarks/push_cpu.py).
        # The first layer after a quiet spell still wakes at once, so a push starts when its
        # first layer is computed.
        self.layer_batch_s = config.layer_batch_s
        self.batch_woken = -1e9
        # While the data plane's link needs longer than the batch to drain what is in flight
        # (a link-bound push), layers handed over sooner leave no sooner: a batch then spans
        # half that backlog (up to MAX_BACKLOG_BATCH_S), and the loop's, the sender's and the
        # transport's wake-ups on the forward's core, each a preemption of the forward, thin
        # out (benchmarks/push_cpu.py counts them). The backlog is the slowest peer's: a push to
        # another, idle peer meanwhile waits up to the cap too (its last layer never does).
        self.backlog_s = backlog_s
        self.num_layers = num_layers  # P's; 0 on D (no layer events)

    def __len__(self) -> int:
        return len(self.items)

    # ------------------------------------------------------------ engine threads
    def layer(self, layer: int, req_ids: Iterable[str], computed: float | None = None) -> None:
        """A layer event (computed at ``computed``, monotonic; default now): O(batch) copy,
        never waits; wakes the loop as the policy says."""
        items = self.items
        if len(items) >= self.max_items:  # a dead loop must not grow memory without bound
            self.counters["inbox_overflow"] += 1
            return
        if computed is not None:  # held back after it was computed: wakes as of now
            items.append((LAYER, layer, tuple(req_ids), computed))
            if not self.wake_pending:
                self.wake()
            return
        t = time.monotonic()
        items.append((LAYER, layer, tuple(req_ids), t))
        if self.wake_pending:
            return
        if self.layer_batch_s and layer != self.num_layers - 1:
            since = t - self.batch_woken
            if since < self.layer_batch_s:
                return  # goes out with a later layer (the last one at the latest)
            # the backlog is asked only when the batch alone would wake: once per batch, not
            # on every layer of the forward thread
            if (self.backlog_s is not None
                    and since < min(self.backlog_s() / 2, MAX_BACKLOG_BATCH_S)):
                return
            self.batch_woken = t
        self.wake()

    def put(self, item: tuple) -> None:
        """Queue a CALL or FN item (its future fails at once if the loop is gone)."""
        self.items.append(item)
        if self.finished:  # the loop is gone: fail now instead of never
            self.fail_all()
        elif not self.wake_pending:
            self.wake()

    def wake(self) -> None:
        self.wake_pending = True
        self.pipe.wake()

    def fail_all(self) -> None:
        """Fail the future of every queued call (the loop stopped); layer events are dropped."""
        while True:
            try:
                item = self.items.popleft()
            except IndexError:
                return
            if item[0] in (CALL, FN) and item[3].set_running_or_notify_cancel():
                item[3].set_exception(RuntimeError("WorkerLoop stopped"))

    # ------------------------------------------------------------ loop thread
    def turn_started(self, ready: set[int]) -> None:
        """A poll returned (``ready``: its ready fds): take the wake-up."""
        if self.pipe.fd in ready:
            self.pipe.drain()
        # Clear before draining: a hook that appends after the drain writes the pipe again.
        self.wake_pending = False

    def layer_event(self, t: float) -> None:
        """A layer event queued at ``t`` is drained: keep the loop polling while they come
        close together."""
        if self.hot_window_s:
            # Polling pays only while layer events come closer than the poll interval (GPU
            # layers: one poll serves several). Slower layers (a CPU forward pass, several ms
            # each) wake the loop once per event instead: polling through a whole chunked
            # prefill cost P's forward pass about 10 % here.
            if t - self.last_layer_ev < self.hot_gap_s:
                self.hot_until = time.monotonic() + self.hot_window_s
            self.last_layer_ev = t

    def poll_cap_ms(self) -> int:
        """The longest the next poll may wait: short while hot (the loop's queue aside)."""
        cap = IDLE_POLL_MS
        if self.hot_until and time.monotonic() < self.hot_until:
            self.wake_pending = True  # set before the inbox check: hooks need not write
            cap = self.hot_poll_ms
        return cap
