"""Shadow jobs (paper §3.1, DESIGN.md §6).

A `ShadowJob` is one session's history as this engine's model should hold it: the token sequence, and
how much of it the engine already caches (`num_cached`, a page-aligned belief refreshed from the prefix
cache whenever a chunk runs, so a shadow evicted mid-way is simply recomputed from what is left).
The cluster manager appends a routed call's input at once and the routed model's output tokens as they
stream (`extend`), or hands a whole new history (`update`): an extension keeps all progress, a history
that is not append-only keeps the longest common prefix, and pending work of the old history is
dropped (newer history supersedes it).

Only whole pages are shadowed: a partial last page could not be registered in the prefix cache, so the
switch call prefills that tail itself, as it does the output of the current call (§3.1).

`ShadowJobQueue` holds this engine's jobs in order of predicted switch probability (highest first,
then oldest), the order in which Algorithm 1 line 15 takes tokens from them (`take`, spending the
controller's `ShadowBudget`), and `complete` registers what the chunks computed. Both talk to the instance's
`kv.KVCacheManager` only through its request-level calls.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

import numpy as np

from shadowprefill.shadow.spend import spend_budget


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                        # a[:lo] == b[:lo], a[:hi] != b[:hi]; bisect on slices (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def check_token_ids(name: str, token_ids) -> list[int]:
    """token_ids as a new list of non-negative Python ints: from a sequence of ints (bool and numpy scalars
    are refused) or a 1-D numpy array of an integer dtype (checked and converted in C)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold non-negative int token ids (got a {token_ids.ndim}-D "
                             f"{token_ids.dtype} array)")
        if token_ids.dtype.kind == "i" and token_ids.size and token_ids.min() < 0:
            raise ValueError(f"{name} must hold non-negative int token ids")
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    tokens = list(token_ids)
    if {*map(type, tokens)} <= {int}:     # plain ints (the common case): two C-level scans, no Python loop
        bad = bool(tokens) and min(tokens) < 0
    else:
        bad = any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens)
    if bad:
        raise ValueError(f"{name} must hold non-negative int token ids")
    return tokens


def _check_prob(switch_prob) -> float:
    if isinstance(switch_prob, bool) or not isinstance(switch_prob, (int, float)) or math.isnan(switch_prob):
        raise TypeError(f"switch_prob must be a number in [0, 1], got {switch_prob!r}")
    if not 0.0 <= switch_prob <= 1.0:
        raise ValueError(f"switch_prob must be in [0, 1], got {switch_prob}")
    return float(switch_prob)


