"""Continuous-batching scheduler: builds each iteration and owns every request's lifecycle (DESIGN.md §5).

`schedule(now)` builds one iteration under `token_budget` new tokens and `max_seqs` sequences: (1) every
running decode, (2) in-flight prefill chunks, (3) admissions from the waiting queue. Admission order
(`EngineConfig.admission`): "fcfs" takes routed calls and normal traffic from one queue by arrival, as the
paper's vLLM engines do; "routed-first" admits waiting routed calls before normal traffic. Running requests
are kept in admission rank order, so when the KV pool runs out the victim is the last of them (recompute
preemption; the newest first, and under routed-first normal traffic before routed calls). Under
routed-first a waiting routed call may also preempt running normal requests to get memory; otherwise an
admission never preempts. Shadow work is the queue's lowest class (`waiting[Priority.SHADOW]`, one
`engine.shadow_work.ShadowRequest` per session whose prompt grows): the last phase of `schedule` admits
chunks of those requests as prefill entries, only within the controller's budget (Alg. 1 line 1: only if
nothing waits and no admission was blocked). A shadow request holds pages only while its chunk is in
flight (after it they are evict-first cache entries), so it can never be the reason anyone waits or is
preempted.

Reload-ahead (issue 15): once an iteration is built, `prefetch(now, batch)` matches the prefix of the
waiting requests the next iteration will admit, so that the part of it on the host tier starts its
layer-wise reload during this iteration; the request holds those pages until it is admitted (a running
request short of memory, or a blocked admission, releases them first).

`postprocess(batch, tokens, now)` applies an executed iteration: appends sampled tokens, records first-token
times and decode iterations (the controller's Eq. 1 reads them), finishes requests, registers filled pages
in the prefix cache and frees finished requests' pages.
"""
from __future__ import annotations

import bisect
import itertools
from shadowprefill.engine import shadow_work
import operator
from shadowprefill.engine.decode_batch import BATCH_FROM, DecodeSet
from shadowprefill.engine.request import Priority, Request, RequestOutput, RequestStatus
from shadowprefill.engine.shadow_work import ShadowQueue, ShadowWork
from shadowprefill.kv.manager import PrefixMatch
from shadowprefill.shadow.view import IterationView, prefill_pairs

ADMISSIONS = ("fcfs", "routed-first")


def _rank_routed_first(r: Request) -> tuple[int, int]:
    return (r.priority, r.arrival_seq)


def _rank_fcfs(r: Request) -> int:
    return r.arrival_seq


_priority = operator.attrgetter("priority")
_num_tokens = operator.attrgetter("num_tokens")
# (module names for the members read every iteration: an enum member read through its class is a slow lookup)
_ROUTED, _RUNNING = Priority.ROUTED, RequestStatus.RUNNING


