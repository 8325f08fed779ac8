"""`ShadowScheduler`: shadow prefill inside vLLM's own iterations (paper §3.2 Algorithm 1, §3.3), no vLLM patch.

    SHADOWPREFILL_VLLM='{"stats_path": "/tmp/steps.jsonl"}' vllm serve MODEL \\
        --scheduler-cls shadowprefill.integrations.vllm.ShadowScheduler \\
        --scheduling-policy priority --enable-prefix-caching

One step: vLLM's scheduler runs every non-shadow request exactly as it would alone (running shadows are
parked for the call, waiting shadows hidden); then this project's `ShadowController` budgets the step
(Algorithm 1 lines 1-12 on an `IterationView` adapted from vLLM's request state) and shadow requests get
whole-block chunks, by (priority, arrival), until the budget is spent (line 15). After the step the
predictor t̂ refits on the measured step time and the controller accrues credit.
"""
from __future__ import annotations

import copy
import logging
import time

from shadowprefill.integrations.vllm.compat import require
from shadowprefill.integrations.vllm.config import ShadowSchedulerConfig
from shadowprefill.integrations.vllm.seed import make_predictor
from shadowprefill.integrations.vllm.shadow_kv import ShadowKV
from shadowprefill.integrations.vllm.stats import StepStatsWriter
from shadowprefill.shadow.controller import ShadowController, default_tpot_slo, default_ttft_slo
from shadowprefill.shadow.policy import whole_block_n_min
from shadowprefill.shadow.spend import spend_budget
from shadowprefill.shadow.view import IterationView

VLLM_VERSION = require()        # every vLLM internal used below, checked before any is touched (compat.py)

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData  # noqa: E402
from vllm.v1.core.sched.request_queue import SchedulingPolicy  # noqa: E402
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from shadowprefill.integrations.vllm.connector import (  # noqa: E402
    ConnectorAdmission, DeferredShadowFrees, connector_problem)

logger = logging.getLogger("vllm.shadowprefill")  # under vLLM's configured logger

_IDLE_SLEEP_S = 0.002          # an engine step that scheduled nothing while shadows wait (vLLM then loops)
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_QUEUED = _WAITING + (RequestStatus.WAITING_FOR_REMOTE_KVS,)   # in vLLM's waiting queues (connector: parked loads)


class _ReqView:
    """One routed/normal request as the controller reads it (`shadow.view.RequestState`)."""

    __slots__ = ("arrival_time", "first_token_time", "num_decode_iters", "num_computed_tokens", "num_remaining",
                 "ttft_slo", "tpot_slo")

    def __init__(self, arrival, first_token, iters, computed, remaining, ttft_slo, tpot_slo) -> None:
        self.arrival_time, self.first_token_time, self.num_decode_iters = arrival, first_token, iters
        self.num_computed_tokens, self.num_remaining = computed, remaining
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo


class _Step:
    """What one scheduled step held, for the predictor, the credit and the stats line."""

    __slots__ = ("output", "t0", "wall", "decodes", "prefills", "shadow_chunks", "shadow_ids", "budget", "allowance",
                 "waiting", "preempted_shadows", "warm", "shadow_loads")


