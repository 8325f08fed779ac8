"""Request-level shadow admission to one upstream server (paper appendix D.1).

Each upstream server (`serve.upstream.HttpInstance`) has a `ShadowDispatcher`. It holds at most one
pending shadow per session (a newer completed call supersedes the pending one) and submits them one at a
time:
- admission only when the destination's waiting queue is empty (`vllm:num_requests_waiting` == 0 on its
  Prometheus `/metrics`), and at most one shadow in flight per instance; a server that does not export
  that metric is never read as idle: its shadows are held (`shadow_held_no_queue_metric`, and the
  instance's `queue_metric: false` in `/manager/summary`);
- the submission is an ordinary completion with the lowest priority class and `max_tokens: 1`, so the
  server computes and keeps the KV itself (no cross-model transfer);
- a routed call of the session arriving at the instance drops its pending shadow (the call prefills
  what it needs); routed calls never wait on the dispatcher.
A failed submission (server down, timeout) is counted and dropped; the instance is marked down until
`dead_retry_s` passes. The prototype in D.1 has no per-iteration credit, SLO controller or host tier, and
neither does this; the built-in server maps the shadow class onto its engine's Algorithm 1 instead.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from shadowprefill.serve import prometheus as prom


def upstream_headers(session_key: tuple[str, str]) -> dict[str, str]:
    """Headers naming the session to a server: the built-in server keys its shadow jobs (and cancels them
    on a routed call) by `X-Session-Id`, scoped by tenant so equal ids of two tenants never meet."""
    tenant, session_id = session_key
    return {"X-Session-Id": f"{tenant}/{session_id}", "X-Tenant": tenant}


@dataclass
class ShadowTask:
    session_key: tuple[str, str]
    path: str                      # /v1/completions or /v1/chat/completions
    body: dict
    created: float


class ShadowDispatcher:
    """Pending shadows of one instance and the task that admits them (`start()` on the manager's loop)."""

    def __init__(self, instance, client: httpx.AsyncClient, poll_s: float, timeout_s: float,
                 dead_retry_s: float) -> None:
        self.instance = instance
        self.client = client
        self.poll_s, self.timeout_s, self.dead_retry_s = poll_s, timeout_s, dead_retry_s
        self.pending: "OrderedDict[tuple[str, str], ShadowTask]" = OrderedDict()
        self.in_flight: ShadowTask | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def submit(self, task: ShadowTask) -> None:
        """Queue `task`, superseding the session's pending one."""
        old = self.pending.pop(task.session_key, None)
        if old is not None:
            self.instance.stats["shadow_superseded"] += 1
        self.pending[task.session_key] = task
        self._wake.set()

    def drop(self, session_key: tuple[str, str]) -> None:
        """The session's pending shadow is moot (a routed call of the session reached this instance, or the
        session's shadow moved elsewhere)."""
        if self.pending.pop(session_key, None) is not None:
            self.instance.stats["shadow_dropped_by_routed"] += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def idle(self, timeout: float) -> bool:
        """Wait until nothing is pending or in flight (tests, replay); False on timeout."""
        end = time.monotonic() + timeout
        while self.pending or self.in_flight is not None:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _waiting_requests(self) -> float:
        r = await self.client.get(self.instance.url + "/metrics", timeout=self.timeout_s)
        r.raise_for_status()
        return prom.metric_sum(prom.parse_metrics(r.text), prom.WAITING)   # NaN when the server lacks it

    async def _run(self) -> None:
        inst = self.instance
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not inst.alive:
                await asyncio.sleep(self.poll_s)
                continue
            try:
                waiting = await self._waiting_requests()
                if waiting != waiting:                              # no queue metric: never read as idle
                    inst.stats["shadow_held_no_queue_metric"] += 1
                    inst.queue_metric = False
                    await asyncio.sleep(self.poll_s)
                    continue
                inst.queue_metric = True
                if waiting > 0:                                     # D.1: empty waiting queue only
                    inst.stats["shadow_deferred_busy"] += 1
                    await asyncio.sleep(self.poll_s)
                    continue
            except (httpx.HTTPError, OSError) as exc:
                inst.mark_down(f"metrics: {exc!r}", self.dead_retry_s)
                continue
            if not self.pending:
                continue
            _, task = self.pending.popitem(last=False)
            self.in_flight = task
            inst.stats["shadow_submitted"] += 1
            try:
                r = await self.client.post(inst.url + task.path, json=task.body, timeout=self.timeout_s,
                                           headers=upstream_headers(task.session_key))
                if r.status_code == 200:
                    inst.stats["shadow_completed"] += 1
                    inst.holds(task.session_key, task.body)
                    inst.shadowed.add(task.session_key)
                else:
                    inst.stats["shadow_failed"] += 1
                    inst.last_error = f"shadow HTTP {r.status_code}: {r.text[:200]}"
            except (httpx.HTTPError, OSError) as exc:
                inst.stats["shadow_failed"] += 1
                inst.mark_down(f"shadow: {exc!r}", self.dead_retry_s)
            finally:
                self.in_flight = None
