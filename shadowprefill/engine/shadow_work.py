"""Shadow work as requests: the lowest class of the scheduler's queue (paper §3.1-3.2, DESIGN.md §5-6).

An incremental, streamed shadow job is one `ShadowRequest`: its prompt is the session's history as this
engine's model should hold it, and grows as the cluster manager appends a routed call's input and the
routed model's output (`extend`); a newer history supersedes it (`update`: the longest common prefix is
kept, `shadow.jobs.supersede`). `num_cached` is the page-aligned prefix the engine is believed to cache,
refreshed from the prefix cache whenever a chunk is admitted, so a shadow evicted mid-way is simply
recomputed from what is left (`lost_shadow="recompute"`, the default), or (`"wait"`) waits for its
session's next history before it computes again: without a host tier, where evict-first shadow pages rarely
survive the pool's turnover, recomputing them filled 4-18% of the iterations with chunks no call used
(docs/paper-comparison.md §6, "Without the host tier").

- Harvest / Harvest-SLO: the shadow requests wait in the scheduler's queue as its lowest class
  (`Scheduler.waiting[Priority.SHADOW]`, a `ShadowQueue`: by session, in order of switch probability).
  The scheduler's last phase asks the controller for a budget (Algorithm 1 lines 1-12, `controller.plan`)
  and admits chunks of them within it (line 15: `take`, through `shadow/spend.py`, the function the vLLM
  plugin uses): each chunk is an ordinary prefill entry `(request, n)` of the batch, placed last. A shadow
  request holds pages only while its chunk is in flight (it stays in the queue, WAITING); after the
  iteration `complete` registers the chunk's full pages (shadow class) and frees them.
- Eager (Table 2): the same shadow requests admitted at normal priority, as ordinary prefill-only
  requests of the normal queue; a newer history replaces one still waiting.
- none: shadow targets are ignored.

The KV cache manager sees a shadow request through the request-shaped calls the scheduler uses for every
request (`get_computed_blocks`, `allocate_slots`, `cache`, `free`, with `shadow=True`).
"""
from __future__ import annotations

import itertools
import logging
from typing import Iterator

from shadowprefill.engine.request import Priority, Request, RequestStatus
from shadowprefill.shadow.jobs import check_switch_prob, check_token_ids, supersede
from shadowprefill.shadow.spend import spend_budget

logger = logging.getLogger(__name__)

LOST_SHADOW = ("recompute", "wait")   # what a shadow request whose computed prefix was evicted does


