"""Continuous-batching scheduler (DESIGN.md §5, paper §3.2 "Where shadow work runs").

One `schedule(now)` builds one iteration, in priority order and under `token_budget` new tokens and
`max_seqs` sequences: (1) every running decode, (2) in-flight prefill chunks, (3) admissions from the
waiting queue, routed calls before normal traffic, then by arrival. Running requests are kept sorted by
(priority, arrival), so when the KV pool runs out the victim is the last of them: normal traffic is
preempted before routed calls, newest first, and recomputed later from whatever of its prefix is still
cached. A waiting routed call may preempt running normal requests to get memory; a normal admission
never preempts. Shadow work holds no pages between iterations (its pages are evict-first cache
entries), so it can never be the reason anyone is preempted; the controller adds shadow chunks to the
batch after this, and only if nothing waits and no admission was blocked (Alg. 1 line 1).
"""
from __future__ import annotations

import bisect
import operator
from typing import Callable

from shadowprefill.engine.request import Priority, Request, RequestStatus

_computed = operator.attrgetter("num_computed_tokens")


def _rank(r: Request) -> tuple[int, int]:
    return (r.priority, r.arrival_seq)


class ScheduledBatch:
    """One iteration's work: decodes, prefill chunks (and, added by the controller, shadow chunks).

    `samples` lists, in forward-batch order, the requests that sample a token this iteration.
    """

    __slots__ = ("now", "decodes", "prefills", "shadow_chunks", "samples", "waiting_nonempty",
                 "admission_blocked", "has_routed", "num_tokens", "preempted", "reload_tokens")

    def __init__(self, now: float) -> None:
        self.now = now
        self.decodes: list[Request] = []
        self.prefills: list[tuple[Request, int]] = []    # (request, new tokens this iteration)
        self.shadow_chunks: list = []                     # ShadowChunk, filled by the controller
        self.samples: list[Request] = []
        self.waiting_nonempty = False
        self.admission_blocked = False
        self.has_routed = False
        self.num_tokens = 0
        self.preempted: list[Request] = []
        self.reload_tokens = 0                            # tokens reloaded from the host tier for it

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prefills) + len(self.shadow_chunks)

    @property
    def has_requests(self) -> bool:
        """B ≠ ∅ in Algorithm 1: the batch carries routed or normal work."""
        return bool(self.decodes or self.prefills)

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills or self.shadow_chunks)

    @property
    def is_decode_only(self) -> bool:
        return bool(self.decodes) and not self.prefills and not self.shadow_chunks

    def prefill_list(self, include_shadow: bool = True) -> list[tuple[int, int]]:
        """Prefill chunks as (new_tokens, cached_before), shadow chunks last."""
        out = [(n, r.num_computed_tokens) for r, n in self.prefills]
        if include_shadow:
            out.extend((c.num_new, c.start) for c in self.shadow_chunks)
        return out

    def decode_contexts(self) -> list[int]:
        """Context length of every decode (tokens attended, the new one included)."""
        return [c + 1 for c in map(_computed, self.decodes)]

    def features(self, include_shadow: bool = True) -> tuple:
        """(P, Σ n·(c+n), D, Σ ctx): the predictor's features of this batch."""
        p = pc = 0
        for r, n in self.prefills:
            p += n
            pc += n * (r.num_computed_tokens + n)
        if include_shadow:
            for c in self.shadow_chunks:
                p += c.num_new
                pc += c.num_new * (c.start + c.num_new)
        decodes = self.decodes
        return (p, pc, len(decodes), len(decodes) + sum(map(_computed, decodes)))


