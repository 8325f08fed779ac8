"""Shadow work in the scheduler's hands: the lowest class of work an engine runs (paper §3, DESIGN.md §5-6).

The scheduler owns it like its other requests: `ShadowWork` holds each session's shadow target on this
engine and turns it into batch entries.

- Harvest / Harvest-SLO: a streamed shadow job per session (`shadow.jobs.ShadowJob`: a history that
  grows by `extend`, newer histories supersede older ones, longest common prefix kept), taken by switch
  probability. In each iteration the scheduler's last phase asks the controller for a budget (Algorithm 1
  lines 1-12, `controller.plan`) and spends it on the jobs in whole pages (line 15, `shadow/spend.py`, the
  same function the vLLM plugin uses); after the iteration the chunks' pages are registered (`complete`).
- Eager (Table 2): the same shadow targets admitted as ordinary normal-priority prefill-only requests;
  a newer history replaces one still waiting.
- none: shadow targets are ignored.
"""
from __future__ import annotations

import itertools
import logging

from shadowprefill.engine.request import Priority, Request, RequestStatus
from shadowprefill.shadow.jobs import ShadowJobQueue, check_token_ids, complete, take

logger = logging.getLogger(__name__)


class ShadowWork:
    """One engine's shadow targets by session, under the controller's `policy` (shadow.policy)."""

    def __init__(self, scheduler, controller, *, block_size: int, default_switch_prob: float = 0.5,
                 overlap=None, max_len: int | None = None) -> None:
        self.scheduler, self.controller, self.policy = scheduler, controller, controller.policy
        self.jobs = ShadowJobQueue(block_size, default_switch_prob)
        self.overlap = overlap                  # latency model's overlapped_time (host-tier reload beside compute)
        self.max_len = max_len                  # Eager: the longest request the engine takes
        self._eager: dict[str, tuple[list[int], Request | None, str]] = {}   # session -> (history, request, tenant)
        self._ids = itertools.count()
        self._warned_ignored = False

    # ------------------------------------------------------------------------------------ targets
    def add(self, session_id: str, token_ids, now: float, *, switch_prob: float | None = None,
            tenant: str = "") -> bool:
        """Make `token_ids` the session's shadow target; whether it became work (False under "none")."""
        policy = self.policy
        if policy.runs_jobs:
            self.jobs.upsert(session_id, token_ids, now=now, switch_prob=switch_prob, tenant=tenant)
            return True
        if policy.as_requests:
            self._submit_eager(session_id, check_token_ids("token_ids", token_ids), tenant, now)
            return True
        if not self._warned_ignored:
            self._warned_ignored = True
            logger.info("add_shadow ignored: this engine's shadow policy is 'none' (logged once)")
        return False

    def extend(self, session_id: str, token_ids, now: float) -> bool:
        """Append streamed tokens to a session's target; creates none. Whether a job grew."""
        if self.policy.runs_jobs:
            if session_id in self.jobs:
                self.jobs.extend(session_id, token_ids, now=now)
                return True
        elif session_id in self._eager:
            self._eager[session_id][0].extend(check_token_ids("token_ids", token_ids))
        return False

    def cancel(self, session_id: str, now: float) -> None:
        """Forget a session's shadow work (pages already computed stay cached)."""
        self.jobs.remove(session_id)
        entry = self._eager.pop(session_id, None)
        if entry is not None and entry[1] is not None and entry[1].status is RequestStatus.WAITING:
            self.scheduler.abort(entry[1], now)

    def has_runnable(self, n_min: int) -> bool:
        return self.policy.runs_jobs and self.jobs.has_runnable(n_min)

    def _submit_eager(self, session_id: str, tokens: list[int], tenant: str, now: float) -> None:
        sched = self.scheduler
        old = self._eager.get(session_id)
        if old is not None and old[1] is not None and old[1].status is RequestStatus.WAITING:
            sched.abort(old[1], now)
        tokens = tokens[:sched.config.num_blocks * sched.block_size]   # what the pool can ever hold
        if self.max_len is not None:
            tokens = tokens[:self.max_len]
        if not tokens:
            return
        rid = f"__shadow__:{session_id}:{sched.next_seq()}"
        r = Request(rid, tokens, 0, Priority.NORMAL, now, sched.next_seq(), session_id=session_id, tenant=tenant,
                    prefill_only=True, internal=True)
        self._eager[session_id] = (list(tokens), r, tenant)
        sched.add(r)

    # ------------------------------------------------------------------------------- one iteration
    def phase(self, batch, now: float) -> None:
        """The scheduler's last phase: Alg. 1 lines 1-12 on the routed/normal part of `batch`, line 15 on
        the jobs."""
        jobs, sched = self.jobs, self.scheduler
        has_jobs = len(jobs) > 0
        budget = self.controller.plan(batch.view(lambda limit: sched.free_shadow_tokens(limit, now)), has_jobs)
        if not has_jobs:
            return
        chunks = take(jobs, budget, sched.kv, now, overlap=self.overlap)
        if chunks:
            batch.shadow_chunks = chunks
            batch.reload_tokens += sum(c.host_tokens for c in chunks)
            if budget.branch != "credit":             # b bounds the whole iteration (credit: the added time)
                batch.budget_s = budget.seconds

    def complete(self, batch, now: float) -> int:
        """After the iteration: register the chunks' pages, advance the jobs; the shadow tokens computed."""
        if not batch.shadow_chunks:
            return 0
        return complete(self.jobs, batch.shadow_chunks, self.scheduler.kv, now)
