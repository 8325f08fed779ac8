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
- a routed call of the session arriving at the instance drops its pending shadow and aborts its in-flight
  one (closing the request makes vLLM abort it; the blocks it computed stay cached; the call prefills the
  rest); routed calls never wait on the dispatcher;
- streamed shadows (`ShadowTask.streamed`, §3.1, `serve.shadow_stream`): a token-id history is cut to the
  server's whole KV blocks (its `vllm:cache_config_info` block size), and one that adds no block to what
  the session's last streamed shadow here sent is skipped, so each block is computed once.
A failed submission (server down, connection lost) is counted and dropped; the instance is marked down until
`dead_retry_s` passes. A shadow that gets no answer within `timeout_s` is counted (`shadow_timed_out`) and
dropped, and the instance stays up: a server may hold a lowest-priority request behind all its other work.
The prototype in D.1 has no per-iteration credit, SLO controller or host tier, and neither does this; the
built-in server maps the shadow class onto its engine's Algorithm 1 instead.
"""
from __future__ import annotations

import asyncio
import itertools
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


_SEQ = itertools.count()


def shadow_request_id(task: "ShadowTask") -> str:
    """`X-Request-Id` of a shadow (vLLM's request id, `cmpl-<this>...`): names the session, so a server's
    per-step stats attribute shadow work to sessions."""
    tenant, sid = task.session_key
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{tenant}.{sid}")
    return f"shadow-{safe}-{'s' if task.streamed else 'w'}{next(_SEQ)}"


@dataclass
class ShadowTask:
    session_key: tuple[str, str]
    path: str                      # /v1/completions or /v1/chat/completions
    body: dict
    created: float
    streamed: bool = False         # a prefix of a call still streaming: cut to whole blocks, counted apart


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
        self._post: asyncio.Future | None = None       # the in-flight shadow's request
        self._abort = False                             # drop() asked to abort the in-flight shadow
        self._sent: "OrderedDict[tuple[str, str], object]" = OrderedDict()   # session -> last streamed prompt

    def submit(self, task: ShadowTask) -> None:
        """Queue `task`, superseding the session's pending one."""
        old = self.pending.pop(task.session_key, None)
        if old is not None:
            self.instance.stats["shadow_superseded"] += 1
        self.pending[task.session_key] = task
        self._wake.set()

    def drop(self, session_key: tuple[str, str]) -> None:
        """The session's shadow is moot (a routed call of the session reached this instance, or the session's
        shadow moved elsewhere): its pending one is dropped, its in-flight one aborted (§3.1 supersession)."""
        if self.pending.pop(session_key, None) is not None:
            self.instance.stats["shadow_dropped_by_routed"] += 1
        self._sent.pop(session_key, None)
        if self.in_flight is not None and self.in_flight.session_key == session_key and self._post is not None \
                and not self._post.done():
            self._abort = True
            self._post.cancel()

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
        parsed = prom.parse_metrics(r.text)
        self.instance.block_size = prom.block_size_of(parsed) or self.instance.block_size
        return prom.metric_sum(parsed, prom.WAITING)   # NaN when the server lacks it

    def _cut(self, task: ShadowTask) -> dict | None:
        """The body a streamed task sends: token ids cut to whole blocks; None when it adds nothing to the
        session's last streamed shadow here (that prefix is cached: resending would recompute its last block)."""
        body, bs = task.body, self.instance.block_size
        prompt = body.get("prompt")
        if isinstance(prompt, list) and bs:
            prompt = prompt[:len(prompt) // bs * bs]
            body = {**body, "prompt": prompt}
        content = body.get("prompt", body.get("messages"))
        last = self._sent.get(task.session_key)
        if not content or (last is not None and (last == content or (
                isinstance(content, list) and isinstance(last, list) and len(content) <= len(last)
                and content == last[:len(content)]))):
            return None
        self._sent[task.session_key] = content
        self._sent.move_to_end(task.session_key)
        while len(self._sent) > 10_000:
            self._sent.popitem(last=False)
        return body

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
            body = task.body
            if task.streamed:
                body = self._cut(task)
                if body is None:
                    inst.stats["shadow_stream_skipped"] += 1
                    continue
            else:
                self._sent.pop(task.session_key, None)
            kind = "shadow_stream" if task.streamed else "shadow"
            self.in_flight, self._abort = task, False
            inst.stats[kind + "_submitted"] += 1
            try:
                self._post = asyncio.ensure_future(self.client.post(
                    inst.url + task.path, json=body, timeout=self.timeout_s,
                    headers={**upstream_headers(task.session_key), "X-Request-Id": shadow_request_id(task)}))
                try:
                    r = await self._post
                except asyncio.CancelledError:
                    if not self._abort or asyncio.current_task().cancelling():   # the dispatcher is stopping
                        raise
                    inst.stats["shadow_aborted_by_routed"] += 1
                    continue
                if r.status_code == 200:
                    inst.stats[kind + "_completed"] += 1
                    inst.holds(task.session_key, body)
                    inst.shadowed.add(task.session_key)
                else:
                    inst.stats["shadow_failed"] += 1
                    inst.last_error = f"shadow HTTP {r.status_code}: {r.text[:200]}"
            except httpx.ReadTimeout as exc:        # alive, but no answer in timeout_s: a shadow may wait behind
                inst.stats["shadow_timed_out"] += 1  # every routed call (the built-in server holds one up to
                inst.last_error = f"shadow: {exc!r} after {self.timeout_s} s"   # its shadow_wait_s): not down
            except (httpx.HTTPError, OSError) as exc:
                inst.stats["shadow_failed"] += 1
                inst.mark_down(f"shadow: {exc!r}", self.dead_retry_s)
            finally:
                self.in_flight, self._post = None, None