class Scheduler:
    """Waiting queues (routed, normal), the running set, and the pool calls of admission/growth."""

    def __init__(self, config, pool, *, on_admit: Callable[[Request, object], None] | None = None) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        self.waiting: dict[Priority, list[Request]] = {Priority.ROUTED: [], Priority.NORMAL: []}
        self.running: list[Request] = []             # sorted by (priority, arrival)
        self.on_admit = on_admit                      # engine hook: stats of the prefix match
        self.num_preemptions = 0
        self._stamp = 0

    # ------------------------------------------------------------------------------------------ queues
    def add(self, request: Request) -> None:
        """Queue a new or preempted request (kept in arrival order within its class)."""
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting[request.priority], request, key=lambda r: r.arrival_seq)

    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def has_unfinished(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    def remove_finished(self) -> None:
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def abort(self, request: Request, now: float) -> None:
        """Drop a request wherever it is; its pages go back to the pool."""
        if request.status is RequestStatus.WAITING:
            self.waiting[request.priority].remove(request)
        elif request.status is RequestStatus.RUNNING:
            self._free(request, now)
            self.running.remove(request)
        request.status = RequestStatus.FINISHED

    # ---------------------------------------------------------------------------------------- schedule
    def schedule(self, now: float) -> ScheduledBatch:
        cfg, bs = self.config, self.block_size
        batch = ScheduledBatch(now)
        limit, max_seqs = cfg.token_budget, cfg.max_seqs
        running = self.running
        self._stamp += 1
        stamp = self._stamp
        routed = Priority.ROUTED
        decodes = batch.decodes

        # (1) running decodes, in (priority, arrival) order.
        others: list[Request] = []                   # running requests with a prefill chunk to do
        i = num_tokens = 0                           # (batch.num_tokens, kept in a local; _grow may change it)
        while i < len(running) and num_tokens < limit and len(decodes) < max_seqs:
            r = running[i]
            i += 1
            computed = r.num_computed_tokens
            if r.first_token_time is None or len(r.all_token_ids) - computed != 1:
                others.append(r)
                continue
            if computed // bs >= len(r.block_ids):
                batch.num_tokens = num_tokens
                grown = self._grow(r, computed // bs + 1 - len(r.block_ids), now, batch)
                num_tokens = batch.num_tokens
                if not grown:
                    i -= 1                           # r itself was preempted (it was last)
                    continue
            decodes.append(r)
            r.sched_stamp = stamp
            num_tokens += 1
            if r.priority is routed:
                batch.has_routed = True
        batch.num_tokens = num_tokens

        # (2) in-flight prefill chunks (prompt chunks, or recompute after preemption). If (1) stopped
        # early, the token budget or max_seqs is used up and nothing more is scheduled anyway.
        num_seqs = len(decodes)
        for r in others:
            if batch.num_tokens >= limit or num_seqs >= max_seqs:
                break
            if r.status is not RequestStatus.RUNNING:  # preempted by an earlier chunk of this pass
                continue
            n = min(r.num_remaining, limit - batch.num_tokens)
            need = (r.num_computed_tokens + n + bs - 1) // bs - len(r.block_ids)
            if need > 0 and not self._grow(r, need, now, batch):
                continue
            batch.prefills.append((r, n))
            r.sched_stamp = stamp
            batch.num_tokens += n
            num_seqs = batch.num_seqs

        # (3) admissions: routed before normal, then by arrival.
        for prio in (Priority.ROUTED, Priority.NORMAL):
            queue = self.waiting[prio]
            while (queue and batch.num_tokens < limit and len(self.running) < max_seqs
                   and batch.num_seqs < max_seqs):
                r = queue[0]
                n = self._admit(r, limit - batch.num_tokens, now, batch)
                if n == 0:
                    batch.admission_blocked = True   # by memory
                    break
                queue.pop(0)
                r.status = RequestStatus.RUNNING
                bisect.insort(self.running, r, key=_rank)
                batch.prefills.append((r, n))
                r.sched_stamp = stamp
                batch.num_tokens += n
            if batch.admission_blocked:
                break

        batch.waiting_nonempty = bool(self.waiting[Priority.ROUTED] or self.waiting[Priority.NORMAL])
        if batch.preempted:                      # a preempted decode may have set the flag
            batch.has_routed = any(r.priority is routed for r in decodes)
        samples = batch.samples
        samples.extend(decodes)
        for r, n in batch.prefills:
            if r.priority is routed:
                batch.has_routed = True
            if n == r.num_remaining and not r.prefill_only:
                samples.append(r)
        return batch

    # ------------------------------------------------------------------------------------------- memory
    def _admit(self, r: Request, budget: int, now: float, batch: ScheduledBatch) -> int:
        """Match r's prefix, allocate pages for its first chunk; return the chunk size (0 = blocked)."""
        bs = self.block_size
        routed = r.priority is Priority.ROUTED
        # Leave at least one token to compute: its logits give the next token.
        match = self.pool.acquire_prefix(r.all_token_ids, now=now, tenant=r.tenant, shadow=False,
                                         promote=routed, max_tokens=len(r.all_token_ids) - 1)
        cached = match.num_tokens
        n = min(len(r.all_token_ids) - cached, budget)
        need = (cached + n + bs - 1) // bs - len(match.block_ids)
        new_blocks = self.pool.allocate(need, now=now) if need > 0 else []
        while new_blocks is None and routed:
            victim = self._last_normal_running()
            if victim is None:
                break
            self._preempt(victim, now, batch)
            new_blocks = self.pool.allocate(need, now=now)
        if new_blocks is None:
            self.pool.release(match.block_ids, now=now)
            return 0
        r.block_ids = list(match.block_ids) + new_blocks
        r.num_computed_tokens = cached
        r.num_committed_blocks = cached // bs
        r.ready_event = match.ready_event
        batch.reload_tokens += match.host_tokens
        if not r.admitted:
            r.admitted = True
            r.num_cached_tokens = min(cached, r.num_prompt_tokens)
            r.num_host_cached_tokens = min(match.host_tokens, r.num_cached_tokens)
        if self.on_admit is not None:
            self.on_admit(r, match)
        return n

    def _last_normal_running(self) -> Request | None:
        last = self.running[-1] if self.running else None
        return last if last is not None and last.priority is not Priority.ROUTED else None

    def _grow(self, r: Request, need: int, now: float, batch: ScheduledBatch) -> bool:
        """Give running request r `need` more pages, preempting the lowest-ranked running requests
        (possibly r itself) until they fit. False if r was preempted."""
        while True:
            blocks = self.pool.allocate(need, now=now)
            if blocks is not None:
                r.block_ids.extend(blocks)
                return True
            victim = self.running[-1]            # lowest (priority, arrival): normal before routed
            self._preempt(victim, now, batch)
            if victim is r:
                return False

    def _preempt(self, victim: Request, now: float, batch: ScheduledBatch) -> None:
        """Recompute-preemption: keep its computed full pages in the prefix cache, free the rest."""
        if victim.sched_stamp == self._stamp:    # already in this iteration: take it back out
            victim.sched_stamp = -1
            if victim in batch.decodes:
                batch.decodes.remove(victim)
                batch.num_tokens -= 1
            else:
                batch.num_tokens -= sum(n for q, n in batch.prefills if q is victim)
                batch.prefills = [(q, n) for q, n in batch.prefills if q is not victim]
        self._free(victim, now)
        self.running.remove(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)
        self.add(victim)

    def _free(self, r: Request, now: float) -> None:
        self.commit_full_pages(r, now)
        self.pool.release(r.block_ids, now=now)
        r.block_ids = []
        r.num_committed_blocks = 0
        r.ready_event = None

    def commit_full_pages(self, r: Request, now: float) -> None:
        """Register r's newly filled pages in the prefix cache."""
        computed = r.num_computed_tokens
        full = computed // self.block_size
        if full > r.num_committed_blocks:   # (commit registers min(pages, computed // bs) pages: no list copies)
            self.pool.commit(r.block_ids, r.all_token_ids, now=now, tenant=r.tenant, num_tokens=computed)
            r.num_committed_blocks = full