class ShadowJob:
    """The history one session should have cached on this engine, and how much is cached already."""

    __slots__ = ("session_id", "token_ids", "num_cached", "switch_prob", "tenant", "seq", "version",
                 "updated_at", "tokens_computed", "page_hashes")

    def __init__(self, session_id: str, token_ids: list[int], switch_prob: float, tenant: str, seq: int,
                 now: float) -> None:
        self.session_id = session_id
        self.token_ids = token_ids
        self.num_cached = 0          # page-aligned prefix the engine is believed to cache
        self.switch_prob = switch_prob
        self.tenant = tenant
        self.seq = seq               # arrival order, breaks probability ties
        self.version = 0             # bumped when the history is rewritten (not on appends)
        self.updated_at = now
        self.tokens_computed = 0     # shadow tokens this job has prefilled (stats)
        self.page_hashes = None      # token_ids' kept hash chain (kv hash_chain, set by `take`): pages hashed
                                     # once, and the cached prefix's page ids it last resolved, revalidated
                                     # per chunk by a generation check per page instead of a lookup

    def shadowable_tokens(self, block_size: int) -> int:
        """Tokens in whole pages: the part of the history a shadow can make resident."""
        return len(self.token_ids) // block_size * block_size

    def pending_tokens(self, block_size: int) -> int:
        """Whole-page tokens not cached yet (by the job's belief)."""
        return max(self.shadowable_tokens(block_size) - self.num_cached, 0)

    def extend(self, token_ids: list[int], now: float) -> None:
        """Append tokens (new call input now, routed output as it streams)."""
        self.token_ids.extend(token_ids)
        self.updated_at = now

    def update(self, token_ids: list[int], now: float, block_size: int) -> None:
        """Replace the history. An extension keeps all progress; otherwise only the whole pages of the
        longest common prefix stay cached (non-append-only histories, e.g. a compacted context)."""
        old = self.token_ids
        if len(token_ids) >= len(old) and token_ids[:len(old)] == old:
            self.token_ids = token_ids
            kept = len(old)
        else:
            kept = lcp = common_prefix_length(old, token_ids)
            self.token_ids = token_ids
            self.num_cached = min(self.num_cached, lcp // block_size * block_size)
            self.version += 1
        if self.page_hashes is not None:   # keep the hashes of the pages both histories share
            self.page_hashes.retarget(token_ids, kept // block_size)
        self.updated_at = now

    def __repr__(self) -> str:
        return (f"ShadowJob({self.session_id!r}, tokens={len(self.token_ids)}, cached={self.num_cached}, "
                f"p={self.switch_prob:.2f})")


class ShadowJobQueue:
    """This engine's shadow jobs, by session, iterated in order of switch probability."""

    def __init__(self, block_size: int, default_switch_prob: float = 0.5) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.default_switch_prob = _check_prob(default_switch_prob)
        self._jobs: dict[str, ShadowJob] = {}
        self._order: list[ShadowJob] | None = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._jobs

    def get(self, session_id: str) -> ShadowJob | None:
        return self._jobs.get(session_id)

    def upsert(self, session_id: str, token_ids, *, now: float, switch_prob: float | None = None,
               tenant: str = "") -> ShadowJob:
        """Create the session's job or give it a new history (see `ShadowJob.update`)."""
        if not isinstance(session_id, str) or not session_id:
            raise TypeError(f"session_id must be a non-empty str, got {session_id!r}")
        tokens = check_token_ids("token_ids", token_ids)
        job = self._jobs.get(session_id)
        if job is None:
            prob = self.default_switch_prob if switch_prob is None else _check_prob(switch_prob)
            job = ShadowJob(session_id, tokens, prob, tenant, next(self._seq), now)
            self._jobs[session_id] = job
            self._order = None
            return job
        if job.tenant != tenant:
            raise ValueError(f"session {session_id!r} belongs to tenant {job.tenant!r}, not {tenant!r}")
        job.update(tokens, now, self.block_size)
        if switch_prob is not None:
            self.set_switch_prob(session_id, switch_prob)
        return job

    def extend(self, session_id: str, token_ids, *, now: float) -> ShadowJob:
        """Append tokens to an existing job (KeyError if the session has none)."""
        job = self._jobs[session_id]
        job.extend(check_token_ids("token_ids", token_ids), now)
        return job

    def set_switch_prob(self, session_id: str, switch_prob: float) -> None:
        job = self._jobs[session_id]
        prob = _check_prob(switch_prob)
        if prob != job.switch_prob:
            job.switch_prob = prob
            self._order = None

    def remove(self, session_id: str) -> ShadowJob | None:
        job = self._jobs.pop(session_id, None)
        if job is not None:
            self._order = None
        return job

    def ordered(self) -> list[ShadowJob]:
        """Jobs by switch probability (highest first), then by age (Alg. 1 line 15 order)."""
        if self._order is None:
            self._order = sorted(self._jobs.values(), key=lambda j: (-j.switch_prob, j.seq))
        return self._order

    def runnable(self, n_min: int) -> Iterator[ShadowJob]:
        """Jobs with at least `n_min` pending whole-page tokens (smaller chunks are deferred), in order."""
        bs = self.block_size
        need = max(n_min, 1)
        for job in self.ordered():
            if job.pending_tokens(bs) >= need:
                yield job

    def has_runnable(self, n_min: int) -> bool:
        return next(self.runnable(n_min), None) is not None

    def pending_tokens(self) -> int:
        """Whole-page tokens not yet cached, over all jobs."""
        return sum(j.pending_tokens(self.block_size) for j in self._jobs.values())


_chunk_ids = itertools.count()


class ShadowChunk:
    """Shadow work of one iteration: tokens [start, start + num_new) of a job's history, written into
    shadow-class pages; produces no token. To the KV cache manager it is a short-lived request (its
    request-shaped calls: `request_id`, `tenant`, `num_computed_tokens`, `token_ids_upto`) that holds its
    pages only while in flight. `host_tokens`: the cached prefix tokens reloaded from the host tier for it
    (the forward waits on `ready_event`)."""

    __slots__ = ("job", "token_ids", "start", "num_new", "block_ids", "version", "ready_event", "page_hashes",
                 "host_tokens", "request_id", "tenant")

    def __init__(self, job: ShadowJob, start: int, num_new: int, block_ids: list[int], ready_event=None,
                 host_tokens: int = 0) -> None:
        self.request_id = f"__shadow_chunk__:{job.session_id}:{next(_chunk_ids)}"
        self.tenant = job.tenant
        self.job = job
        self.token_ids = job.token_ids      # the history; [0, start + num_new) is what the chunk computes
        self.page_hashes = job.page_hashes  # token_ids' kv.PageHashes
        self.start = start
        self.num_new = num_new
        self.block_ids = block_ids
        self.version = job.version
        self.ready_event = ready_event
        self.host_tokens = host_tokens

    @property
    def new_token_ids(self) -> list[int]:
        return self.token_ids[self.start:self.start + self.num_new]

    @property
    def num_computed_tokens(self) -> int:
        return self.start

    def token_ids_upto(self, n: int) -> list[int]:
        """The job's history (the live list; it holds at least `n` tokens)."""
        return self.token_ids

    def __repr__(self) -> str:
        return f"ShadowChunk({self.job.session_id!r}, [{self.start}, {self.start + self.num_new}))"


class _JobHost:
    """The engine's shadow jobs as `spend.spend_budget` sees them (its `SpendHost`). Each chunk is a request
    to the KV cache manager: `locate` gets its computed (cached) pages, `allocate` its shadow-class slots,
    `release` frees a chunk that was not taken."""

    __slots__ = ("block_size", "kv", "now", "budget", "overlap", "host_aware", "_chunk", "chunks")

    def __init__(self, queue: ShadowJobQueue, budget, kv, now: float, overlap) -> None:
        self.block_size, self.kv, self.now, self.budget, self.overlap = queue.block_size, kv, now, budget, overlap
        self.host_aware = overlap is not None and kv.has_host_tier
        self._chunk: ShadowChunk | None = None
        self.chunks: list[ShadowChunk] = []

    def estimate(self, job: ShadowJob) -> tuple[int, int]:
        """The job's belief: no prefix lookup for a job that cannot fit."""
        return job.num_cached, job.pending_tokens(self.block_size)

    def locate(self, job: ShadowJob):
        bs, kv, budget = self.block_size, self.kv, self.budget
        limit = job.shadowable_tokens(bs)
        if job.page_hashes is None or job.page_hashes.tokens is not job.token_ids:
            job.page_hashes = kv.hash_chain(job.token_ids, tenant=job.tenant)
        if self.host_aware:
            dev, host = kv.peek_prefix(job.token_ids, tenant=job.tenant, max_tokens=limit, hashes=job.page_hashes)
            if host:        # no reload (match) unless the chunk fits beside it
                k = min(limit - dev - host, budget.room(), budget.fits(dev + host, reload=(self.overlap, host)))
                if k - k % bs < budget.n_min:
                    job.num_cached = dev + host
                    return None
        chunk = self._chunk = ShadowChunk(job, 0, 0, [])
        match = kv.get_computed_blocks(chunk, now=self.now, max_tokens=limit, shadow=True, hashes=job.page_hashes)
        chunk.start = job.num_cached = match.num_tokens
        chunk.ready_event, chunk.host_tokens = match.ready_event, match.host_tokens
        reload = (self.overlap, match.host_tokens) if match.host_tokens and self.overlap is not None else None
        return chunk.start, limit - chunk.start, reload

    def allocate(self, job: ShadowJob, context: int, n: int) -> bool:
        chunk = self._chunk
        if self.kv.allocate_slots(chunk, n, now=self.now, shadow=True) is None:
            return False
        self._chunk = None
        chunk.num_new = n
        chunk.block_ids = self.kv.block_table(chunk)
        self.chunks.append(chunk)
        return True

    def release(self, job: ShadowJob) -> None:
        if self._chunk is not None:
            self.kv.free(self._chunk, now=self.now)
            self._chunk = None


def take(queue: ShadowJobQueue, budget, kv, now: float, *, overlap=None) -> list[ShadowChunk]:
    """Algorithm 1 line 15 (`spend.spend_budget`): chunks from `queue`'s jobs by switch probability, each
    the largest whole-page chunk the `budget` (controller.ShadowBudget) allows at the job's cached context,
    until it is spent; a job's short tail waits for more history. `kv`: the instance's KVCacheManager
    (prefix match and shadow-class pages, references held by the chunks until `complete`).
    `overlap(compute_s, reload_tokens)`: an iteration's seconds when it reads a host-tier prefix through a
    layer-wise reload (model.latency.LatencyModel.overlapped_time, which the SimulatedExecutor charges too):
    the budget counts only what the reload adds beyond the compute (ShadowBudget.reload_s), and no reload
    starts unless the chunk fits beside it.

    O(chunk) work per chunk, not O(context): a job keeps its chain between chunks, so its prefix is never
    re-hashed, and the chain remembers the pages it was found on (generation-checked by the manager), so a
    64K-token prefix is revalidated without 4,096 hash lookups; only the page list handed to the forward pass
    and the references on it remain O(context), at a few ns per page in the native KV core."""
    if not budget.open or len(queue) == 0:
        return []
    host = _JobHost(queue, budget, kv, now, overlap)
    spend_budget(budget, queue.runnable(budget.n_min), host, short_last=False)
    return host.chunks


def complete(queue: ShadowJobQueue, chunks: list[ShadowChunk], kv, now: float) -> int:
    """After the iteration ran: register the chunks' full pages in the prefix cache (shadow class), drop
    their references and advance the jobs. Returns the shadow tokens computed."""
    total = 0
    for c in chunks:
        end = c.start + c.num_new
        hashes = c.page_hashes if c.page_hashes is not None and c.page_hashes.tokens is c.token_ids else None
        kv.cache(c, now=now, num_tokens=end, hashes=hashes)
        kv.free(c, now=now)
        job = c.job
        job.tokens_computed += c.num_new
        if queue.get(job.session_id) is job and job.version == c.version and end > job.num_cached:
            job.num_cached = end
        total += c.num_new
    return total
