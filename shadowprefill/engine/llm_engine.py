"""LLMEngine: one serving instance — scheduler, KV pool, shadow controller, executor, clock.

One iteration (DESIGN.md §5): the scheduler batches decodes, prefill chunks and admissions; the shadow
controller adds shadow chunks (Algorithm 1); the executor runs the batch (a real forward, or a latency
model on a virtual clock); the engine appends tokens, finishes requests, registers full pages in the
prefix cache, accrues credit and refits the latency predictor.

    engine = LLMEngine(model, EngineConfig(num_blocks=512, shadow_mode="harvest-slo"))
    engine.add_request("r1", prompt, max_tokens=32, priority="routed", session_id="s1")
    engine.add_shadow("s2", history_of_s2, switch_prob=0.4)
    while engine.has_work():
        for out in engine.step(): ...

For a discrete-event simulator, `schedule_step()` runs the iteration and returns it with its
duration; the simulator moves the (shared, virtual) clock to its end and calls `complete_step(it)`.
`step()` is the two together, advancing the engine's own clock.
"""
from __future__ import annotations

import itertools
import math

from shadowprefill.engine.clock import Clock, VirtualClock, WallClock
from shadowprefill.engine.config import EngineConfig
from shadowprefill.engine.executor import Executor, ModelExecutor, SimulatedExecutor
from shadowprefill.engine.predictor import IterationPredictor, SimpleLatencyModel
from shadowprefill.engine.request import Priority, Request, RequestOutput, RequestStatus
from shadowprefill.engine.scheduler import ScheduledBatch, Scheduler
from shadowprefill.engine.stats import EngineStats
from shadowprefill.kv.block_pool import BlockPool
from shadowprefill.kv.host_tier import HostTier
from shadowprefill.kv.spec import KVCacheSpec
from shadowprefill.shadow.controller import ShadowController
from shadowprefill.shadow.jobs import ShadowJobQueue, check_token_ids


SHADOW_RETRY_S = 0.1   # seconds before an engine retries shadow work that could not run


class Iteration:
    """A scheduled and executed iteration awaiting `complete_step`."""

    __slots__ = ("batch", "tokens", "duration", "start")

    def __init__(self, batch: ScheduledBatch, tokens: list[int], duration: float, start: float) -> None:
        self.batch, self.tokens, self.duration, self.start = batch, tokens, duration, start