class ShadowRequest(Request):
    """One session's shadow job on this engine: a prefill-only request of the shadow class (or, under
    Eager, of the normal class) whose prompt is the session's history and grows by `extend`.

    `switch_prob` orders the shadow class (Alg. 1 line 15); `num_cached` is the page-aligned prefix believed
    cached; `version` is bumped when the history is rewritten (not on appends), so a chunk in flight of an
    older history does not advance the belief; `page_hashes` is the history's kept hash chain (kv
    hash_chain): pages hashed once, and the cached prefix's page ids it last resolved, revalidated per chunk
    by a generation check per page instead of a lookup."""

    __slots__ = ("switch_prob", "num_cached", "version", "updated_at", "tokens_computed", "page_hashes",
                 "chunk_version", "chunk_reload_tokens", "_computing", "stalled")

    def __init__(self, request_id: str, session_id: str, token_ids: list[int], switch_prob: float, tenant: str,
                 arrival_seq: int, now: float, priority: Priority = Priority.SHADOW) -> None:
        super().__init__(request_id, token_ids, 0, priority, now, arrival_seq, session_id=session_id, tenant=tenant,
                         prefill_only=True, internal=True, own_prompt=True)
        self.switch_prob = switch_prob
        self.num_cached = 0          # page-aligned prefix the engine is believed to cache
        self.version = 0             # bumped when the history is rewritten (not on appends)
        self.updated_at = now
        self.tokens_computed = 0     # shadow tokens this job has prefilled (stats)
        self.page_hashes = None      # the history's kv.PageHashes (set when a chunk is first admitted)
        self.chunk_version = -1      # version of the chunk in flight (-1: none)
        self.chunk_reload_tokens = 0  # host-tier tokens reloaded for the chunk in flight
        self._computing = None       # the history the chunk in flight computes, once a rewrite replaced it
        self.stalled = False         # lost_shadow="wait": its computed prefix was evicted; waits for `update`

    # --------------------------------------------------------------------------------------- history
    @property
    def token_ids(self) -> list[int]:
        """The history (the live list: read it, do not change it)."""
        return self._token_ids

    def token_ids_upto(self, n: int) -> list[int]:
        """The tokens the request's KV is made of: the history, or while a chunk is in flight after a
        rewrite, the history that chunk computes."""
        c = self._computing
        return self._token_ids if c is None else c

    def _set(self, token_ids: list[int]) -> None:
        self._token_ids = token_ids
        self.num_prompt_tokens = self.num_tokens = len(token_ids)

    def extend(self, token_ids: list[int], now: float) -> None:
        """Append tokens (new call input now, routed output as it streams): the prompt grows."""
        toks = self._token_ids
        toks.extend(token_ids)
        self.num_prompt_tokens = self.num_tokens = len(toks)
        self.updated_at = now

    def update(self, token_ids: list[int], now: float, block_size: int) -> None:
        """Replace the history (newer history supersedes pending work; shadow.jobs.supersede)."""
        old = self._token_ids
        kept, self.num_cached, rewritten = supersede(old, token_ids, self.num_cached, block_size)
        if self.stalled:             # one more try per new history: the next lookup finds what is cached
            self.stalled, self.num_cached = False, 0
        if self.chunk_version >= 0 and self._computing is None:
            self._computing = old    # the chunk in flight registers the pages of what it computed
        self._set(token_ids)
        if rewritten:
            self.version += 1
        if self.page_hashes is not None:   # keep the hashes of the pages both histories share
            self.page_hashes.retarget(token_ids, kept // block_size)
        self.updated_at = now

    def shadowable_tokens(self, block_size: int) -> int:
        """Tokens in whole pages: the part of the history a shadow can make resident."""
        return self.num_tokens // block_size * block_size

    def pending_tokens(self, block_size: int) -> int:
        """Whole-page tokens not cached yet (by the belief)."""
        return max(self.num_tokens // block_size * block_size - self.num_cached, 0)

    def __repr__(self) -> str:
        return (f"ShadowRequest({self.session_id!r}, tokens={self.num_tokens}, cached={self.num_cached}, "
                f"p={self.switch_prob:.2f})")


class ShadowQueue:
    """The lowest class of the scheduler's waiting queue: one `ShadowRequest` per session, iterated in order
    of switch probability (highest first, then oldest), the order of Alg. 1 line 15."""

    def __init__(self, block_size: int, default_switch_prob: float = 0.5, lost_shadow: str = "recompute") -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if lost_shadow not in LOST_SHADOW:
            raise ValueError(f"lost_shadow must be one of {LOST_SHADOW}, got {lost_shadow!r}")
        self.block_size = block_size
        self.wait_lost = lost_shadow == "wait"
        self.default_switch_prob = check_switch_prob(default_switch_prob)
        self._jobs: dict[str, ShadowRequest] = {}
        self._order: list[ShadowRequest] | None = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._jobs

    def get(self, session_id: str) -> ShadowRequest | None:
        return self._jobs.get(session_id)

    def upsert(self, session_id: str, token_ids, *, now: float, switch_prob: float | None = None,
               tenant: str = "") -> ShadowRequest:
        """Queue the session's shadow request, or give it a new history (see `ShadowRequest.update`)."""
        if not isinstance(session_id, str) or not session_id:
            raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")
        tokens = check_token_ids("token_ids", token_ids)
        job = self._jobs.get(session_id)
        if job is None:
            prob = self.default_switch_prob if switch_prob is None else check_switch_prob(switch_prob)
            seq = next(self._seq)
            job = ShadowRequest(f"__shadow_job__:{session_id}:{seq}", session_id, tokens, prob, tenant, seq, now)
            self._jobs[session_id] = job
            self._order = None
            return job
        if job.tenant != tenant:
            raise ValueError(f"session {session_id!r} belongs to tenant {job.tenant!r}, not {tenant!r}")
        job.update(tokens, now, self.block_size)
        if switch_prob is not None:
            self.set_switch_prob(session_id, switch_prob)
        return job

    def extend(self, session_id: str, token_ids, *, now: float) -> ShadowRequest:
        """Append tokens to a session's shadow request (KeyError if the session has none)."""
        job = self._jobs[session_id]
        job.extend(check_token_ids("token_ids", token_ids), now)
        return job

    def set_switch_prob(self, session_id: str, switch_prob: float) -> None:
        job = self._jobs[session_id]
        prob = check_switch_prob(switch_prob)
        if prob != job.switch_prob:
            job.switch_prob = prob
            self._order = None

    def remove(self, session_id: str) -> ShadowRequest | None:
        job = self._jobs.pop(session_id, None)
        if job is not None:
            self._order = None
        return job

    def ordered(self) -> list[ShadowRequest]:
        """Shadow requests by switch probability (highest first), then by age (Alg. 1 line 15 order)."""
        if self._order is None:
            self._order = sorted(self._jobs.values(), key=lambda j: (-j.switch_prob, j.arrival_seq))
        return self._order

    def runnable(self, n_min: int) -> Iterator[ShadowRequest]:
        """Shadow requests with at least `n_min` pending whole-page tokens (smaller chunks are deferred), in
        order."""
        bs = self.block_size
        need = max(n_min, 1)
        for job in self.ordered():
            if job.pending_tokens(bs) >= need and not job.stalled:
                yield job

    def has_runnable(self, n_min: int) -> bool:
        return next(self.runnable(n_min), None) is not None

    def pending_tokens(self) -> int:
        """Whole-page tokens not yet cached, over all shadow requests."""
        return sum(j.pending_tokens(self.block_size) for j in self._jobs.values())


class _Admission:
    """The shadow class as `spend.spend_budget` sees it (its `SpendHost`): admitting a chunk of a shadow
    request is the scheduler's request path with `shadow=True`: `locate` gets its computed (cached) blocks,
    `allocate` its slots (shadow class), `release` frees a request whose chunk was not taken."""

    __slots__ = ("block_size", "kv", "now", "budget", "overlap", "host_aware", "wait_lost", "_match", "admitted")

    def __init__(self, block_size: int, budget, kv, now: float, overlap, wait_lost: bool = False) -> None:
        self.block_size, self.kv, self.now, self.budget, self.overlap = block_size, kv, now, budget, overlap
        self.wait_lost = wait_lost
        self.host_aware = overlap is not None and kv.has_host_tier
        self._match = None
        self.admitted: list[tuple[ShadowRequest, int]] = []

    def estimate(self, r: ShadowRequest) -> tuple[int, int]:
        """The belief: no prefix lookup for a request that cannot fit."""
        return r.num_cached, r.pending_tokens(self.block_size)

    def locate(self, r: ShadowRequest):
        bs, kv, budget = self.block_size, self.kv, self.budget
        limit = r.shadowable_tokens(bs)
        history = r.token_ids
        if r.page_hashes is None or r.page_hashes.tokens is not history:
            r.page_hashes = kv.hash_chain(history, tenant=r.tenant)
        if self.host_aware:
            dev, host = kv.peek_prefix(history, tenant=r.tenant, max_tokens=limit, hashes=r.page_hashes)
            if self.wait_lost and dev + host < r.num_cached:
                r.stalled = True                 # its computed prefix was evicted: wait for new history
                return None
            if host:        # no reload (match) unless the chunk fits beside it
                k = min(limit - dev - host, budget.room(), budget.fits(dev + host, reload=(self.overlap, host)))
                if k - k % bs < budget.n_min:
                    r.num_cached = dev + host
                    return None
        match = self._match = kv.get_computed_blocks(r, now=self.now, max_tokens=limit, shadow=True,
                                                     hashes=r.page_hashes)
        if self.wait_lost and match.num_tokens < r.num_cached:
            r.stalled = True                     # its computed prefix was evicted: wait for new history
            self.release(r)
            return None
        r.num_computed_tokens = r.num_cached = match.num_tokens
        reload = (self.overlap, match.host_tokens) if match.host_tokens and self.overlap is not None else None
        return match.num_tokens, limit - match.num_tokens, reload

    def allocate(self, r: ShadowRequest, context: int, n: int) -> bool:
        if self.kv.allocate_slots(r, n, now=self.now, shadow=True) is None:
            return False
        match, self._match = self._match, None
        r.block_ids = self.kv.block_table(r)
        r.ready_event, r.chunk_reload_tokens = match.ready_event, match.host_tokens
        r.chunk_version = r.version
        self.admitted.append((r, n))
        return True

    def release(self, r: ShadowRequest) -> None:
        if self._match is not None:
            self.kv.free(r, now=self.now)
            self._match = None


def take(queue: ShadowQueue, budget, kv, now: float, *, overlap=None, probe: bool = False
         ) -> list[tuple[ShadowRequest, int]]:
    """Algorithm 1 line 15 (`spend.spend_budget`): the scheduler's shadow phase admits chunks of `queue`'s
    shadow requests by switch probability, each the largest whole-page chunk the `budget`
    (controller.ShadowBudget) allows at the request's cached context, until it is spent; a request's short
    tail waits for more history. Returns the prefill entries `(request, new tokens)`; each request holds its
    chunk's pages (its cached prefix and shadow-class slots) until `complete`. `kv`: the instance's
    KVCacheManager. `overlap(compute_s, reload_tokens)`: an iteration's seconds when it reads a host-tier
    prefix through a layer-wise reload (model.latency.LatencyModel.overlapped_time, which the
    SimulatedExecutor charges too): the budget counts only what the reload adds beyond the compute
    (ShadowBudget.reload_s), and no reload starts unless the chunk fits beside it. `probe`: one chunk of
    n_min tokens whatever b says (a liveness probe, controller.ShadowController.probe_due).

    O(chunk) work per chunk, not O(context): a shadow request keeps its chain between chunks, so its prefix
    is never re-hashed, and the chain remembers the pages it was found on (generation-checked by the
    manager), so a 64K-token prefix is revalidated without 4,096 hash lookups; only the page list handed to
    the forward pass and the references on it remain O(context), at a few ns per page in the native KV
    core."""
    if not (probe or budget.open) or len(queue) == 0:
        return []
    host = _Admission(queue.block_size, budget, kv, now, overlap, queue.wait_lost)
    spend_budget(budget, queue.runnable(budget.n_min), host, short_last=False, probe=probe)
    return host.admitted


def complete(queue: ShadowQueue, admitted: list[tuple[ShadowRequest, int]], kv, now: float) -> int:
    """After the iteration ran: register each chunk's full pages in the prefix cache (shadow class), free
    the request's pages and advance its belief (unless a rewrite or a cancel superseded it meanwhile).
    Returns the shadow tokens computed."""
    total = 0
    for r, n in admitted:
        end = r.num_computed_tokens + n
        tokens = r.token_ids_upto(end)
        hashes = r.page_hashes if r.page_hashes is not None and r.page_hashes.tokens is tokens else None
        kv.cache(r, now=now, num_tokens=end, hashes=hashes)
        kv.free(r, now=now)
        r.block_ids = []
        r._computing = None
        r.tokens_computed += n
        if queue.get(r.session_id) is r and r.version == r.chunk_version and end > r.num_cached:
            r.num_cached = end
        r.chunk_version = -1
        r.num_computed_tokens = r.num_cached
        total += n
    return total


class ShadowWork:
    """One engine's shadow targets by session, under the controller's `policy` (shadow.policy): shadow
    requests in the scheduler's `queue` (Harvest modes), submitted at normal priority (Eager), or none."""

    def __init__(self, scheduler, controller, queue: ShadowQueue, *, max_len: int | None = None) -> None:
        self.scheduler, self.controller, self.policy = scheduler, controller, controller.policy
        self.jobs = queue
        self.max_len = max_len                  # Eager: the longest request the engine takes
        self._eager: dict[str, ShadowRequest] = {}   # session -> its Eager request
        self._warned_ignored = False

    def add(self, session_id: str, token_ids, now: float, *, switch_prob: float | None = None,
            tenant: str = "") -> bool:
        """Make `token_ids` the session's shadow target; whether it became work (False under "none")."""
        policy = self.policy
        if policy.runs_jobs:
            self.jobs.upsert(session_id, token_ids, now=now, switch_prob=switch_prob, tenant=tenant)
            return True
        if policy.as_requests:
            self._submit_eager(session_id, check_token_ids("token_ids", token_ids), switch_prob, tenant, now)
            return True
        if not self._warned_ignored:
            self._warned_ignored = True
            logger.info("add_shadow ignored: this engine's shadow policy is 'none' (logged once)")
        return False

    def extend(self, session_id: str, token_ids, now: float) -> bool:
        """Append streamed tokens to a session's shadow request; creates none. Whether one grew. (Eager's
        request prefills the history it was given at the routed call: the streamed output is the next call's
        input, which that call's add_shadow submits.)"""
        if self.policy.runs_jobs and session_id in self.jobs:
            self.jobs.extend(session_id, token_ids, now=now)
            return True
        return False

    def cancel(self, session_id: str, now: float) -> None:
        """Forget a session's shadow work (pages already computed stay cached)."""
        self.jobs.remove(session_id)
        r = self._eager.pop(session_id, None)
        if r is not None and r.status is RequestStatus.WAITING:
            self.scheduler.abort(r, now)

    def has_runnable(self, n_min: int) -> bool:
        return self.policy.runs_jobs and self.jobs.has_runnable(n_min)

    def _submit_eager(self, session_id: str, tokens: list[int], switch_prob, tenant: str, now: float) -> None:
        """Eager: the session's shadow request, admitted at normal priority (a newer one replaces one still
        waiting)."""
        sched = self.scheduler
        old = self._eager.pop(session_id, None)
        if old is not None and old.status is RequestStatus.WAITING:
            sched.abort(old, now)
        tokens = tokens[:sched.config.num_blocks * sched.block_size]   # what the pool can ever hold
        if self.max_len is not None:
            tokens = tokens[:self.max_len]
        if not tokens:
            return
        prob = self.jobs.default_switch_prob if switch_prob is None else check_switch_prob(switch_prob)
        rid = f"__shadow__:{session_id}:{sched.next_seq()}"
        r = ShadowRequest(rid, session_id, tokens, prob, tenant, sched.next_seq(), now, priority=Priority.NORMAL)
        self._eager[session_id] = r
        sched.add(r)