class _StepHost:
    """`shadow.spend.SpendHost` over vLLM's KV manager for one step's shadow phase: `locate` reads a shadow's
    prefix hits (nothing is held until `allocate`), `allocate` makes room in the shadow class and allocates
    vLLM slots, recording what the step's output must carry."""

    def __init__(self, sched: "ShadowScheduler", out, step: _Step, admitted: list) -> None:
        self.s, self.out, self.step, self.admitted = sched, out, step, admitted
        self.block_size = sched.block_size
        self.now = time.monotonic()
        self._located: dict[str, tuple] = {}            # request id -> (running, computed blocks, hits, held)
        self.sched: dict[str, int] = {}
        self.new_blocks_of: dict = {}
        self.running_now, self.resumed_now, self.new_now = [], [], []
        self.sync_load = False              # a shadow admitted with a synchronous connector load

    def locate(self, r):
        s, kvm, rid = self.s, self.s.kv_cache_manager, r.request_id
        if r.status == RequestStatus.RUNNING:
            self._located[rid] = (True, None, (), len(kvm.get_blocks(rid).blocks[0]), 0)
            return r.num_computed_tokens, r.num_tokens - r.num_computed_tokens, None
        conn = s._conn
        if conn is not None and not conn.ready(s, r):          # a host-tier load still in flight
            return None
        if len(s.running) + s.num_waiting_for_streaming_input >= s.max_num_active_reqs:
            return None
        if r.num_computed_tokens > 0:                          # its load finished: it holds its blocks
            self._located[rid] = (None, None, (), len(kvm.get_blocks(rid).blocks[0]), 0)
            return r.num_computed_tokens, r.num_tokens - r.num_computed_tokens, None
        if conn is None:
            computed, context, _ = kvm.get_computed_blocks(r)
            ext, load = 0, False
        else:                                                  # local hit, then the connector's lookup
            found = conn.lookup(r)
            if found is None:
                return None
            computed, local, ext, load = found
            context = local + ext
        hits = computed.blocks[0]
        if -(-r.num_tokens // self.block_size) - len(hits) > s._kv.cap:   # could never be held under the cap
            s._refuse(r)
            return None
        if load:                        # host-tier hit: blocks now, the load between steps, no compute now
            need = -(-context // self.block_size) - len(hits)
            if s._kv.prepare(need, self.now, {b.block_id for b in hits}) and conn.start_load(r, computed, local, ext):
                s._kv.add(kvm.get_blocks(rid).blocks[0][len(hits):])
                self.step.shadow_loads.append((rid, ext))
            return None
        self._located[rid] = (False, computed, hits, len(hits), ext)
        return context, r.num_tokens - context, None

    def allocate(self, r, context: int, n: int) -> bool:
        s, kvm, rid = self.s, self.s.kv_cache_manager, r.request_id
        running, computed, hits, held, ext = self._located.pop(rid)
        need = -(-(context + n) // self.block_size) - held
        if not s._kv.prepare(need, self.now, {b.block_id for b in hits}):  # line 11: free / cold, within the cap
            return False
        if running or running is None:                 # running, or holding the blocks its load filled
            blocks = kvm.allocate_slots(r, n, num_lookahead_tokens=s.num_lookahead_tokens)
        else:
            blocks = kvm.allocate_slots(r, n, num_new_computed_tokens=context - ext, new_computed_blocks=computed,
                                        num_lookahead_tokens=s.num_lookahead_tokens, full_sequence_must_fit=False,
                                        has_scheduled_reqs=True, num_external_computed_tokens=ext)
        if blocks is None:
            return False
        s._kv.add(blocks.blocks[0])
        self.sched[rid] = n
        self.step.shadow_chunks.append((n, context))
        self.step.shadow_ids.append(rid)
        if running:
            self.running_now.append(r)
            self.new_blocks_of[rid] = blocks
        else:
            s._admit(r, context, n, computed, ext, loaded=running is None)
            self.sync_load = self.sync_load or ext > 0
            (self.resumed_now if r.status == RequestStatus.PREEMPTED else self.new_now).append(r)
            self.new_blocks_of[rid] = kvm.get_blocks(rid)
            self.admitted.append(r)
        return True

    def release(self, r) -> None:
        self._located.pop(r.request_id, None)


class ShadowScheduler(Scheduler):
    """vLLM's V1 `Scheduler` with shadow prefill; with vLLM's async scheduling on (the GPU default) naming this
    class gives an `AsyncShadowScheduler` (the same code over vLLM's `AsyncScheduler`, which overlaps
    scheduling with the forward pass), so `--scheduler-cls shadowprefill.integrations.vllm.ShadowScheduler`
    is the one name for both.

    Requests with `priority >= shadow_priority` (default 1000) are shadow work. They are scheduled only after
    every non-shadow request, only when no non-shadow request waits and no admission was blocked by memory
    (Algorithm 1 line 2), at most the controller's token budget per step over all shadows together (Eq. 1
    slack, routed-step credit, idle cap βT, n_min), in whole-block chunks; they are preempted first when KV
    runs short and make room when a non-shadow request waits for memory or a sequence slot. Shadow KV is
    capped at `shadow_fraction` of the blocks; blocks computed only by shadow work are evicted before other
    cached blocks unless a non-shadow request hit them since (`shadow_kv.ShadowKV`). Non-shadow requests are
    scheduled by vLLM's own code. Configuration: `SHADOWPREFILL_VLLM` (see `config.py`).

    Supported: one full-attention KV-cache group, no speculative decoding, no EC connector, no KV connector
    but vLLM's `OffloadingConnector` (the host tier, `connector.py`), no pipeline parallelism; synchronous or
    asynchronous scheduling, V1 or V2 model runner. Shadow requests with LoRA,
    multimodal inputs, structured output, prompt embeddings or prompt logprobs run as ordinary requests.
    """

    def __new__(cls, vllm_config, *args, **kwargs):
        if cls is ShadowScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = AsyncShadowScheduler                 # vLLM then runs steps through its batch queue
        return super().__new__(cls)

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs) -> None:
        cfg = ShadowSchedulerConfig.from_env()          # fail before vLLM allocates anything
        super().__init__(vllm_config, kv_cache_config, structured_output_manager, block_size, *args, **kwargs)
        self.shadow_config = cfg
        self._check_supported(vllm_config, kv_cache_config)
        self._conn = ConnectorAdmission(self) if self.connector is not None else None   # host tier (connector.py)
        self._hook = None                               # the shadow phase, run in vLLM's connector-meta hook
        self._deferred_frees = DeferredShadowFrees()
        self._kv = ShadowKV(self.kv_cache_manager.block_pool,
                            int(cfg.shadow_fraction * (kv_cache_config.num_blocks - 1)), cfg.cold_age_s)
        n_min = whole_block_n_min(cfg.n_min, self.block_size)      # chunks are whole blocks
        if n_min != cfg.n_min:
            logger.warning("ShadowScheduler: n_min %d is not a whole number of %d-token blocks; using %d",
                           cfg.n_min, self.block_size, n_min)
        self.predictor = make_predictor(vllm_config, n_min)
        slo = cfg.tpot_slo_s if cfg.tpot_slo_s is not None else default_tpot_slo(self.predictor)
        self.controller = ShadowController(cfg.policy, self.predictor, tpot_slo=slo,
                                           token_budget=self.max_num_scheduled_tokens,
                                           max_seqs=self.max_num_running_reqs, beta=cfg.beta, delta=cfg.delta,
                                           margin=cfg.margin, n_min=n_min, feedback=False)   # see below
        self._slo_fixed = cfg.tpot_slo_s is not None or cfg.warmup_steps == 0
        self._decode_steps = 0                          # measured decode-only steps (identify t̂'s decode part)
        self._shadows: dict[str, object] = {}           # live shadow requests by id
        self._first_token: dict[str, float] = {}        # f_r of non-shadow requests (wall clock)
        self._ttft_slo: dict[str, float] = {}           # F_r by request (paper's rule, fixed on first sight)
        self._refused: dict[str, object] = {}           # superseded or larger than the cap: finished after the step
        self._steps: dict[int, _Step] = {}              # scheduled, not yet updated (async: up to two)
        self._last_done = time.perf_counter()           # when the last step's output was processed
        self._step_no = 0
        self.totals = {"steps": 0, "shadow_tokens": 0, "budget_tokens": 0, "shadow_chunks": 0, "shadow_preempted": 0,
                       "shadow_refused": 0, "shadow_superseded": 0, "shadow_host_loads": 0}
        rank = vllm_config.parallel_config.data_parallel_rank
        path = cfg.stats_path
        if path is not None and vllm_config.parallel_config.data_parallel_size > 1:
            path = f"{path}.dp{rank}"
        self._stats = StepStatsWriter(path) if path is not None else None
        logger.info("ShadowScheduler: shadow priority >= %d, policy %s, TPOT SLO %s, shadow cap %d of %d blocks, "
                    "n_min %d, stats %s", cfg.shadow_priority, cfg.policy,
                    f"{slo * 1e3:.1f} ms" if self._slo_fixed else "from measured steps", self._kv.cap,
                    kv_cache_config.num_blocks, n_min, path)

    def _check_supported(self, vllm_config, kv_cache_config) -> None:
        def refuse(what: str) -> None:
            raise ValueError(f"ShadowScheduler: {what}")
        if self.policy != SchedulingPolicy.PRIORITY:
            refuse("needs --scheduling-policy priority (shadows are the lowest priority class)")
        if not self.cache_config.enable_prefix_caching:
            refuse("needs --enable-prefix-caching (shadow work only fills the prefix cache)")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec) \
                or groups[0].kv_cache_spec.sliding_window is not None:
            refuse("supports models with one full-attention KV cache group only (no sliding window, hybrid "
                   "or Mamba layers)")
        if self.num_spec_tokens or self.num_lookahead_tokens or self.num_prefill_lookahead:
            refuse("does not support speculative decoding")
        problem = connector_problem(self)
        if problem is not None:
            refuse(problem)
        if self.ec_connector is not None:
            refuse("does not support encoder-cache connectors")
        if isinstance(self, AsyncScheduler) and not self.scheduler_config.async_scheduling:
            refuse("AsyncShadowScheduler needs vLLM's async scheduling; name ShadowScheduler (it picks the "
                   "synchronous or the asynchronous form itself)")
        if self.use_pp or self.needs_kv_cache_zeroing or self.has_mamba_layers:
            refuse("does not support pipeline parallelism or KV-cache zeroing")

    # ------------------------------------------------------------------------------- request classes
    def _shadow_eligible(self, request) -> bool:
        sp = request.sampling_params
        return (request.priority >= self.shadow_config.shadow_priority and request.status == RequestStatus.WAITING
                and request.lora_request is None and not request.mm_features and request.pooling_params is None
                and not request.use_structured_output and request.prompt_embeds is None and not request.resumable
                and not (sp is not None and sp.prompt_logprobs))

    def add_request(self, request) -> None:
        new = request.request_id not in self.requests
        if new and self._shadow_eligible(request):
            self._shadows[request.request_id] = request
        super().add_request(request)
        if new and self._shadows and request.priority <= self.shadow_config.routed_priority:
            self._supersede(request)

    def _supersede(self, routed) -> None:
        """A routed call of a session supersedes that session's shadows (§3.1, newer calls supersede pending
        work): it computes whatever of their prefix is not cached yet itself, so they stop now (finished as
        aborted after this step; blocks they computed stay cached). Same session: same first block."""
        hashes = routed.block_hashes
        if not hashes:
            return
        for sid, sh in self._shadows.items():
            if sh.block_hashes and sh.block_hashes[0] == hashes[0] and sid not in self._refused:
                self._refused[sid] = sh
                self.totals["shadow_superseded"] += 1

    def _free_request(self, request, delay_free_blocks: bool = False):
        rid = request.request_id
        self._first_token.pop(rid, None)
        self._ttft_slo.pop(rid, None)
        out = super()._free_request(request, delay_free_blocks)
        self._shadows.pop(rid, None)
        return out

    def _free_request_blocks(self, request) -> None:
        """Every free (finish or preemption) records block ages; a shadow's cached blocks go evict-first."""
        blocks = self.kv_cache_manager.get_blocks(request.request_id).blocks[0]
        super()._free_request_blocks(request)
        now = time.monotonic()
        self._kv.note_freed(blocks, now)
        if request.request_id in self._shadows:
            if self.defer_block_free and any(b.ref_cnt > 0 and not b.is_null for b in blocks):
                self._deferred_frees.add(self.sched_step_seq, blocks)    # vLLM frees them after the fence
            else:
                self._kv.place_freed(blocks, now)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        ok = super().reset_prefix_cache(reset_running_requests, reset_connector)
        if ok:
            self._kv.clear()
        return ok

    # --------------------------------------------------------------------------------------- schedule
    def schedule(self, throttle_prefills: bool = False):
        t0, wall = time.perf_counter(), time.time()
        shadows = self._shadows.values()
        if shadows:
            self._yield_to_waiting()
        hidden = [r for r in shadows if r.status in _QUEUED]
        if hidden and self._conn is None:
            self.waiting.remove_requests(hidden)
        elif hidden:                                    # kv-holding: parked or finished host-tier loads
            self.waiting.remove_requests([r for r in hidden if not self._holds_kv_blocks(r)])
            self.kv_holding_waiting.remove_requests([r for r in hidden if self._holds_kv_blocks(r)])
        parked = []
        for r in shadows:
            if r.status == RequestStatus.RUNNING:     # vLLM skips a request for one call at this step mark
                parked.append((r, r.next_decode_eligible_step))
                r.next_decode_eligible_step = max(r.next_decode_eligible_step, self.current_step + 2)
        ran: list = []
        if self._conn is not None:      # connector: shadow chunks go in before vLLM builds the connector's meta
            self._hook = lambda out: ran.append(self._hooked_phase(out, wall, hidden))
        try:
            out = super().schedule(throttle_prefills)
        except BaseException:
            if not ran:
                self._restore(hidden)
            raise
        finally:
            self._hook = None
            for r, step in parked:
                r.next_decode_eligible_step = step
        if self._conn is not None:
            if not ran:                 # vLLM built no connector meta: no shadow work this step
                self._restore(hidden)
                return out
            step = ran[0]
        else:
            if len(self._kv):
                self._leave_shadow_class(out)
            step = self._shadow_phase(out, wall, hidden)
        step.t0 = t0
        if out.total_num_scheduled_tokens:
            self._steps[id(out)] = step
        else:                           # not recorded: a step that only started host-tier loads
            self.totals["shadow_host_loads"] += len(step.shadow_loads)
        if not out.total_num_scheduled_tokens and self._shadows:
            time.sleep(_IDLE_SLEEP_S)
        return out

    def _build_kv_connector_meta(self, connector, scheduler_output):
        """vLLM's hook at the end of `schedule()`: with a connector, the shadow phase runs here, so the
        connector's metadata (host-tier stores of shadow blocks) and vLLM's `_update_after_schedule` both
        see the shadow chunks."""
        hook = self._hook
        if hook is not None:
            self._hook = None
            hook(scheduler_output)
        return super()._build_kv_connector_meta(connector, scheduler_output)

    def _hooked_phase(self, out, wall: float, hidden: list) -> _Step:
        normal_tokens = out.total_num_scheduled_tokens
        if len(self._kv):
            self._leave_shadow_class(out)
        step = self._shadow_phase(out, wall, hidden, advanced=False)
        if step.shadow_chunks and self.defer_block_free and not normal_tokens:
            self.sched_step_seq += 1    # vLLM advances its free fence on non-empty steps, counted before shadows
        return step

    def _restore(self, rest) -> None:
        """Hidden shadows not scheduled go back to vLLM's queues (kv-holding ones: parked loads)."""
        if self._conn is None:
            self.waiting.prepend_requests(rest)
            return
        self.waiting.prepend_requests([r for r in rest if not self._holds_kv_blocks(r)])
        self.kv_holding_waiting.prepend_requests([r for r in rest if self._holds_kv_blocks(r)])

    def _yield_to_waiting(self) -> None:
        """A non-shadow request that waits must never wait for shadow KV or a shadow's sequence slot: preempt
        running shadows (latest first) until the waiting requests' full prompts fit (no prefix hits assumed)."""
        running = [r for r in self._shadows.values() if r.status == RequestStatus.RUNNING]
        if not running:
            return
        n_shadow_waiting = sum(r.status in _QUEUED for r in self._shadows.values())
        if len(self.waiting) + len(self.kv_holding_waiting) - n_shadow_waiting <= 0:
            return
        bs = self.block_size
        need_blocks = need_slots = 0
        for queue in (self.kv_holding_waiting, self.waiting):
            for r in queue:
                if r.request_id not in self._shadows:
                    held = len(self.kv_cache_manager.get_blocks(r.request_id).blocks[0]) \
                        if queue is self.kv_holding_waiting else 0            # e.g. a host-tier load's blocks
                    need_blocks += max(0, -(-(r.num_tokens + 1) // bs) - held)
                    need_slots += 1
        pool = self.kv_cache_manager.block_pool
        running.sort(key=lambda r: (r.priority, r.arrival_time), reverse=True)
        ts = time.monotonic()
        for victim in running:
            free = pool.get_num_free_blocks() - self.kv_cache_manager.watermark_blocks
            slots = self.max_num_active_reqs - len(self.running) - self.num_waiting_for_streaming_input
            if free >= need_blocks and slots >= need_slots:
                break
            self.running.remove(victim)
            self._preempt_request(victim, ts)

    def _leave_shadow_class(self, out) -> None:
        """Blocks a non-shadow request now holds leave the shadow class: prefix hits are promoted, new
        allocations are evicted shadow blocks being reused."""
        bs, kv = self.block_size, self._kv
        for nr in out.scheduled_new_reqs:
            if nr.req_id not in self._shadows:
                ids, hits = nr.block_ids[0], nr.num_computed_tokens // bs
                kv.leave(ids[:hits], hit=True)
                kv.leave(ids[hits:], hit=False)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if new is None or rid in self._shadows:
                continue
            ids = new[0]
            if rid in cached.resumed_req_ids:
                hits = cached.num_computed_tokens[i] // bs
                kv.leave(ids[:hits], hit=True)
                kv.leave(ids[hits:], hit=False)
            else:
                kv.leave(ids, hit=False)

    # ------------------------------------------------------------------------------- Algorithm 1
    def _view_of(self, out, wall: float, step: _Step, hidden_ids: set, advanced: bool = True) -> IterationView:
        """The routed/normal part of the step as the controller reads it (before shadow chunks); `advanced`:
        vLLM already advanced the requests' computed tokens by this step's (not yet, in the connector hook)."""
        cfg, ctl = self.shadow_config, self.controller
        decodes, prefills, routed = [], [], False
        for rid, n in out.num_scheduled_tokens.items():
            r = self.requests[rid]
            before = r.num_computed_tokens - n if advanced else r.num_computed_tokens
            first = self._first_token.get(rid)
            ttft = self._ttft_slo.get(rid)
            if ttft is None:
                ttft = cfg.ttft_slo_s if cfg.ttft_slo_s is not None else default_ttft_slo(
                    self.predictor, r.num_prompt_tokens, self.max_num_scheduled_tokens)
                self._ttft_slo[rid] = ttft
            v = _ReqView(r.arrival_time, first, max(0, r.num_output_tokens - 1), before, r.num_tokens - before,
                         ttft, ctl.tpot_slo)
            if first is not None and n == 1 and r.num_tokens - before == 1:
                decodes.append((rid, v))
            else:
                prefills.append((rid, v, n))
            routed = routed or r.priority <= cfg.routed_priority
        step.decodes, step.prefills = decodes, prefills
        preempted = out.preempted_req_ids or ()
        step.preempted_shadows = sum(1 for i in preempted if i in self._shadows)
        in_queue = sum(1 for i in preempted if i in self._shadows and i not in hidden_ids)   # preempted by vLLM
        step.waiting = len(self.waiting) + len(self.kv_holding_waiting) - in_queue
        bs, now = self.block_size, time.monotonic()
        return IterationView(wall, [v for _, v in decodes], [(v, n) for _, v, n in prefills], routed,
                             waiting=step.waiting > 0, admission_blocked=bool(preempted),
                             num_tokens=out.total_num_scheduled_tokens, num_seqs=len(out.num_scheduled_tokens),
                             free_shadow_tokens=lambda limit: self._kv.available(limit // bs, now) * bs)

    def _shadow_phase(self, out, wall: float, hidden: list, advanced: bool = True) -> _Step:
        step = _Step()
        step.output, step.wall, step.shadow_chunks, step.shadow_ids, step.shadow_loads = out, wall, [], [], []
        budget = self.controller.plan(self._view_of(out, wall, step, {r.request_id for r in hidden}, advanced))
        step.budget = budget
        step.warm = self._slo_fixed and self.predictor.warm
        if step.warm:           # guardrails: a step's shadow tokens at most 2x the largest measured prefill step
            allowance = min(budget.fresh_tokens, self.predictor.chunk_limit())
        else:                   # t̂ uncalibrated: probe chunks of n_min, on idle steps only (they teach t̂)
            allowance = budget.n_min if budget.branch == "idle" else 0
        paused = self._pause_state != PauseState.UNPAUSED
        if paused:
            allowance = 0
        admitted: list = []
        if self._shadows and not paused:
            candidates = [r for r in self._shadows.values() if r.status == RequestStatus.RUNNING] + hidden
            if self._refused:
                candidates = [r for r in candidates if r.request_id not in self._refused]
            candidates.sort(key=lambda r: (r.priority, r.arrival_time))
            if allowance > 0:
                self._take(budget, allowance, candidates, out, step, admitted, merged=advanced)
            # liveness, the engine's rule (engine/scheduler.py _shadow_phase): b admitted no chunk at any
            # shadow's own context, so t̂ or its shrink may be stale: one probe. (Judged on `fresh_tokens`, a
            # chunk on no context, a shadow whose context made a chunk cost just over b never ran again.)
            if step.warm and not budget.tokens and not step.shadow_loads and self.controller.probe_due(budget):
                step.warm, allowance = False, budget.n_min
                self._take(budget, allowance, candidates, out, step, admitted, merged=advanced)
        step.allowance = allowance
        if hidden:
            chosen = set(map(id, admitted))
            self._restore([r for r in hidden if id(r) not in chosen])
        return step

    def _take(self, budget, allowance: int, candidates, out, step: _Step, admitted: list, merged: bool) -> None:
        """Line 15 (shadow.spend.spend_budget, the engine's function too): whole-block chunks for shadow requests
        in (priority, arrival) order within the budget and `allowance` tokens; one probe while t̂ is cold."""
        host = _StepHost(self, out, step, admitted)
        spend_budget(budget, candidates, host, limit=allowance, probe=not step.warm)
        if host.sched:
            self._merge(out, host.sched, host.running_now, host.resumed_now, host.new_now, host.new_blocks_of,
                        advance=merged)
            if host.sync_load:
                out.has_sync_kv_loads = True

    def _refuse(self, r) -> None:
        if r.request_id not in self._refused:
            self._refused[r.request_id] = r
            self.totals["shadow_refused"] += 1

    def _admit(self, r, context: int, n: int, computed, ext: int = 0, loaded: bool = False) -> None:
        """What vLLM's waiting loop does when it admits a request (text-only): `ext` of the `context` tokens
        come from the connector; `loaded`: its asynchronous load finished (no lookup, no stats again)."""
        if not loaded:
            if r.prefill_stats and r.num_preemptions <= 0:
                r.prefill_stats.set(num_prompt_tokens=r.num_prompt_tokens, num_local_cached_tokens=context - ext,
                                    num_external_cached_tokens=ext)
            if self._conn is not None:
                self._conn.after_alloc(r, context - ext, ext)
            self.kv_cache_manager.record_prefix_cache_stats(r, context - ext)
        elif self._conn is not None:
            self._conn.conn.update_state_after_alloc(r, self.kv_cache_manager.get_blocks(r.request_id), 0)
        if self._conn is not None:
            self._conn.fetch_stage(r, None)
        deferred = getattr(self, "deferred_waiting", None)
        if deferred is not None:
            deferred.discard(r)
        self.running.append(r)
        if self.log_stats:
            r.record_event(EngineCoreEventType.SCHEDULED, time.monotonic())
        r.num_computed_tokens = context
        if context + n < r.num_tokens:
            self._inflight_prefills.add(r)

    def _merge(self, out, sched, running_now, resumed_now, new_now, new_blocks_of, advance: bool = True) -> None:
        """Add the shadow chunks to vLLM's step output, then advance them as vLLM advances its requests
        (`advance=False` in the connector hook: vLLM's own `_update_after_schedule` runs after it)."""
        if self.use_v2_model_runner:
            new_now, resumed_now = new_now + resumed_now, []
        for r in new_now:
            ids = new_blocks_of[r.request_id].get_block_ids()
            out.scheduled_new_reqs.append(
                NewRequestData.from_request(r, ids, r._all_token_ids, uses_mrope=self.model_uses_mrope)
                if self.use_v2_model_runner else NewRequestData.from_request(r, ids, uses_mrope=self.model_uses_mrope))
        extra = self._make_cached_request_data(running_now, resumed_now, sched, {}, new_blocks_of)
        for r in new_now + resumed_now:
            r.status = RequestStatus.RUNNING
        cached = out.scheduled_cached_reqs
        cached.req_ids.extend(extra.req_ids)
        cached.resumed_req_ids.update(extra.resumed_req_ids)
        cached.new_token_ids.extend(extra.new_token_ids)
        cached.all_token_ids.update(extra.all_token_ids)
        cached.new_block_ids.extend(extra.new_block_ids)
        cached.num_computed_tokens.extend(extra.num_computed_tokens)
        cached.num_output_tokens.extend(extra.num_output_tokens)
        out.num_scheduled_tokens.update(sched)
        out.total_num_scheduled_tokens += sum(sched.values())
        if not self.use_v2_model_runner:
            self.prev_step_scheduled_req_ids.update(sched)
        if not advance:
            state = getattr(out, "kv_connector_block_state", None)
            if state is not None:       # requests that may become connector jobs this step
                state.req_ids.update(sched)
            return
        part = copy.copy(out)
        part.num_scheduled_tokens, part.has_structured_output_requests = sched, False
        finished, preempted = self.finished_req_ids, self.reset_preempted_req_ids
        super()._update_after_schedule(part)             # advances num_computed_tokens of the shadows
        self.finished_req_ids, self.reset_preempted_req_ids = finished, preempted

    # ------------------------------------------------------------------------------ after the step
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.defer_block_free:
            self._deferred_frees.drain(self.processed_step_seq, self._kv)
        if self._refused:
            self._finish_refused(outputs)
        step = self._steps.pop(id(scheduler_output), None)
        if step is None or step.output is not scheduler_output:
            return outputs
        end = time.perf_counter()
        duration = end - max(step.t0, self._last_done)  # async: the step ran after the one before it ended
        self._last_done = end
        wall = time.time()
        for rid, _, _ in step.prefills:
            r = self.requests.get(rid)
            if r is not None and rid not in self._first_token and r.num_output_tokens > 0:
                self._first_token[rid] = wall
        prefill = [(n, v.num_computed_tokens) for _, v, n in step.prefills] + step.shadow_chunks
        decode_ctx = [v.num_computed_tokens + 1 for _, v in step.decodes]
        predicted = self.predictor.predict(prefill, decode_ctx)         # t̂ as the budget saw it (before refit)
        shadow_s = sum(self.predictor.chunk_time(n, c) for n, c in step.shadow_chunks)
        b = step.budget
        bound = None                # feedback: what a shadow-carrying step was allowed before the shrink
        if step.shadow_chunks and b.seconds > 0 and not b.probe:   # (controller.ShadowBudget.bound_s)
            bound = b.bound_s
        self.predictor.observe(prefill, decode_ctx, duration, bound_s=bound, predicted_s=predicted)
        busy = bool(step.decodes or step.prefills)
        decode_only = busy and not step.prefills and not step.shadow_chunks
        self.controller.end_iteration(duration, busy=busy, decode_only=decode_only)
        self._decode_steps += decode_only
        if step.shadow_chunks:
            self.controller.progressed(step.wall)       # the liveness probe's clock (controller.probe_due)
        if not self._slo_fixed:     # the rule needs decode steps: t̂'s decode part is unidentified without them
            warmup = self.shadow_config.warmup_steps
            self._update_slo(fix=self.predictor.num_observations >= warmup and self._decode_steps >= warmup // 2)
        self._record(step, duration, predicted, shadow_s)
        return outputs

    def _finish_refused(self, outputs) -> None:
        """Finish, as aborted, shadows that a routed call superseded and shadows needing more new blocks than the
        whole shadow cap (they would wait forever), with an output so the client's request ends (as vLLM does
        for its errors)."""
        reqs = self.finish_requests(list(self._refused), RequestStatus.FINISHED_ABORTED)
        self._refused.clear()
        for r in reqs:
            if -(-r.num_tokens // self.block_size) > self._kv.cap:
                logger.warning("ShadowScheduler: shadow %s (%d tokens) exceeds the shadow KV cap of %d blocks; "
                               "aborted", r.request_id, r.num_tokens, self._kv.cap)
            out = EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason=r.get_finished_reason(),
                                   events=r.take_events(), trace_headers=r.trace_headers)
            if r.client_index in outputs:
                outputs[r.client_index].outputs.append(out)
            else:
                outputs[r.client_index] = EngineCoreOutputs(outputs=[out])

    def _update_slo(self, fix: bool) -> None:
        """The paper's TPOT rule (max(25 ms, 5 x batch-1 decode)) on the refitted t̂; fixed once warm."""
        slo = default_tpot_slo(self.predictor)
        ctl = self.controller
        ctl.set_tpot_slo(slo)
        if fix:
            self._slo_fixed = True
            logger.info("ShadowScheduler: TPOT SLO %.1f ms from %d measured steps (beta*T = %.1f ms)", slo * 1e3,
                        self.predictor.num_observations, ctl.cap * 1e3)

    def _record(self, step: _Step, duration: float, predicted: float, shadow_s: float) -> None:
        self._step_no += 1
        if self._step_no % 1024 == 0:
            self._kv.prune()
        shadow_tokens = sum(n for n, _ in step.shadow_chunks)
        t = self.totals
        t["steps"] += 1
        t["shadow_tokens"] += shadow_tokens
        t["budget_tokens"] += step.allowance
        t["shadow_chunks"] += len(step.shadow_chunks)
        t["shadow_preempted"] += step.preempted_shadows
        t["shadow_host_loads"] += len(step.shadow_loads)
        if self._stats is None:
            return
        b, kv = step.budget, self._kv
        self._stats.write({
            "step": self._step_no, "t": round(step.wall, 6), "duration_s": round(duration, 6),
            "predicted_s": predicted, "shadow_s": shadow_s, "branch": b.branch, "budget_s": b.seconds,
            "budget_tokens": step.allowance, "shadow_tokens": shadow_tokens, "shadow_chunks": len(step.shadow_chunks),
            "shadow_blocks": kv.count(), "shadow_cap_blocks": kv.cap, "num_blocks": self.kv_cache_config.num_blocks,
            "free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
            "waiting": step.waiting, "running": len(self.running), "decodes": len(step.decodes),
            "prefill_tokens": sum(n for _, _, n in step.prefills), "shadow_pending": len(self._shadows),
            "shadow_preempted": t["shadow_preempted"], "shadow_evicted_blocks": kv.evicted,
            "shadow_promoted_blocks": kv.promoted, "tpot_slo_s": round(self.controller.tpot_slo, 6),
            "credit_s": round(self.controller.credit, 6), "warm": step.warm,
            "budget_scale": round(self.predictor.budget_scale, 6), "chunk_limit": self.predictor.chunk_limit(),
            "overruns": self.predictor.overruns,
            "shadow_superseded": t["shadow_superseded"], "shadow_refused": t["shadow_refused"],
            "shadow_host_loads": [[i, n] for i, n in step.shadow_loads],
            "shadow_reqs": [[i, n, c] for i, (n, c) in zip(step.shadow_ids, step.shadow_chunks)]})

    def shutdown(self) -> None:
        if self._stats is not None:
            self._stats.close()
        super().shutdown()


class AsyncShadowScheduler(ShadowScheduler, AsyncScheduler):
    """`ShadowScheduler` over vLLM's `AsyncScheduler` (method order: the shadow phase, then vLLM's async
    bookkeeping: output placeholders for a shadow's last chunk, delayed caching of its blocks). Chosen by
    `ShadowScheduler` itself when async scheduling is on; may also be named directly."""
