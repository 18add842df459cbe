"""lw's scheduler for a decode engine: the first token P sampled streams at once, and the
request continues from it when its KV has landed (no recompute of the last prompt token).

``--scheduler-cls lw.vllm_adapter.lw_scheduler.LwScheduler`` (``python -m lw.vllm_adapter.serve``
adds it when the connector is lw's). It extends whichever scheduler vLLM would pick: the async
one when async scheduling is on, the synchronous one otherwise. On P, and wherever the feature
is off, it behaves as its base exactly.

What it does, on D, for a request waiting for its KV (WAITING_FOR_REMOTE_KVS):
- P's token arrives (through lw's connector, :meth:`SchedulerSide.take_first_tokens`): if the
  request may take it (lw.vllm_adapter.first_token), it becomes the request's first output
  token, through vLLM's own output path (an EngineCoreOutput: detokenizing, stop strings, usage
  and streaming stay vLLM's), and vLLM's stop checks run on it. A request that ends there
  (max_tokens 1, EOS, a stop id) is finished the way a client abort is: its receive is stopped
  and its blocks are held until the workers report it finished receiving.
- its KV lands before P's token (a short prompt on a fast link: P's DONE can leave before the
  token its scheduler hears of a step later): the request waits for the token up to
  FIRST_TOKEN_WAIT_S, far less than the decode step it saves, then takes vLLM's path.
- its KV lands: the request holds prompt + 1 tokens with the prompt computed, so vLLM's
  promotion does not rewind to the last prompt token: the first step computes position L with
  token 1 as input and samples token 2. vLLM's V2 model runner gets token 1 with the request;
  the V1 runner gets it through the step's connector metadata (``seeds``,
  lw.vllm_adapter.lw_worker).
What becomes of each token, whether a request waits for one and which token a runner is seeded
with are decided by :class:`lw.fsm.first_token_desk.FirstTokenDesk`; this class gathers the
facts from vLLM's request and acts.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from lw.fsm.first_token_desk import FirstTokenDesk, TokenCase, Verdict
from lw.vllm_adapter.connector import LwConnector
from lw.vllm_adapter.connector_meta import FirstTokenIn, LwConnectorMetadata
from lw.vllm_adapter.first_token import ineligible, token_problem
from lw.vllm_adapter.serve import LW_WORKER_CLS

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from lw.vllm_adapter.scheduler_side import SchedulerSide

__all__ = ["LW_WORKER_CLS", "LwAsyncScheduler", "LwScheduler", "LwSyncScheduler"]

log = logging.getLogger("vllm.lw.scheduler")

FIRST_TOKEN_WAIT_S = 0.05
"""How long a request whose KV landed waits for P's token before D computes token 1 itself:
P's token leaves its worker one engine step after P sampled it (milliseconds), and the wait
saves a decode step; a P that never sends (not lw's scheduler, or the key off there) costs
every request this much, counted in ``first_token_waits_expired``."""



def first_token_off_reason(vllm_config: Any, side: SchedulerSide | None) -> str | None:
    """Why this engine cannot take P's first tokens (None: it can)."""
    if side is None:
        return "the KV connector is not lw's"
    if side.cfg.is_producer:
        return "a prefill engine"
    if not side.cfg.first_token_from_p:
        return "first_token_from_p is false"
    if not getattr(vllm_config, "use_v2_model_runner", False) and \
            vllm_config.parallel_config.worker_cls != LW_WORKER_CLS:
        return (f"vLLM's V1 model runner needs --worker-cls {LW_WORKER_CLS} "
                f"(this engine runs {vllm_config.parallel_config.worker_cls!r})")
    return None


class _FirstTokenFromP:
    """The first-token behaviour, mixed into one of vLLM's schedulers (see the module)."""

    # set by vLLM's Scheduler.__init__
    connector: Any
    requests: dict[str, Request]
    max_model_len: int
    num_spec_tokens: int
    finished_recving_kv_req_ids: set[str]
    failed_recving_kv_req_ids: set[str]

    def _lw_setup(self, vllm_config: Any) -> None:
        conn = self.connector
        self._lw_side = conn.scheduler_side if isinstance(conn, LwConnector) else None
        off = first_token_off_reason(vllm_config, self._lw_side)
        self._lw_on = off is None
        self._lw_v1 = not getattr(vllm_config, "use_v2_model_runner", False)
        self._lw_desk = FirstTokenDesk(FIRST_TOKEN_WAIT_S)  # what becomes of each token
        if self._lw_side is not None and not self._lw_side.cfg.is_producer:
            self._lw_side.first_token_mode(off)  # for `lw status`; its tokens come to us
            if off is None:
                log.info("lw: first token from P on: D streams P's sampled token as soon as it "
                         "arrives and continues from it")
            else:
                log.warning("lw: first token from P off (%s): D recomputes the last prompt "
                            "token and samples token 1 itself", off)

    # ------------------------------------------------------------------ vLLM's hooks
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput
                           ) -> dict[int, EngineCoreOutputs]:
        """vLLM's outputs of the step, plus the first tokens P sampled that arrived in it."""
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output)
        side = self._lw_side
        if side is not None and not side.cfg.is_producer:
            for ft in side.take_first_tokens():
                self._lw_first_token(ft, outputs)
        return outputs

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """vLLM's step, with P's tokens for the V1 runner of requests scheduled in it."""
        so = super().schedule(*args, **kwargs)  # type: ignore[misc]
        desk = self._lw_desk
        seeds = desk.seeds_for(new.req_id for new in so.scheduled_new_reqs)
        if seeds and isinstance(so.kv_connector_metadata, LwConnectorMetadata):
            so.kv_connector_metadata.seeds += seeds
        desk.forget(self.requests.keys())  # the requests that ended
        return so

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        """vLLM's "may this waiting request be scheduled": not yet while its KV landed and
        P's token, which would spare D a step, may still come (FIRST_TOKEN_WAIT_S)."""
        rid = request.request_id
        if self._lw_on and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and \
                request.num_output_tokens == 0 and rid in self.finished_recving_kv_req_ids \
                and rid not in self.failed_recving_kv_req_ids and \
                ineligible(request, spec_tokens=self.num_spec_tokens) is None:
            go, expired = self._lw_desk.may_schedule(rid, time.monotonic())
            if not go:
                return False
            if expired:
                assert self._lw_side is not None
                self._lw_side.count("first_token_waits_expired")
        else:
            self._lw_desk.not_waiting(rid)
        return super()._handle_blocked_waiting_request(request)  # type: ignore[misc]

    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        """vLLM's promotion of a request whose KV landed; counts which path token 1 took."""
        side = self._lw_side
        if side is not None and not side.cfg.is_producer and \
                request.request_id not in self.failed_recving_kv_req_ids and \
                request.num_output_tokens == 0:
            side.count("last_token_recomputed")
        super()._update_waiting_for_remote_kv(request)  # type: ignore[misc]

    # ------------------------------------------------------------------ the token
    def _lw_first_token(self, ft: FirstTokenIn, outputs: dict[int, EngineCoreOutputs]) -> None:
        side = self._lw_side
        assert side is not None
        request = self.requests.get(ft.req_id)
        if request is None or request.is_finished():
            case = TokenCase(live=False, awaiting_kv=False, outputs=0, ineligible=None)
        else:
            case = TokenCase(live=True,
                             awaiting_kv=request.status == RequestStatus.WAITING_FOR_REMOTE_KVS,
                             outputs=request.num_output_tokens,
                             ineligible="off" if not self._lw_on else ineligible(
                                 request, spec_tokens=self.num_spec_tokens))
        verdict, why = self._lw_desk.arrived(ft.req_id, case, lambda: token_problem(
            request, ft.spec, spec_tokens=self.num_spec_tokens))
        if verdict is Verdict.ENDED:
            return
        if verdict is Verdict.FALLBACK:
            side.fallback(why or "")
            return
        assert request is not None
        if verdict is not Verdict.TAKE:  # D holds a token already, or computes its own
            side.count("first_token_discarded")
            if verdict is Verdict.LATE:
                side.fallback("late")
            elif request.output_token_ids[0] != ft.token and \
                    request.sampling_params is not None and \
                    request.sampling_params.temperature == 0:
                log.warning("lw: request %s: a re-prefill's P sampled token %d under greedy "
                            "sampling where the client holds %d (discarded)", ft.req_id,
                            ft.token, request.output_token_ids[0])
            return
        request.append_output_token_ids(ft.token)
        stopped = check_stop(request, self.max_model_len)
        side.count("first_token_from_p")
        finish_reason = None
        if stopped:
            finish_reason = request.get_finished_reason()
            status = request.status
            # finished as a client abort is: the receive is stopped, the blocks held until
            # the workers report it finished receiving
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.finish_requests(request.request_id, status)  # type: ignore[attr-defined]
            side.count("ended_at_first_token")
        elif self._lw_v1:
            self._lw_desk.seed(request.request_id, ft.token)
        out = EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[ft.token],
            finish_reason=finish_reason, stop_reason=request.stop_reason,
            events=request.take_events(), prefill_stats=self._lw_prefill_stats(request),
            trace_headers=request.trace_headers)
        eco = outputs.get(request.client_index)
        if eco is None:
            outputs[request.client_index] = EngineCoreOutputs(outputs=[out])
        else:
            eco.outputs.append(out)

    def _lw_prefill_stats(self, request: Request) -> Any:
        """The request's prefill figures, as vLLM's first output of a request carries them."""
        stats = request.take_prefill_stats()
        if stats is not None:
            stats.finalize(self.kv_cache_manager.estimate_cached_tokens(  # type: ignore
                request))
        return stats


class LwSyncScheduler(_FirstTokenFromP, Scheduler):
    """lw's scheduler over vLLM's synchronous one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lw_setup(kwargs.get("vllm_config", args[0] if args else None))


class LwAsyncScheduler(_FirstTokenFromP, AsyncScheduler):
    """lw's scheduler over vLLM's async one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lw_setup(kwargs.get("vllm_config", args[0] if args else None))


class LwScheduler:
    """What ``--scheduler-cls`` names: builds :class:`LwAsyncScheduler` when vLLM runs async
    scheduling, :class:`LwSyncScheduler` otherwise (the base vLLM itself would have picked)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if vllm_config is None:
            raise TypeError("LwScheduler needs vllm_config")
        if vllm_config.scheduler_config.async_scheduling:
            return LwAsyncScheduler(*args, **kwargs)
        return LwSyncScheduler(*args, **kwargs)