class LLMEngine:
    """A continuous-batching engine with shadow prefill.

    `model_or_executor`: a model with `forward(ForwardBatch, kv_cache)` and `kv_spec(block_size)` (a
    ModelExecutor is built over a freshly allocated KV cache on the model's device), or an `Executor`
    (e.g. `SimulatedExecutor(latency_model)`). `clock`: default WallClock for a model, VirtualClock for a
    SimulatedExecutor. `latency_model` seeds the predictor t̂ (default: the SimulatedExecutor's, else a
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
            model_config = getattr(model, "config", None)
            self.vocab_size = getattr(model_config, "vocab_size", None)
            self.max_position = getattr(model_config, "max_position", None)
            if latency_model is None and model_config is not None:
                latency_model = SimpleLatencyModel.for_model_config(model_config)
        else:
            raise TypeError("model_or_executor must be an Executor or a model with kv_spec()/forward(), got "
                            f"{type(model_or_executor).__name__}")
        if latency_model is None and isinstance(self.executor, SimulatedExecutor):
            latency_model = self.executor.latency_model
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
        self.pool = BlockPool(config.num_blocks, bs, kv_cache=kv_cache, host_tier=host_tier,
                              page_bytes=0 if kv_cache is not None else page_bytes,
                              shadow_fraction=config.shadow_fraction, cold_age_s=config.cold_age_s,
                              model_id=config.model_id)
        self.predictor = IterationPredictor(latency_model, forgetting=config.predictor_forgetting)
        self.jobs = ShadowJobQueue(bs, config.default_switch_prob)
        self.controller = ShadowController(config, self.predictor, self.jobs, self.pool)
        self.scheduler = Scheduler(config, self.pool, on_admit=self._on_admit)
        self._requests: dict[str, Request] = {}
        self._eager: dict[str, tuple[list[int], Request | None, str]] = {}   # session -> (history, request, tenant)
        self._seq = itertools.count()
        self._in_flight: Iteration | None = None
        self._shadow_retry_at = -math.inf          # shadow work that could not run is retried from then on
        self._stats = EngineStats()

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids, max_tokens: int, priority: str = "normal",
                    session_id: str | None = None, ttft_slo: float | None = None, tpot_slo: float | None = None,
                    tenant: str = "") -> Request:
        """Queue a call. `priority`: "routed" (an agent's routed call) or "normal" (other traffic).
        SLOs default to the paper's rule (§5.1). A routed call of a session drops that session's shadow
        job here: whatever the shadow computed is in the prefix cache, and the call prefills the rest."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
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
        ttft = float(ttft_slo) if ttft_slo is not None else self.controller.default_ttft_slo(len(prompt))
        tpot = float(tpot_slo) if tpot_slo is not None else self.controller.tpot_slo
        r = Request(request_id, prompt, max_tokens, prio, now, next(self._seq), session_id=session_id,
                    tenant=tenant, ttft_slo=ttft, tpot_slo=tpot)
        r.ttft_deadline = now + (1.0 - self.config.margin) * ttft
        if prio is Priority.ROUTED and session_id is not None:
            self.cancel_shadow(session_id)
        self._requests[request_id] = r
        self.scheduler.add(r)
        self._shadow_retry_at = -math.inf
        return r

    def abort_request(self, request_id: str) -> None:
        """Drop a queued or running request (its pages go back to the pool)."""
        r = self._requests.pop(request_id, None)
        if r is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        self.scheduler.abort(r, self.clock.now())
        r.finish_reason = "abort"

    # -------------------------------------------------------------------------------------- shadow
    def add_shadow(self, session_id: str, token_ids, switch_prob: float | None = None, tenant: str = "") -> None:
        """Make `token_ids` (the session's history) the shadow target of this engine (§3.1): an
        extension keeps progress, a rewrite keeps the longest common prefix. Ignored in mode "none";
        in mode "eager" it becomes a normal-priority prefill request."""
        mode = self.config.shadow_mode
        now = self.clock.now()
        if mode == "none":
            return
        if mode == "eager":
            tokens = check_token_ids("token_ids", token_ids)
            self._submit_eager(session_id, tokens, tenant, now)
            return
        self.jobs.upsert(session_id, token_ids, now=now, switch_prob=switch_prob, tenant=tenant)
        self._shadow_retry_at = -math.inf

    def extend_shadow(self, session_id: str, token_ids) -> None:
        """Append tokens (streamed output) to a session's shadow history; creates no job."""
        mode = self.config.shadow_mode
        if mode == "eager" and session_id in self._eager:
            history, req, tenant = self._eager[session_id]
            history.extend(check_token_ids("token_ids", token_ids))
        elif mode in ("harvest", "harvest-slo") and session_id in self.jobs:
            self.jobs.extend(session_id, token_ids, now=self.clock.now())
            self._shadow_retry_at = -math.inf

    def cancel_shadow(self, session_id: str) -> None:
        """Forget a session's shadow job (pages already computed stay cached)."""
        self.jobs.remove(session_id)
        entry = self._eager.pop(session_id, None)
        if entry is not None and entry[1] is not None and entry[1].status is RequestStatus.WAITING:
            self._requests.pop(entry[1].request_id, None)
            self.scheduler.abort(entry[1], self.clock.now())

    def _submit_eager(self, session_id: str, tokens: list[int], tenant: str, now: float) -> None:
        """Eager (Table 2): shadow work as an ordinary normal-priority request; a newer history replaces
        one still waiting."""
        old = self._eager.get(session_id)
        if old is not None and old[1] is not None and old[1].status is RequestStatus.WAITING:
            self._requests.pop(old[1].request_id, None)
            self.scheduler.abort(old[1], now)
        tokens = tokens[:self.config.num_blocks * self.config.block_size]   # what the pool can ever hold
        if self.max_position is not None:
            tokens = tokens[:self.max_position]
        if not tokens:
            return
        rid = f"__shadow__:{session_id}:{next(self._seq)}"
        r = Request(rid, tokens, 0, Priority.NORMAL, now, next(self._seq), session_id=session_id, tenant=tenant,
                    prefill_only=True, internal=True)
        self._requests[rid] = r
        self._eager[session_id] = (list(tokens), r, tenant)
        self.scheduler.add(r)

    # ---------------------------------------------------------------------------------------- step
    def has_work(self) -> bool:
        """Requests queued or running, or shadow work that can run now."""
        if self.scheduler.has_unfinished():
            return True
        return (self.config.shadow_enabled and self.clock.now() >= self._shadow_retry_at
                and self.jobs.has_runnable(self.config.n_min, self.config.shadow_min_switch_prob))

    def step(self) -> list[RequestOutput]:
        """Run one iteration on the engine's clock; outputs of requests that got a token or finished."""
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
        batch = self.scheduler.schedule(now)
        if self.config.shadow_enabled:
            batch.shadow_chunks = self.controller.plan(batch, now)
        if batch.is_empty:
            # only shadow work was left and none can run now: what blocks it (shadow KV not yet cold, no
            # slack, credit) changes with time, so offer it again after a short pause, or on new work
            self._shadow_retry_at = now + SHADOW_RETRY_S
            return None
        result = self.executor.execute(batch)
        self._in_flight = Iteration(batch, result.tokens, result.duration, now)
        return self._in_flight

    def complete_step(self, it: Iteration) -> list[RequestOutput]:
        """Apply an executed iteration at clock.now() (its end): tokens, finishes, cache, credit, t̂."""
        if it is not self._in_flight:
            raise ValueError("it is not the iteration in flight")
        self._in_flight = None
        now = self.clock.now()
        batch, duration = it.batch, it.duration
        features = batch.features() if self.config.refit_predictor else None   # before _update advances contexts
        outputs = self._update(batch, it.tokens, now)
        shadow_tokens = self.controller.complete(batch.shadow_chunks, now)
        self.controller.on_iteration_end(batch, duration)
        if features is not None:
            self.predictor.observe_features(features, duration)
        st = self._stats
        st.iterations += 1
        st.busy_time_s += duration
        st.shadow_tokens += shadow_tokens
        st.shadow_chunks += len(batch.shadow_chunks)
        if not batch.has_requests:
            st.shadow_only_iterations += 1
        return outputs

    def _update(self, batch: ScheduledBatch, tokens: list[int], now: float) -> list[RequestOutput]:
        """Append sampled tokens (decodes first, then finished prefills: the order of batch.samples),
        keep Eq. 1's deadline f_r + (1-m)·T_r·(k_r+1), finish requests, register filled pages."""
        st = self._stats
        running = RequestStatus.RUNNING
        step = 1.0 - self.config.margin
        bs = self.config.block_size
        eos = self.config.eos_token_id
        outputs: list[RequestOutput] = []
        emit = outputs.append
        finished = False
        decodes = batch.decodes
        num_decodes = len(decodes)
        st.decode_tokens += num_decodes
        for r, n in batch.prefills:
            if r.status is running:
                r.num_computed_tokens += n
                if r.internal:
                    st.eager_shadow_tokens += n
                elif r.priority is Priority.ROUTED:
                    st.prefill_tokens_routed += n
                else:
                    st.prefill_tokens_normal += n
        commit_full_pages = self.scheduler.commit_full_pages
        for i, r in enumerate(batch.samples):
            if r.status is not running:          # aborted while in flight
                continue
            tok = tokens[i]
            out = r.output_token_ids
            out.append(tok)
            r.all_token_ids.append(tok)
            if i < num_decodes:                  # a decode (it has its first token already)
                r.num_computed_tokens += 1
                r.num_decode_iters += 1
                r.tpot_deadline += step * r.tpot_slo               # Eq. 1: k_r -> k_r + 1
            elif r.first_token_time is None:
                r.first_token_time = now
                r.tpot_deadline = now + step * r.tpot_slo          # Eq. 1 with k_r = 0
            else:                                # a recomputed prefill (after preemption)
                r.num_decode_iters += 1
                r.tpot_deadline += step * r.tpot_slo
            num_out = len(out)
            if num_out >= r.max_tokens or tok == eos:
                self._finish(r, now, "stop" if tok == eos else "length")
                finished = True
                if not r.internal:
                    emit(RequestOutput(r, num_out, True))
                continue
            if r.num_computed_tokens // bs > r.num_committed_blocks:
                commit_full_pages(r, now)
            if not r.internal:
                emit(RequestOutput(r, num_out, False))
        for r, n in batch.prefills:
            if r.status is running:
                if r.num_computed_tokens == len(r.all_token_ids):    # prefill-only request done
                    self._finish(r, now, "prefilled")
                    finished = True
                elif r.num_computed_tokens // bs > r.num_committed_blocks:
                    self.scheduler.commit_full_pages(r, now)
        if finished:
            self.scheduler.remove_finished()
        return outputs

    def _finish(self, r: Request, now: float, reason: str) -> None:
        self.scheduler._free(r, now)
        r.status = RequestStatus.FINISHED
        r.finish_time = now
        r.finish_reason = reason
        self._requests.pop(r.request_id, None)
        if not r.internal:
            self._stats.requests_finished += 1

    def _on_admit(self, r: Request, match) -> None:
        if r.internal or r.num_preemptions:
            return
        st = self._stats
        st.prompt_tokens += r.num_prompt_tokens
        st.cached_prompt_tokens += r.num_cached_tokens
        st.host_cached_prompt_tokens += r.num_host_cached_tokens
        if r.priority is Priority.ROUTED:
            st.routed_prompt_tokens += r.num_prompt_tokens
            st.routed_cached_prompt_tokens += r.num_cached_tokens
            st.routed_shadow_hit_tokens += min(match.shadow_tokens, r.num_cached_tokens)

    # ------------------------------------------------------------------------------------- queries
    @property
    def stats(self) -> EngineStats:
        st = self._stats
        st.budget_branches = dict(self.controller.branch_counts)
        st.credit = self.controller.credit
        st.credit_earned_s = self.controller.credit_earned
        st.credit_spent_s = self.controller.credit_spent
        st.preemptions = self.scheduler.num_preemptions
        return st

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def queued_prefill_tokens(self) -> int:
        """Tokens still to prefill over waiting and prefilling requests (the queue part of a router's
        prefill-completion estimate)."""
        total = sum(r.num_remaining for q in self.scheduler.waiting.values() for r in q)
        return total + sum(r.num_remaining for r in self.scheduler.running if r.num_remaining > 1)

    def cached_prefix_tokens(self, token_ids, tenant: str = "", hashes=None) -> tuple[int, int]:
        """(device, host) tokens of token_ids' longest cached prefix, without touching the cache. hashes: a
        `page_hash_chain(token_ids, tenant)` kept by the caller across calls (e.g. per session and model), so a
        long history is not re-hashed on every routing decision."""
        return self.pool.peek_prefix(token_ids, tenant=tenant, hashes=hashes)

    def page_hash_chain(self, token_ids, tenant: str = ""):
        """A kv.PageHashes of an append-only token list for this engine's model and `tenant` (valid on every
        engine of the same model id and block size)."""
        return self.pool.page_hash_chain(token_ids, tenant=tenant)
