"""LLMEngine: one serving instance — scheduler, KV cache manager, shadow controller, executor, clock.

One iteration, in the shape nano-vllm made familiar (DESIGN.md §5), three calls:

    batch   = scheduler.schedule(now)          # decodes, prefill chunks, admissions; last, the shadow phase:
                                               # controller.plan (Alg. 1 lines 1-12) spent on the shadow
                                               # requests, the queue's lowest class (line 15, shadow/spend.py):
                                               # their chunks join as prefill entries; then host-tier reloads
    result  = executor.execute(batch)          # a real forward, or a latency model's duration
    outputs = scheduler.postprocess(batch, result.tokens, now, result.duration)
                                               # tokens, finishes, prefix-cache registration, shadow pages,
                                               # credit, t̂ refit, stats (written there only)

    engine = LLMEngine(model, EngineConfig(num_blocks=512))          # Harvest-SLO by default
    engine.add_request("r1", prompt, max_tokens=32, priority="routed", session_id="s1")
    engine.add_shadow("s2", history_of_s2, switch_prob=0.4)
    while engine.has_work():
        for out in engine.step(): ...

For a discrete-event simulator, `schedule_step()` runs the iteration and returns it with its duration; the
simulator moves the (shared, virtual) clock to its end and calls `complete_step(it)`. `step()` is the two
together, advancing the engine's own clock.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from shadowprefill.engine.clock import Clock, VirtualClock, WallClock
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import Executor, ModelExecutor, SimulatedExecutor
from shadowprefill.engine.request import Priority, Request, RequestOutput
from shadowprefill.engine.scheduler import ScheduledBatch, Scheduler
from shadowprefill.engine.stats import EngineStats
from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.spec import KVCacheSpec
from shadowprefill.kv.stats import PoolStats
from shadowprefill.model.latency import LatencyModel
from shadowprefill.shadow.controller import ShadowController, default_tpot_slo, default_ttft_slo
from shadowprefill.shadow.jobs import check_token_ids
from shadowprefill.shadow.policy import whole_block_n_min
from shadowprefill.shadow.predictor import IterationPredictor


SHADOW_RETRY_S = 0.1   # seconds before an engine retries shadow work that could not run


class ShadowProgress(NamedTuple):
    """A session's shadow job on one engine: its history and how much of it the engine caches."""

    token_ids: list[int]
    num_cached: int
    tenant: str


class Iteration:
    """A scheduled and executed iteration awaiting `complete_step`."""

    __slots__ = ("batch", "tokens", "duration", "start")

    def __init__(self, batch: ScheduledBatch, tokens: list[int], duration: float, start: float) -> None:
        self.batch, self.tokens, self.duration, self.start = batch, tokens, duration, start

    @property
    def budget_s(self) -> float:
        """b, when shadow chunks joined under a whole-iteration budget; else 0."""
        return self.batch.budget_s


