"""Fault injection of the synthetic cluster: when and how the configured fault strikes (kill,
freeze or partition a decoder, crash a P rank) and which decoder to kill (a mixin of the
coordinator, :class:`lw.lab.synthetic.coordinator.Coordinator`)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from lw.lab.synthetic.config import PARTITION_FAULTS

_DEBUG = bool(os.environ.get("LW_DEBUG"))


class FaultInjector:
    """The coordinator's fault injection (its state lives on the coordinator)."""

    cfg: Any
    res: Any
    router: Any

    def inject(self) -> None:
        cfg = self.cfg
        d = self.decoder
        now = time.monotonic()
        if self.thaw_at is not None and now >= self.thaw_at and d is not None:
            self.thaw_at = None
            if d.alive and d.pid:
                # frozen -> killed: the sentinel reports the death and a new incarnation starts
                sig = signal.SIGKILL if cfg.fault == "freeze-kill-decoder" else signal.SIGCONT
                os.kill(d.pid, sig)
            d.frozen = False
        if self.heal_at is not None and now >= self.heal_at and self.net is not None:
            self.heal_at = None
            self.net.heal()
        if self.fault_fired:
            return
        trigger = max(1, cfg.requests // 4)
        if cfg.fault in PARTITION_FAULTS:
            before = cfg.fault == "partition-before-contact"
            if self.net is not None and d is not None and d.ready and (
                    before or self.res.done >= trigger):
                self.net.partition()
                self.heal_at = now + (cfg.freeze_s if before else cfg.partition_s
                                      if cfg.fault == "partition-mid-transfer"
                                      else cfg.long_partition_s)
                self.fault_fired = True
                self.fault_at = now
            return
        if cfg.fault == "kill-decoder" and cfg.decoders > 1:
            if self.router.pending:
                return  # the kill lands at the next prefill a decoder asks for (kill_at_prefill)
            victim = self._victim()
            if victim is not None:
                self._count_stages(victim.slot)
                os.kill(victim.pid, signal.SIGKILL)
                self.fault_fired = True
                self.fault_at = now
        elif cfg.fault == "freeze-decoder-before-contact":
            if d is not None and d.ready:
                self.send(d, ("freeze_after_alloc",))
                self.fault_fired = True
                self.fault_at = now
        elif (self.res.done >= trigger and d is not None and d.alive and d.pid
              and (self.router.load(d.slot) or not self.router.pending)):
            # only while the decoder holds requests (a fast machine can finish a whole window
            # between two looks: a kill then would test nothing), or when none will come
            if cfg.fault == "kill-decoder":
                os.kill(d.pid, signal.SIGKILL)
                self.fault_fired = True
                self.fault_at = now
            elif cfg.fault in ("freeze-decoder-mid-transfer", "freeze-kill-decoder"):
                os.kill(d.pid, signal.SIGSTOP)
                d.frozen = True
                self.thaw_at = now + cfg.freeze_s
                self.fault_fired = True
                self.fault_at = now
            elif cfg.fault == "kill-prefill-rank":
                if _DEBUG:
                    print(f"[lw] {now:.3f} arming crash", flush=True)
                victim = self.ranks[-1]
                if victim.alive:
                    self.send(victim, ("crash",))
                self.fault_fired = True
                self.fault_at = now

    def kill_at_prefill(self, rid: str) -> bool:
        """kill-decoder with several decoders, once an eighth of the requests are done: the
        decoder that asks for a prefill dies before that prefill is routed, so the kill lands
        while it holds a request that streamed no token, however fast the machine (a kill
        after a guess could find its work done). True when it killed (the prefill is dropped)."""
        cfg = self.cfg
        if (cfg.fault != "kill-decoder" or cfg.decoders == 1 or self.fault_fired
                or self.res.done < max(1, cfg.requests // 8)):
            return False
        slot = self.router.slot_of(rid)
        victim = self.decoders[slot] if slot is not None else None
        if victim is None or not victim.alive or not victim.pid:
            return False
        self._count_stages(victim.slot)
        os.kill(victim.pid, signal.SIGKILL)
        self.fault_fired = True
        self.fault_at = time.monotonic()
        return True

    def _victim(self) -> Any:
        """The D engine for kill-decoder to kill when no request is left to send (else
        :meth:`kill_at_prefill` picks it), once an eighth of the requests are done: one
        that holds requests that streamed a token and at least two still with P (queued or
        being pushed: their first token cannot be on its way already, as a request's just
        verified may be); or, with none left to send, the busiest before they all run dry."""
        router = self.router
        if self.res.done < max(1, self.cfg.requests // 8):
            return None
        held = {d.slot: router.held(d.slot)
                for d in self.live_decoders() if d.pid and router.load(d.slot)}
        for slot, tokens in held.items():
            with_p = sum(1 for rid, n in tokens.items() if not n and rid in self.assigned
                         and router.client_of(rid) not in self.gone)
            if any(tokens.values()) and with_p >= 2:
                return self.decoders[slot]
        busiest = max(held, key=lambda s: len(held[s]), default=None)
        if busiest is not None and not router.pending and len(held[busiest]) <= 2:
            return self.decoders[busiest]
        return None

    def _count_stages(self, slot: int) -> None:
        """Where the requests of the D engine about to die are, for the report: streaming
        tokens, with a P rank (queued or being pushed), or neither (not yet routed to P, or
        pushed and not yet verified or decoded)."""
        for rid, tokens in self.router.held(slot).items():
            stage = "streaming" if tokens else "prefilling" if rid in self.assigned else "other"
            self.res.counters[f"killed_with.{stage}"] += 1
