"""Streamed shadows over HTTP (paper §3.1: incremental, streamed, sticky shadow jobs).

A routed call's history grows while its answer streams. Instead of one whole request after the call
(appendix D.1), the manager extends the session's shadow on the other models as the output grows: the
call's prompt when the call starts, then prompt + output so far every `shadow.stream_tokens` output tokens.

vLLM 0.32's resumable streaming-input requests (`StreamingUpdate`, `resumable`) are reachable only through
`AsyncLLM` and the realtime speech endpoint, not through the OpenAI completions API the manager talks to.
So each extension is a new shadow request for the longer history, with the same priority and `cache_salt`:
it supersedes the session's pending one on the dispatcher, waits for the one in flight, and resumes from
the prefix the server cached (vLLM's prefix cache; the ShadowScheduler plugin then computes only the new
blocks). Token-id histories are cut to the server's whole blocks, so each block is computed once
(`ShadowDispatcher._cut`). Where each extension goes is the control plane's decision for that history
(`ControlPlane.plan_shadows`), as for the whole request after the call, which still follows and adds the
tail. A routed call to the shadowed model drops the pending extension and aborts the one in flight.
"""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class ShadowStream:
    """The streamed shadows of one routed call of an append-only session.

    `body_of(response)`: the shadow request (path, body) for prompt + `response`; `targets`: (model,
    switch probability) of the request-level shadow homes (`CallTicket.deferred`); `every`: output tokens
    between extensions."""

    def __init__(self, manager, state, targets: list, body_of, every: int) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.manager, self.state, self.targets, self.body_of, self.every = manager, state, list(targets), body_of, every
        self.next_at = every              # output tokens at which the next extension is due
        self.extensions = 0               # histories planned (the prompt included)
        self._want = None                 # the newest history not planned yet
        self._worker: asyncio.Task | None = None
        self._closed = False

    def start(self) -> None:
        """The call was placed: shadow its prompt at once."""
        self._offer(self.body_of(None))

    def grow(self, n_out: int, response) -> None:
        """The answer has `n_out` output tokens; `response()` gives it (token ids or text) when due."""
        if self._closed or n_out < self.next_at:
            return
        self.next_at = (n_out // self.every + 1) * self.every
        self._offer(self.body_of(response()))

    async def close(self) -> None:
        """The call ended: pending plans are moot (the whole history follows, or nothing)."""
        self._closed = True
        self._want = None
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a plan failure never fails a call
                pass

    def abandon(self) -> None:
        """`close` without waiting (the call's handler is unwinding)."""
        self._closed, self._want = True, None
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()

    def _offer(self, history) -> None:
        if history is None or self._closed:
            return
        self._want = history
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        mgr, state = self.manager, self.state
        while self._want is not None and not self._closed:
            history, self._want = self._want, None
            try:
                plan = await mgr.gateway.plan_shadows(state, self.targets, history[1], mgr.config.shadow.cost_ratio)
            except Exception:  # noqa: BLE001 - planning failed: this extension is skipped, the next one retries
                log.exception("streamed shadow planning failed")
                continue
            if self._closed:
                return
            self.extensions += 1
            by_url = {i.url: i for i in mgr.all_instances()}
            for v in plan:
                if v.chosen:
                    inst = by_url[v.site]
                    inst.upsert_shadow(state, history, v.switch_prob, streamed=True)
                    state.shadow_on.add(inst)