class LLMEngine:
    """A continuous-batching engine with shadow prefill.

    `model_or_executor`: a model with `forward(ForwardBatch, kv_cache)` and `kv_spec(block_size)` (a
    ModelExecutor is built over a freshly allocated KV cache on the model's device), or an `Executor`
    (e.g. `SimulatedExecutor(latency_model)`). `clock`: default WallClock for a model, VirtualClock for a
    SimulatedExecutor. `latency_model` seeds the predictor t̂ (default: the SimulatedExecutor's, else the
    roofline of the model's config). `host_tier`: a ready HostTier, else one of `config.host_tier_gib`.
    """

    def __init__(self, model_or_executor, config: EngineConfig, clock: Clock | None = None, *,
                 latency_model=None, host_tier: HostTier | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        bs = config.block_size
        spec = None
        self.vocab_size = None
        self.max_position = None
        if isinstance(model_or_executor, Executor):
            self.executor = model_or_executor
            kv_cache = self.executor.kv_cache
            if kv_cache is not None:
                spec = KVCacheSpec.of(kv_cache)
        elif callable(getattr(model_or_executor, "kv_spec", None)):
            model = model_or_executor
            spec = model.kv_spec(bs)
            kv_cache = spec.allocate(config.num_blocks, model.device)
            self.executor = ModelExecutor(model, kv_cache)
        else:
            raise TypeError("model_or_executor must be an Executor or a model with kv_spec()/forward(), got "
                            f"{type(model_or_executor).__name__}")
        model_config = getattr(getattr(self.executor, "model", None), "config", None)
        if model_config is not None:
            self.vocab_size = getattr(model_config, "vocab_size", None)
            self.max_position = getattr(model_config, "max_position", None)
            if latency_model is None:
                latency_model = LatencyModel(model_config, tp=1)     # the roofline seed; refitted online
        if latency_model is None and isinstance(self.executor, SimulatedExecutor):
            latency_model = self.executor.latency_model
        if latency_model is None:
            raise ValueError("latency_model: needed to seed the predictor (none could be derived)")
        if clock is None:
            clock = VirtualClock() if isinstance(self.executor, SimulatedExecutor) else WallClock()
        if not (callable(getattr(clock, "now", None)) and callable(getattr(clock, "advance", None))):
            raise TypeError("clock must have now() and advance(seconds)")
        self.clock = clock

        page_bytes = spec.page_bytes if spec is not None else config.page_bytes
        if host_tier is None and config.host_tier_gib > 0:
            if page_bytes <= 0:
                raise ValueError("config.page_bytes must be > 0 to size a host tier without KV tensors")
            host_tier = HostTier(capacity_bytes=int(config.host_tier_gib * 2**30), spec=spec, page_bytes=page_bytes)
        self.kv = KVCacheManager(config.num_blocks, bs, kv_cache=kv_cache, host_tier=host_tier,
                                 page_bytes=0 if kv_cache is not None else page_bytes,
                                 shadow_fraction=config.shadow_fraction, cold_age_s=config.cold_age_s,
                                 model_id=config.model_id)
        self.n_min = whole_block_n_min(config.n_min, bs)   # chunks are whole pages (policy.whole_block_n_min)
        self.predictor = IterationPredictor(latency_model, forgetting=config.predictor_forgetting,
                                            probe_tokens=self.n_min)   # t̂ probes n_min until warm
        self.latency_model = latency_model        # one model: t̂'s seed, host reloads (Alg. 1), placement estimates
        self._overlap = getattr(latency_model, "overlapped_time", None)
        self._host_transfer = getattr(latency_model, "host_transfer_time", None)
        tpot = config.tpot_slo_s if config.tpot_slo_s is not None else default_tpot_slo(
            self.predictor, minimum=config.min_tpot_slo_s, factor=config.slo_factor)
        self.controller = ShadowController(config.shadow_mode, self.predictor, tpot_slo=tpot,
                                           token_budget=config.token_budget, max_seqs=config.max_seqs,
                                           beta=config.beta, delta=config.delta, margin=config.margin,
                                           n_min=self.n_min, idle_cap_s=config.idle_cap_s)
        self.policy = self.controller.policy
        self._stats = EngineStats()
        self.scheduler = Scheduler(config, self.kv, self._stats, controller=self.controller, overlap=self._overlap,
                                   max_len=self.max_position)
        self.shadow = self.scheduler.shadow        # shadow targets: the scheduler's (engine.shadow_work)
        self._fill_token = self.executor.fill_token   # not None: the executor samples nothing (counted tokens)
        self._in_flight: Iteration | None = None
        self._shadow_retry_at = -math.inf          # shadow work that could not run is retried from then on

    @property
    def jobs(self):
        """The shadow class of the scheduler's queue (engine.shadow_work.ShadowQueue: a ShadowRequest per
        session)."""
        return self.scheduler.waiting[Priority.SHADOW]

    @property
    def tpot_slo(self) -> float:
        """T: the engine's TPOT SLO (configured, or the paper's rule from the predictor)."""
        return self.controller.tpot_slo

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids, max_tokens: int, priority: str = "normal",
                    session_id: str | None = None, ttft_slo: float | None = None, tpot_slo: float | None = None,
                    tenant: str = "", output_token_ids=None, stream: bool = True) -> Request:
        """Queue a call. `priority`: "routed" (an agent's routed call) or "normal" (other traffic).
        SLOs default to the paper's rule (§5.1). A routed call of a session drops that session's shadow
        job here: whatever the shadow computed is in the prefix cache, and the call prefills the rest.
        `output_token_ids`: replay these output tokens instead of the sampled ones (a simulator replaying a
        recorded call). `stream`: `step()` reports the request at every token; False: only when it finishes
        (the final RequestOutput has every token)."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        prompt = check_token_ids("prompt_token_ids", prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if self.vocab_size is not None and max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt_token_ids holds a token id >= vocab_size {self.vocab_size}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        total = len(prompt) + max_tokens
        if -(-total // self.config.block_size) > self.config.num_blocks:
            raise ValueError(f"prompt_token_ids + max_tokens ({total} tokens) exceed the KV pool "
                             f"({self.config.num_blocks} pages of {self.config.block_size} tokens)")
        if self.max_position is not None and total > self.max_position:
            raise ValueError(f"prompt_token_ids + max_tokens ({total} tokens) exceed the model's max_position "
                             f"{self.max_position}")
        prio = Priority.parse(priority)
        if prio is Priority.SHADOW:
            raise ValueError("priority must be 'routed' or 'normal'; use add_shadow for shadow work")
        for name, slo in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
            if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or not slo > 0):
                raise ValueError(f"{name} must be a number > 0, got {slo!r}")
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, got {type(tenant).__name__}")
        now = self.clock.now()
        cfg = self.config
        ttft = float(ttft_slo) if ttft_slo is not None else (
            float(cfg.ttft_slo_s) if cfg.ttft_slo_s is not None else
            default_ttft_slo(self.predictor, len(prompt), cfg.token_budget, minimum=cfg.min_ttft_slo_s,
                             factor=cfg.slo_factor))
        tpot = float(tpot_slo) if tpot_slo is not None else self.tpot_slo
        replay = None if output_token_ids is None else check_token_ids("output_token_ids", output_token_ids)
        r = Request(request_id, prompt, max_tokens, prio, now, self.scheduler.next_seq(), session_id=session_id,
                    tenant=tenant, ttft_slo=ttft, tpot_slo=tpot, replay_token_ids=replay, stream=bool(stream),
                    fill_token=self._fill_token, own_prompt=True)      # (check_token_ids made the list)
        if prio is Priority.ROUTED and session_id is not None:
            self.cancel_shadow(session_id)
        self.scheduler.add(r)
        self._shadow_retry_at = -math.inf
        return r

    def abort_request(self, request_id: str) -> None:
        """Drop a queued or running request (its pages go back to the pool)."""
        r = self.scheduler.requests.get(request_id)
        if r is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        r.finish_reason = "abort"
        self.scheduler.abort(r, self.clock.now())

    # -------------------------------------------------------------------------------------- shadow
    def add_shadow(self, session_id: str, token_ids, switch_prob: float | None = None, tenant: str = "") -> None:
        """Make `token_ids` (the session's history) the shadow target of this engine (§3.1): an extension
        keeps progress, a rewrite keeps the longest common prefix. What happens is the controller policy's:
        a shadow request in the queue's lowest class whose prompt grows (Harvest, Harvest-SLO), the same
        request at normal priority (Eager), or nothing (none;
        logged once). See engine.shadow_work."""
        if not isinstance(session_id, str) or not session_id:
            raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")
        if self.shadow.add(session_id, token_ids, self.clock.now(), switch_prob=switch_prob, tenant=tenant):
            self._shadow_retry_at = -math.inf

    def extend_shadow(self, session_id: str, token_ids) -> None:
        """Append tokens (streamed output) to a session's shadow history; creates no job."""
        if self.shadow.extend(session_id, token_ids, self.clock.now()):
            self._shadow_retry_at = -math.inf

    def cancel_shadow(self, session_id: str) -> None:
        """Forget a session's shadow work (pages already computed stay cached)."""
        self.shadow.cancel(session_id, self.clock.now())

    def shadow_progress(self, session_id: str) -> ShadowProgress | None:
        """The session's shadow job here (history, tokens of it believed cached, tenant), or None."""
        job = self.jobs.get(session_id)
        return None if job is None else ShadowProgress(job.token_ids, job.num_cached, job.tenant)

    def shadow_pending_tokens(self, session_id: str | None = None) -> int:
        """Whole-page shadow tokens not cached yet: of one session's job (0 without one), or of all."""
        if session_id is None:
            return self.jobs.pending_tokens()
        job = self.jobs.get(session_id)
        return 0 if job is None else job.pending_tokens(self.config.block_size)

    def load(self) -> dict:
        """A snapshot of what the engine holds: waiting / running requests, shadow jobs, free pages."""
        sched = self.scheduler
        return {"waiting": sched.num_waiting(), "running": len(sched.running), "shadow_jobs": len(self.jobs),
                "shadow_pending_tokens": self.jobs.pending_tokens(), "free_blocks": self.kv.num_free_blocks}

    def shadow_sessions(self) -> list[str]:
        """Sessions with a shadow job here, in the order their work runs (switch probability)."""
        return [job.session_id for job in self.jobs.ordered()]

    # ---------------------------------------------------------------------------------------- step
    def has_work(self) -> bool:
        """Requests queued or running, or shadow work that can run now."""
        if self.scheduler.has_unfinished():
            return True
        return self.clock.now() >= self._shadow_retry_at and self.shadow.has_runnable(self.n_min)

    def step(self) -> list[RequestOutput]:
        """Run one iteration on the engine's clock; outputs of streaming requests that got a token and of
        requests that finished."""
        it = self.schedule_step()
        if it is None:
            return []
        self.clock.advance(it.duration)
        return self.complete_step(it)

    def schedule_step(self) -> Iteration | None:
        """Schedule and execute one iteration at clock.now(); None if there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("complete_step() the previous iteration first")
        now = self.clock.now()
        batch = self.scheduler.schedule(now)          # requests, then the controller's shadow phase
        if batch.is_empty:
            # only shadow work was left and none can run now: what blocks it (shadow KV not yet cold, no
            # slack, credit) changes with time, so offer it again after a short pause, or on new work
            self._shadow_retry_at = now + SHADOW_RETRY_S
            return None
        result = self.executor.execute(batch)
        self._in_flight = Iteration(batch, result.tokens, result.duration, now)
        return self._in_flight

    def complete_step(self, it: Iteration) -> list[RequestOutput]:
        """Apply an executed iteration at clock.now() (its end): tokens, finishes, cache, credit, t̂, stats."""
        if it is not self._in_flight:
            raise ValueError("it is not the iteration in flight")
        self._in_flight = None
        return self.scheduler.postprocess(it.batch, it.tokens, self.clock.now(), it.duration)

    # ------------------------------------------------------------------------------------- queries
    @property
    def stats(self) -> EngineStats:
        """What this engine counted (written by its scheduler only)."""
        return self.scheduler.read_stats()

    @property
    def kv_stats(self) -> PoolStats:
        """The KV cache manager's accounting (hits by tier, evictions, spills, shadow pages used/wasted)."""
        return self.kv.stats

    def num_unfinished_requests(self) -> int:
        """Requests queued or running (Eager's shadow requests included)."""
        return len(self.scheduler.requests)

    def queued_prefill_tokens(self) -> int:
        """Tokens still to prefill over waiting and prefilling requests (the queue part of a router's
        prefill-completion estimate)."""
        sched = self.scheduler
        total = sum(r.num_remaining for q in (sched.waiting[Priority.ROUTED], sched.waiting[Priority.NORMAL])
                    for r in q)
        return total + sum(r.num_remaining for r in sched.running if r.num_remaining > 1)

    def cached_prefix_tokens(self, token_ids, tenant: str = "", hashes=None) -> tuple[int, int]:
        """(device, host) tokens of token_ids' longest cached prefix, without touching the cache. hashes: a
        `page_hash_chain(token_ids, tenant)` kept by the caller across calls (e.g. per session and model), so a
        long history is not re-hashed on every routing decision."""
        return self.kv.peek_prefix(token_ids, tenant=tenant, hashes=hashes)

    def page_hash_chain(self, token_ids, tenant: str = ""):
        """A kv.PageHashes of an append-only token list for this engine's model and `tenant` (valid on every
        engine of the same model id and block size)."""
        return self.kv.hash_chain(token_ids, tenant=tenant)

    def estimate_prefill_s(self, prompt, tenant: str = "", assume_cached: int | None = None) -> float:
        """Estimated seconds until `prompt` finishes prefill here (§3.1 "Sticky model placement"): the
        prefill queued ahead of it, then its own uncached tokens after the cached prefix (host-cached tokens
        add their reload). `assume_cached`: treat that many leading tokens as cached on the device."""
        budget, pred = self.config.token_budget, self.predictor
        if assume_cached is None:
            dev, host = self.cached_prefix_tokens(prompt, tenant)
        else:
            dev, host = assume_cached, 0
        cached = min(dev + host, len(prompt) - 1)
        host = max(0, cached - dev)
        queue = self.queued_prefill_tokens()
        t = pred.prefill_time(queue, 0, budget) if queue > 0 else 0.0
        t += pred.prefill_time(len(prompt) - cached, cached, budget)
        if host and self._host_transfer is not None:
            t += self._host_transfer(host)
        return t

    def import_prefix(self, token_ids, tenant: str = "", shadow: bool = False) -> tuple[int, int]:
        """Make `token_ids`' whole pages resident without computing them (KV that arrived from elsewhere: a
        P/D transfer, Oracle's free prefix). Returns (tokens resident, tokens added)."""
        return self.kv.import_prefix(token_ids, now=self.clock.now(), tenant=tenant, shadow=shadow)