class ScheduledBatch:
    """One iteration's work: decodes and prefill chunks; the last `num_shadow` prefill chunks are shadow
    requests' (added by the shadow phase, within the controller's budget). `samples` lists, in forward-batch
    order, the requests that sample a token this iteration. `num_tokens` counts routed/normal tokens."""

    __slots__ = ("now", "decodes", "prefills", "num_shadow", "samples", "waiting_nonempty",
                 "admission_blocked", "has_routed", "num_tokens", "preempted", "reload_tokens", "ahead_tokens",
                 "prefetched_tokens", "budget_s", "_shape", "_contexts")

    def __init__(self, now: float) -> None:
        self.now = now
        self.decodes: list[Request] = []
        self.prefills: list[tuple[Request, int]] = []    # (request, new tokens this iteration), shadow last
        self.num_shadow = 0                               # shadow requests' chunks at the end of prefills
        self.samples: list[Request] = []
        self.waiting_nonempty = False
        self.admission_blocked = False
        self.has_routed = False
        self.num_tokens = 0
        self.preempted: list[Request] = []
        self.reload_tokens = 0                            # prefix tokens reloaded from the host tier for it
        self.ahead_tokens = 0                             # ... for the next iteration's admissions (prefetch)
        self.prefetched_tokens = 0                        # its admissions' tokens reloaded ahead (last iteration)
        self.budget_s = 0.0                               # b, when shadow chunks joined under a whole-iteration
        self._shape = None                                # budget (not the credit branch); else 0
        self._contexts = None

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prefills)

    @property
    def request_prefills(self) -> list[tuple[Request, int]]:
        """The routed/normal prefill chunks (B's)."""
        return self.prefills[:len(self.prefills) - self.num_shadow] if self.num_shadow else self.prefills

    @property
    def shadow_prefills(self) -> list[tuple[Request, int]]:
        """The shadow requests' chunks (a new list)."""
        return self.prefills[len(self.prefills) - self.num_shadow:] if self.num_shadow else []

    @property
    def has_requests(self) -> bool:
        """B ≠ ∅ in Algorithm 1: the batch carries routed or normal work."""
        return bool(self.decodes) or len(self.prefills) > self.num_shadow

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)

    @property
    def is_decode_only(self) -> bool:
        return bool(self.decodes) and not self.prefills

    def view(self, free_shadow_tokens) -> IterationView:
        """The controller's read-only view of the routed/normal part (B: shadow chunks left out)."""
        prefills = self.request_prefills
        return IterationView(self.now, self.decodes, prefills, self.has_routed, self.waiting_nonempty,
                             self.admission_blocked, self.num_tokens, len(self.decodes) + len(prefills),
                             free_shadow_tokens, self.decode_contexts())

    def decode_contexts(self) -> list[int]:
        """Each decode's context (shadow.view.decode_contexts), computed once per iteration: the decodes do not
        change once the requests are scheduled (call it before postprocess). A decode's one uncomputed token
        is its last, so its context (computed + 1) is its num_tokens: read in one C-level pass."""
        if self._contexts is None:
            self._contexts = list(map(_num_tokens, self.decodes))
        return self._contexts

    def shape(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(prefill chunks as (new tokens, cached before), shadow chunks last; decode contexts): the latency
        model's and the predictor's input, fixed once read (call it before postprocess)."""
        if self._shape is None:
            self._shape = (prefill_pairs(self.prefills), self.decode_contexts())
        return self._shape


class Scheduler:
    """Waiting queues by class (routed, normal, shadow: `waiting[Priority.SHADOW]` is the shadow requests'
    `ShadowQueue`), the running set, the KV calls of admission / growth, request lifecycles, and the shadow
    targets (`self.shadow`, engine.shadow_work.ShadowWork; with a `controller`,
    shadow.controller.ShadowController, whose budget is the last phase of `schedule`). `overlap`: the
    latency model's `overlapped_time` (host-tier reloads beside compute); `max_len`: the longest request
    (Eager's shadow requests are cut to it). `stats` (engine.stats.EngineStats) is written here only."""

    def __init__(self, config, kv, stats, *, controller=None, overlap=None, max_len: int | None = None) -> None:
        self.config = config
        self.kv = kv
        self.stats = stats                            # engine.stats.EngineStats: every counter
        self.controller = controller
        self.overlap = overlap
        shadow_queue = ShadowQueue(config.block_size, config.default_switch_prob, config.lost_shadow)
        self.shadow = None if controller is None else ShadowWork(self, controller, shadow_queue, max_len=max_len)
        self._runs_jobs = controller is not None and controller.policy.runs_jobs
        self._seq = itertools.count()
        self.block_size = config.block_size
        self.fcfs = config.admission == "fcfs"
        self._rank = _rank_fcfs if self.fcfs else _rank_routed_first
        self.requests: dict[str, Request] = {}       # every unfinished request by id
        self.waiting: dict = {Priority.ROUTED: [], Priority.NORMAL: [],       # lists, by arrival
                              Priority.SHADOW: shadow_queue}                  # by switch probability
        # the same lists (never replaced), as the steps read them every iteration: both, and admission's order
        routed_queue, normal_queue = self.waiting[Priority.ROUTED], self.waiting[Priority.NORMAL]
        self._user_queues = (routed_queue, normal_queue)
        self._admission_queues = (routed_queue,) if self.fcfs else (routed_queue, normal_queue)
        self.running: list[Request] = []             # sorted by self._rank
        self.decoding = DecodeSet(self._rank, config.block_size, Priority.ROUTED)   # steady decodes (decode_batch)
        self.num_preemptions = 0
        self._stamp = 0
        self._to_cache: list[Request] = []           # postprocess: requests whose filled pages register at its end
        self.batch_from = BATCH_FROM                 # from this many requests, one KV call for all (decode_batch)
        self.prefetched: list[Request] = []          # waiting requests holding a reload-ahead (r.prefetch)

    # ------------------------------------------------------------------------------------------ queues
    def _queue(self, r: Request) -> list[Request]:
        return self.waiting[Priority.ROUTED if self.fcfs else r.priority]

    def next_seq(self) -> int:
        """The next arrival number (requests are ranked by it)."""
        return next(self._seq)

    def add(self, request: Request) -> None:
        """Take a new request (its id must not be in use)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already queued or running")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Queue a new or preempted request (in arrival order within its queue)."""
        request.status = RequestStatus.WAITING
        request.prefetch = None
        bisect.insort(self._queue(request), request, key=lambda r: r.arrival_seq)

    def num_waiting(self) -> int:
        """Routed and normal requests waiting (the shadow class not counted)."""
        return len(self.waiting[Priority.ROUTED]) + len(self.waiting[Priority.NORMAL])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request: Request, now: float) -> None:
        """Drop a request wherever it is; its pages go back to the pool."""
        if request.status is RequestStatus.WAITING:
            self._queue(request).remove(request)
            self._drop_prefetch(request, now)
        elif request.status is RequestStatus.RUNNING:
            self._free(request, now)
            self.running.remove(request)
            self.decoding.leave(request)
        request.status = RequestStatus.FINISHED
        request.slo.finish_reason = request.slo.finish_reason or "abort"
        self.requests.pop(request.request_id, None)

    # ---------------------------------------------------------------------------------------- schedule
    def schedule(self, now: float) -> ScheduledBatch:
        """Build one iteration at `now`: (1) running decodes, (2) in-flight prefill chunks, (3) admissions,
        then, last, (4) the shadow phase (Algorithm 1: the controller's budget, spent on shadow jobs) and
        the iteration's host-tier reloads (its own, then the next admissions' ahead). An empty batch means
        nothing can run now."""
        self.kv.poll(now)                             # retire completed side-stream copies
        batch = self._schedule_requests(now)
        if self._runs_jobs:
            self._shadow_phase(batch, now)            # Alg. 1: the controller's budget, spent on shadow requests
        if not batch.is_empty:
            kv = self.kv
            kv.start_reloads()                        # this iteration's layer-wise reloads, then those of
            if self.prefetch(now, batch):             # the next iteration's admissions behind them (issue 15)
                kv.start_reloads()
        return batch

    def _shadow_phase(self, batch: ScheduledBatch, now: float) -> None:
        """The last phase: Alg. 1 lines 1-12 (controller.plan) on the routed/normal part of `batch`, then
        line 15 on the shadow class of the queue: the chunks admitted join the batch as prefill entries."""
        queue = self.waiting[Priority.SHADOW]
        if not len(queue):                            # nothing to place: only the branch is counted
            self.controller.count_idle_plan(batch.waiting_nonempty, batch.admission_blocked, batch.has_requests,
                                            batch.has_routed)
            return
        budget = self.controller.plan(batch.view(lambda limit: self.free_shadow_tokens(limit, now)))
        admitted = shadow_work.take(queue, budget, self.kv, now, overlap=self.overlap)
        if not admitted and self.controller.probe_due(budget):      # liveness: b admits nothing on an idle
            admitted = shadow_work.take(queue, budget, self.kv, now, overlap=self.overlap, probe=True)
        if admitted:
            batch.prefills.extend(admitted)
            batch.num_shadow += len(admitted)
            batch.reload_tokens += sum(r.chunk_reload_tokens for r, _ in admitted)
            # b bounds the whole iteration (credit: only the added time; a liveness probe: nothing)
            if budget.branch != "credit" and not budget.probe:
                batch.budget_s = budget.seconds

    def free_shadow_tokens(self, limit: int, now: float) -> int:
        """Line 11: tokens of KV a shadow chunk may take now (free or cold pages in the cap), at most limit."""
        bs = self.block_size
        return self.kv.free_blocks(now=now, shadow=True, limit=limit // bs) * bs

    def _schedule_requests(self, now: float) -> ScheduledBatch:
        cfg, bs = self.config, self.block_size
        batch = ScheduledBatch(now)
        limit, max_seqs = cfg.token_budget, cfg.max_seqs
        self._stamp += 1
        stamp = self._stamp
        routed = _ROUTED
        decodes = batch.decodes

        # (1) running decodes, in rank order: every steady decode (engine.decode_batch keeps them), each due
        # a page getting it; a preemption there takes its victim back out of the batch. Only when they
        # exceed the cap, the per-request scan (_scan_decodes).
        cap = limit if limit < max_seqs else max_seqs
        others = self.decoding.take(self, batch, cap, now, _RUNNING)
        if others is None:
            others = self._scan_decodes(batch, cap, now)
            batch.has_routed = routed in map(_priority, decodes)
        else:                                    # (a preemption in take is rechecked below)
            batch.has_routed = self.decoding.num_routed > 0
        batch.num_tokens = len(decodes)

        # (2) in-flight prefill chunks (prompt chunks, or recompute after preemption). If (1) stopped
        # early, the token budget or max_seqs is used up and nothing more is scheduled anyway.
        num_seqs = len(decodes)
        for r in others:
            if batch.num_tokens >= limit or num_seqs >= max_seqs:
                break
            if r.status is not _RUNNING:            # preempted by an earlier chunk of this pass
                continue
            n = min(r.num_remaining, limit - batch.num_tokens)
            if r.num_computed_tokens + n > len(r.block_ids) * bs and not self._grow(r, n, now, batch):
                continue                             # (its pages hold the chunk unless it needs more)
            batch.prefills.append((r, n))
            r.sched_stamp = stamp
            batch.num_tokens += n
            num_seqs = batch.num_seqs

        # (3) admissions: one FCFS queue, or routed before normal (each by arrival).
        for queue in self._admission_queues:
            while (queue and batch.num_tokens < limit and len(self.running) < max_seqs
                   and batch.num_seqs < max_seqs):
                r = queue[0]
                n = self._admit(r, limit - batch.num_tokens, now, batch)
                if n == 0:
                    batch.admission_blocked = True   # by memory: reloads ahead give their pages back
                    self._release_prefetches(now)
                    break
                queue.pop(0)
                r.status = _RUNNING
                bisect.insort(self.running, r, key=self._rank)
                batch.prefills.append((r, n))
                r.sched_stamp = stamp
                batch.num_tokens += n
            if batch.admission_blocked:
                break

        routed_queue, normal_queue = self._user_queues
        batch.waiting_nonempty = bool(routed_queue or normal_queue)
        if batch.preempted:                      # a later preemption may have taken a routed decode out
            batch.has_routed = routed in map(_priority, decodes)
        samples = batch.samples
        samples.extend(decodes)
        for r, n in batch.prefills:
            if r.priority is routed:
                batch.has_routed = True
            r.samples_now = n == r.num_remaining and not r.prefill_only
            if r.samples_now:
                samples.append(r)
        return batch

    def _scan_decodes(self, batch: ScheduledBatch, cap: int, now: float) -> list[Request]:
        """Step (1) per request: the running requests in rank order until `cap` decodes, growing pages as
        needed (a preemption in _grow takes its victim back out of the batch). Returns the running requests
        with a prefill chunk to do that it passed."""
        bs, running, decodes = self.block_size, self.running, batch.decodes
        others: list[Request] = []
        n_running = len(running)
        i = nd = 0
        while i < n_running and nd < cap:
            r = running[i]
            i += 1
            computed = r.num_computed_tokens
            if r.num_tokens - computed != 1 or r.first_token_time is None:
                others.append(r)
                continue
            if computed % bs == 0 and computed // bs >= len(r.block_ids):   # (a partly filled page has room)
                batch.num_tokens = nd
                grown = self._grow(r, 1, now, batch)
                nd, n_running = len(decodes), len(running)
                if not grown:
                    i -= 1                           # r itself was preempted (it was last)
                    continue
            decodes.append(r)
            nd += 1
        return others

    # ------------------------------------------------------------------------------------------- memory
    def _admit(self, r: Request, budget: int, now: float, batch: ScheduledBatch) -> int:
        """Match r's prefix, allocate pages for its first chunk; return the chunk size (0 = blocked)."""
        bs, kv = self.block_size, self.kv
        routed = r.priority is Priority.ROUTED
        # Leave at least one token to compute: its logits give the next token.
        total = r.num_tokens
        match = kv.get_computed_blocks(r, now=now, max_tokens=total - 1, promote=routed)
        reload, ahead = match.host_tokens, r.prefetch
        if ahead:       # reloaded ahead: those pages are on the device now, held by `match` too
            self._drop_prefetch(r, now)
            batch.prefetched_tokens += ahead.host_tokens
            shadow = (ahead.shadow_tokens + match.shadow_tokens if routed     # promoted by the prefetch
                      else max(ahead.shadow_tokens, match.shadow_tokens))
            host = min(ahead.host_tokens + reload, match.num_tokens)          # (for the request's stats)
            match = PrefixMatch(match.block_ids, match.num_tokens, match.num_tokens - host, host,
                                min(shadow, match.num_tokens), match.ready_event)
        cached = match.num_tokens
        n = min(total - cached, budget)
        new_blocks = kv.allocate_slots(r, n, now=now, num_computed_tokens=cached)
        while new_blocks is None and routed and not self.fcfs:     # routed-first: routed may preempt normal
            victim = self._last_normal_running()
            if victim is None:
                break
            if not self._release_prefetches(now):
                self._preempt(victim, now, batch)
            new_blocks = kv.allocate_slots(r, n, now=now, num_computed_tokens=cached)
        if new_blocks is None:
            kv.free(r, now=now)                                     # its prefix pages (they stay cached)
            return 0
        r.block_ids = kv.block_table(r)                             # the manager's list (read-only here)
        r.num_computed_tokens = cached
        r.num_committed_blocks = cached // bs
        r.check_at = 0
        r.ready_event = match.ready_event
        batch.reload_tokens += reload
        if not r.admitted:
            r.admitted = True
            slo = r.slo                                             # its SLO accounting: what admission found
            slo.num_cached_tokens = min(cached, r.num_prompt_tokens)
            slo.num_host_cached_tokens = min(match.host_tokens, slo.num_cached_tokens)
        if not (r.internal or r.num_preemptions):
            self._count_admission(r, match)
        return n

    def _count_admission(self, r: Request, match) -> None:
        st, slo = self.stats, r.slo
        st.prompt_tokens += r.num_prompt_tokens
        st.cached_prompt_tokens += slo.num_cached_tokens
        st.host_cached_prompt_tokens += slo.num_host_cached_tokens
        if r.priority is Priority.ROUTED:
            st.routed_prompt_tokens += r.num_prompt_tokens
            st.routed_cached_prompt_tokens += slo.num_cached_tokens
            st.routed_shadow_hit_tokens += min(match.shadow_tokens, slo.num_cached_tokens)

    def _last_normal_running(self) -> Request | None:
        last = self.running[-1] if self.running else None
        return last if last is not None and last.priority is not Priority.ROUTED else None

    def _grow(self, r: Request, num_new_tokens: int, now: float, batch: ScheduledBatch, failed: bool = False) -> bool:
        """Give running request r the pages for `num_new_tokens` more tokens, preempting the lowest-ranked
        running requests (possibly r itself) until they fit. False if r was preempted. `failed`: the pool
        just refused r (a batched allocate_slots_many), so the first try is skipped."""
        while True:
            if failed:
                failed = False
            elif self.kv.allocate_slots(r, num_new_tokens, now=now) is not None:
                return True
            if self._release_prefetches(now):    # a reload ahead never costs a running request its pages
                continue
            victim = self.running[-1]            # lowest rank: the newest (routed-first: normal first)
            self._preempt(victim, now, batch)
            if victim is r:
                return False

    def _preempt(self, victim: Request, now: float, batch: ScheduledBatch) -> None:
        """Recompute-preemption: keep its computed full pages in the prefix cache, free the rest."""
        if victim in batch.decodes:              # already in this iteration: take it back out
            batch.decodes.remove(victim)         # (a scan, on this rare path, instead of a stamp per decode)
            batch.num_tokens -= 1
        elif victim.sched_stamp == self._stamp:
            victim.sched_stamp = -1
            batch.num_tokens -= sum(n for q, n in batch.prefills if q is victim)
            batch.prefills = [(q, n) for q, n in batch.prefills if q is not victim]
        self._free(victim, now)
        self.running.remove(victim)
        self.decoding.leave(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self._enqueue(victim)

    def _free(self, r: Request, now: float) -> None:
        if self._to_cache:                       # (inside postprocess: the KV calls keep their order)
            self._cache_pending(now)
        self._commit_full_pages(r, now)
        self.kv.free(r, now=now)
        r.block_ids = []
        r.num_committed_blocks = 0
        r.check_at = 0                           # (a decode aborted in flight: postprocess looks at it)
        r.ready_event = None

    def _commit_full_pages(self, r: Request, now: float, later: list | None = None) -> None:
        """Register r's newly filled pages in the prefix cache (`later`: r joins that list instead, and
        _cache_pending registers the list's requests in one call)."""
        computed = r.num_computed_tokens
        full = computed // self.block_size
        if full > r.num_committed_blocks:   # (commit registers min(pages, computed // bs) pages: no list copies)
            if later is None:
                self.kv.cache(r, now=now, num_tokens=computed)
            else:
                later.append(r)
            r.num_committed_blocks = full
            r.check_at = 0

    def _cache_pending(self, now: float) -> None:
        """Register the pages postprocess set aside (_to_cache), in the order they filled: one KV call for
        many, one call each for a few."""
        pending, kv = self._to_cache, self.kv
        if len(pending) < self.batch_from:
            for r in pending:
                kv.cache(r, now=now, num_tokens=r.num_computed_tokens)
        else:
            kv.cache_many(pending, now=now)
        pending.clear()                          # (in place: postprocess holds the list)

    # ------------------------------------------------------------------------------------- reload-ahead
    def prefetch(self, now: float, batch: ScheduledBatch) -> int:
        """Reload-ahead (issue 15): for the waiting requests the next iteration will admit (admission order,
        while its token budget and seats last after the running requests' next tokens), match the prefix of
        each that has host-tier pages, so their layer-wise reload runs during this iteration (issued after
        this iteration's own reloads). Each request is looked at once per stay in the queue. Returns the
        host tokens whose reload starts (batch.ahead_tokens)."""
        kv = self.kv
        if not batch.waiting_nonempty or not kv.has_host_tier or batch.admission_blocked:
            return 0
        # the running requests' tokens next iteration: a decode each, the rest of each prefill (a decode
        # once it samples), at least one for each not scheduled now
        prefills = batch.request_prefills
        room = self.config.token_budget - len(self.running) + len(prefills)
        for r, n in prefills:
            room -= max(r.num_remaining - n, 1)
        seats = self.config.max_seqs - len(self.running)
        for queue in self._admission_queues:
            for r in queue:
                if room <= 0 or seats <= 0:
                    return batch.ahead_tokens
                seats -= 1
                tokens = r.all_token_ids
                cached = 0
                if r.prefetch is None:
                    r.prefetch = False
                    limit = len(tokens) - 1
                    dev, host = kv.peek_prefix(tokens, tenant=r.tenant, max_tokens=limit)
                    cached = dev
                    if host:
                        m = kv.match_prefix(tokens, now=now, tenant=r.tenant, promote=r.priority is Priority.ROUTED,
                                            max_tokens=limit)
                        cached = m.num_tokens
                        if m.host_tokens:
                            r.prefetch = m
                            self.prefetched.append(r)
                            batch.ahead_tokens += m.host_tokens
                        else:
                            kv.free(m.block_ids, now=now)
                elif r.prefetch:
                    cached = r.prefetch.num_tokens
                room -= len(tokens) - cached
        return batch.ahead_tokens

    def _drop_prefetch(self, r: Request, now: float) -> None:
        if r.prefetch:
            self.kv.free(r.prefetch.block_ids, now=now)
            self.prefetched.remove(r)
        r.prefetch = False

    def _release_prefetches(self, now: float) -> bool:
        """Give back every reload-ahead's pages (they stay cached, evictable); whether there were any."""
        if not self.prefetched:
            return False
        for r in list(self.prefetched):
            self._drop_prefetch(r, now)
        return True

    # ------------------------------------------------------------------------------------- postprocess
    def _finish_if_done(self, r: Request, t: int, now: float, eos, emit) -> bool:
        """Finish r if its `t` tokens reach max_tokens or end in EOS (its final output emitted unless the
        request is the engine's own); whether it finished."""
        num_out = t - r.num_prompt_tokens
        stop = eos is not None and r.token_at(t - 1) == eos
        if num_out < r.max_tokens and not stop:
            return False
        self._finish(r, now, "stop" if stop else "length")
        if not r.internal:
            emit(RequestOutput(r, num_out, True))
        return True

    def postprocess(self, batch: ScheduledBatch, tokens: list[int] | None, now: float,
                    duration: float = 0.0) -> list[RequestOutput]:
        """Apply an executed iteration of `duration` seconds at `now` (its end): add the sampled tokens
        (decodes first, then sampling prefills: the order of batch.samples), record f_r and k_r (Eq. 1),
        finish requests, register filled pages, then the shadow side: register the shadow chunks' pages,
        accrue credit, refit t̂, count. `tokens` None (a simulated executor): every sample's token is its
        request's next known one (its OutputReplay: the replayed output, then fill_token), counted, not appended. Returns a
        RequestOutput per streaming user request that got a token, and per user request that finished."""
        # t̂ models compute: an iteration that waited on host-tier copies is not observed (its time is not
        # a function of the batch's features); the shape is taken before the contexts advance
        ctl = self.controller
        shape = (batch.shape() if ctl is not None and self.config.refit_predictor and not batch.reload_tokens
                 and not batch.prefetched_tokens else None)
        outputs = self._apply_tokens(batch, tokens, now)    # (shadow requests stay WAITING: skipped there)
        shadow_tokens = (shadow_work.complete(self.waiting[Priority.SHADOW], batch.shadow_prefills, self.kv, now)
                         if batch.num_shadow else 0)
        if ctl is not None:
            ctl.end_iteration(duration, busy=batch.has_requests, decode_only=batch.is_decode_only)
            if shape is not None:
                ctl.predictor.observe(*shape, duration)
        st = self.stats
        st.iterations += 1
        st.busy_time_s += duration
        st.shadow_tokens += shadow_tokens
        st.shadow_chunks += batch.num_shadow
        if not batch.has_requests:
            st.shadow_only_iterations += 1
        if batch.budget_s > 0.0:                       # did the iteration stay within b (line 10)?
            st.shadow_budget_iterations += 1
            ratio = duration / batch.budget_s
            st.shadow_over_budget += ratio > 1.0
            st.shadow_budget_ratio_max = max(st.shadow_budget_ratio_max, ratio)
        return outputs

    def read_stats(self):
        """The stats with the controller's and the scheduler's running totals filled in."""
        st, ctl = self.stats, self.controller
        if ctl is not None:
            st.budget_branches = dict(ctl.branch_counts)
            st.shadow_probes = ctl.probes
            st.credit, st.credit_earned_s, st.credit_spent_s = ctl.credit, ctl.credit_earned, ctl.credit_spent
        st.preemptions = self.num_preemptions
        return st

    def _apply_tokens(self, batch: ScheduledBatch, tokens: list[int] | None, now: float) -> list[RequestOutput]:
        st = self.stats
        running = _RUNNING
        bs = self.block_size
        eos = self.config.eos_token_id
        outputs: list[RequestOutput] = []
        emit = outputs.append
        finished = False
        decoding = self.decoding
        decodes = batch.decodes
        num_decodes = len(decodes)
        # many decodes (about one fills a page per block_size): the filled pages register in one call at the
        # end (_free registers them first if a request finishes meanwhile); a few: each at once
        to_cache = self._to_cache if num_decodes >= self.batch_from * bs else None
        st.decode_tokens += num_decodes
        for r, n in batch.prefills:
            if r.status is running:
                r.num_computed_tokens += n
                if r.internal:
                    st.eager_shadow_tokens += n
                elif r.priority is _ROUTED:
                    st.prefill_tokens_routed += n
                else:
                    st.prefill_tokens_normal += n
        if tokens is not None:                   # sampled tokens: store each; the loops below count them
            for r, tok in zip(batch.samples, tokens):
                if r.status is running:
                    r.put_token(tok)
        # decodes: one more token each (the hot loop). Below `check_at` tokens a decode is only counted; at it
        # (a full page to register, its last token) it needs more. check_at is 0 where every token needs more:
        # a request that streams (an output per token), an EOS to look for, an abort while in flight (_free).
        for r in decodes:
            c = r.num_tokens                     # its computed tokens after this step (the int object reused)
            t = c + 1
            if t < r.check_at:
                r.num_tokens = t
                r.num_computed_tokens = c
                r.num_decode_iters += 1
                continue
            if r.status is not running:          # aborted while in flight
                continue
            r.num_tokens = t
            r.num_computed_tokens = c
            r.num_decode_iters += 1
            stop_at = r.num_prompt_tokens + r.max_tokens
            if (t >= stop_at or eos is not None) and self._finish_if_done(r, t, now, eos, emit):
                finished = True
                continue
            if c // bs > r.num_committed_blocks:
                self._commit_full_pages(r, now, to_cache)
            decoding.stepped(r)                  # (every page boundary passes here) due a page?
            if r.stream:
                emit(RequestOutput(r, t - r.num_prompt_tokens, False))
                r.check_at = 0
            elif eos is not None:
                r.check_at = 0
            else:
                page_at = (r.num_committed_blocks + 1) * bs + 1     # computed = t - 1 fills the next page
                r.check_at = stop_at if stop_at < page_at else page_at
        # prefill chunks that sampled their request's next token (its first, or one after a recompute)
        samples = batch.samples
        for i in range(num_decodes, len(samples)):
            r = samples[i]
            if r.status is not running:
                continue
            r.num_tokens += 1
            if r.first_token_time is None:
                r.first_token_time = now
            else:                                # a recomputed prefill (after preemption)
                r.num_decode_iters += 1
            t = r.num_tokens
            if self._finish_if_done(r, t, now, eos, emit):
                finished = True
                continue
            if r.num_computed_tokens // bs > r.num_committed_blocks:
                self._commit_full_pages(r, now, to_cache)
            decoding.join(r)                     # a steady decode from the next iteration on
            if r.stream:
                emit(RequestOutput(r, t - r.num_prompt_tokens, False))
        for r, n in batch.prefills:
            if r.status is running:
                if r.num_computed_tokens == r.num_tokens:    # prefill-only request done
                    self._finish(r, now, "prefilled")
                    finished = True
                elif r.num_computed_tokens // bs > r.num_committed_blocks:
                    self._commit_full_pages(r, now, to_cache)
        if to_cache:
            self._cache_pending(now)
        if finished:
            self.running = [r for r in self.running if r.status is running]
            decoding.keep_running(running)
        return outputs

    def _finish(self, r: Request, now: float, reason: str) -> None:
        self._free(r, now)
        r.status = RequestStatus.FINISHED
        r.slo.finish_time = now
        r.slo.finish_reason = reason
        self.requests.pop(r.request_id, None)
        if not r.internal:
            self.stats.requests_finished += 1
