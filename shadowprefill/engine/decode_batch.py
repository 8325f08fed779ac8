"""The running requests in steady decode, kept across iterations so that scheduling them is O(1) Python.

A steady decode is a running request past its first token with exactly one uncomputed token (its last
sampled one): each iteration it takes one token and one sequence (DESIGN.md §5, step 1). The scheduler used
to find them by looking at every running request at every iteration; `DecodeSet` keeps them in rank order
instead (a request joins when a prefill chunk samples its token and it does not finish, and leaves when it
finishes, is preempted or aborted), and keeps which of them need a page for their next token (`due`: found
where the scheduler already looks at a request, when its computed tokens reach a page boundary). Building
an iteration's decodes is then one list copy, the pages of the requests due one (one KV call for many,
`allocate_slots_many`), and an identity filter for the running requests that still prefill (usually none).

`take(...)` returns None when the fast path does not apply (more decodes than the iteration's token or
sequence cap): the scheduler then runs its per-request scan, which also grows pages for the decodes it
reaches, and `due` is rebuilt from the requests at the next fast iteration.
"""
from __future__ import annotations

import bisect
import operator
from itertools import filterfalse

_priority = operator.attrgetter("priority")

# From this many requests on, an iteration's per-request KV calls go as one (allocate_slots_many,
# cache_many); below it one call each costs less (the batch's own lists outweigh the calls it saves: one
# at a time against batched, 1.3 against 1.9 µs for one request, 5.3 against 4.7 µs for four).
BATCH_FROM = 4


def needs_page(r, block_size: int) -> bool:
    """Whether running request r's next token has no page yet (its computed tokens fill its pages)."""
    computed = r.num_computed_tokens
    return computed % block_size == 0 and computed // block_size >= len(r.block_ids)


class DecodeSet:
    """Steady decodes of one scheduler in rank order (`reqs`), those due a page (`due`), and how many of them
    are routed calls (`num_routed`: Alg. 1 line 5 reads whether any is, every iteration). `routed`: the
    routed class's priority value."""

    __slots__ = ("reqs", "due", "num_routed", "_rank", "_bs", "_due_known", "_routed")

    def __init__(self, rank, block_size: int, routed=0) -> None:
        self.reqs: list = []
        self.due: list = []
        self.num_routed = 0
        self._rank = rank
        self._bs = block_size
        self._due_known = True
        self._routed = routed

    def __len__(self) -> int:
        return len(self.reqs)

    def join(self, r) -> None:
        """r became a steady decode (its prefill chunk sampled a token and it did not finish)."""
        bisect.insort(self.reqs, r, key=self._rank)
        self.num_routed += r.priority == self._routed
        if needs_page(r, self._bs):
            self.due.append(r)

    def stepped(self, r) -> None:
        """r decoded a token and reached a page boundary (the scheduler's check_at visit): due if its next
        token has no page."""
        if needs_page(r, self._bs):
            self.due.append(r)

    def leave(self, r) -> None:
        """r stopped decoding (preempted or aborted)."""
        try:
            self.reqs.remove(r)
        except ValueError:
            return
        self.num_routed -= r.priority == self._routed

    def keep_running(self, running_status) -> None:
        """Drop the requests that finished (after a postprocess)."""
        self.reqs = reqs = [r for r in self.reqs if r.status is running_status]
        self.num_routed = operator.countOf(map(_priority, reqs), self._routed)

    def take(self, sched, batch, cap: int, now: float, running_status):
        """Step (1) of `Scheduler.schedule` when every steady decode fits under `cap`: all of them join the
        batch in rank order, the due ones get their page (a preemption takes its victims back out, as in the
        per-request scan). Returns the running requests that still prefill, in rank order (None: more
        decodes than `cap`; the caller scans per request)."""
        reqs = self.reqs
        if len(reqs) > cap:
            self._due_known = False
            return None
        decodes = batch.decodes
        decodes.extend(reqs)
        if not self._due_known:                  # after a per-request scan: recompute who is due
            bs = self._bs
            self.due = [r for r in reqs if needs_page(r, bs)]
            self._due_known = True
        due = self.due
        if due:
            if len(due) > 1:
                due.sort(key=self._rank)         # the scan's order: growth in rank order
            if len(due) < sched.batch_from:      # a few: one KV call each
                rest, failed = due, False
            else:                                # many: one KV call for all of them; the pool refused the
                live = [r for r in due if r.status is running_status]      # first of `rest`, if any
                rest, failed = live[sched.kv.allocate_slots_many(live, 1, now=now):], True
            kv = sched.kv
            for r in rest:                       # one by one; a refusal grows by preempting (not a victim of
                if r.status is running_status and (failed or kv.allocate_slots(r, 1, now=now) is None):
                    batch.num_tokens = len(decodes)              # an earlier growth)
                    sched._grow(r, 1, now, batch, failed=True)
                failed = False
            due.clear()
        running = sched.running
        if len(running) == len(decodes):
            return []
        return list(filterfalse(set(decodes).__contains__, running))
