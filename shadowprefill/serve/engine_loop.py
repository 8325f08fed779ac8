"""The built-in server's engine loop: one `LLMEngine` on its `EngineDriver` thread, results to asyncio.

`LLMEngine` is not thread-safe, so the driver's thread owns it (`cluster.driver.EngineDriver`, the same
driver the simulator and the engine demo use). HTTP handlers (on the server's event loop) post commands
(`add`, `add_shadow`, `abort`) that the thread runs between iterations, and receive every
`RequestOutput` on the request's `asyncio.Queue` through `loop.call_soon_threadsafe`. A shadow
submission (`add_shadow`) resolves once this engine has nothing left to run for it: the job's whole pages
are cached, what is left is below the smallest chunk `n_min`, the job was dropped (a routed call of the
session arrived here), or `shadow_wait_s` passed. After each turn of the loop the thread refreshes
`snapshot`, the numbers `/metrics` exports, so a metrics scrape never waits for the engine. With a
`publisher` (`serve.kv_publisher`) the thread also announces what the KV cache holds as vLLM-format KV
events: a finished request's or settled shadow's pages, and evictions.
"""
from __future__ import annotations

import asyncio
import time

from shadowprefill.cluster.driver import EngineDriver
from shadowprefill.engine import LLMEngine
from shadowprefill.serve.kv_publisher import CacheTracker


class _Waiter:
    __slots__ = ("loop", "future", "session_id", "deadline", "prompt", "tenant")

    def __init__(self, loop, future, session_id: str, deadline: float, prompt=(), tenant: str = "") -> None:
        self.loop, self.future, self.session_id, self.deadline = loop, future, session_id, deadline
        self.prompt, self.tenant = prompt, tenant


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value=None, error=None) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    loop.call_soon_threadsafe(settle)


class EngineLoop:
    """Owns `engine` and steps it on an `EngineDriver` thread (`start()` / `stop()`)."""

    def __init__(self, engine: LLMEngine, shadow_wait_s: float = 60.0, idle_poll_s: float = 0.02,
                 publisher=None) -> None:
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
        self.engine = engine
        self.shadow_wait_s = float(shadow_wait_s)
        self.driver = EngineDriver(engine, on_outputs=self._deliver, on_turn=self._after_turn,
                                   on_error=self._crashed, idle_poll_s=idle_poll_s)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._waiters: list[_Waiter] = []
        self.snapshot: dict = {}
        self._refresh_snapshot()
        self.tracker = None if publisher is None else CacheTracker(engine, publisher)
        self._prompts: dict[str, tuple[list[int], str]] = {}       # request id -> (prompt, tenant), for events

    @property
    def error(self) -> str | None:
        return None if self.driver.error is None else repr(self.driver.error)

    # ------------------------------------------------------------------ called from the event loop
    async def add_request(self, request_id: str, prompt: list[int], max_tokens: int, priority: str,
                          session_id: str | None, tenant: str) -> asyncio.Queue:
        """Queue a request; returns the queue its RequestOutputs arrive on (ValueError/TypeError if refused)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, max_tokens, priority=priority, session_id=session_id,
                                        tenant=tenant)
            except (ValueError, TypeError) as exc:
                _resolve(loop, accepted, error=exc)
                return
            self._streams[request_id] = (loop, outputs)
            if self.tracker is not None:
                self._prompts[request_id] = (list(prompt), tenant)
            _resolve(loop, accepted, True)

        self.driver.post(add)
        await accepted
        return outputs

    async def add_shadow(self, session_id: str, prompt: list[int], tenant: str) -> int:
        """Make `prompt` the session's shadow target; returns the prompt tokens cached at submission and
        resolves when the engine has nothing left to run for it (see module docstring)."""
        loop = asyncio.get_running_loop()
        accepted, done = loop.create_future(), loop.create_future()

        def shadow() -> None:
            try:
                cached = self.engine.cached_prefix_tokens(prompt, tenant=tenant)[0]
                self.engine.add_shadow(session_id, prompt, tenant=tenant)
            except (ValueError, TypeError) as exc:
                _resolve(loop, accepted, error=exc)
                return
            _resolve(loop, accepted, cached)
            self._waiters.append(_Waiter(loop, done, session_id, time.monotonic() + self.shadow_wait_s,
                                         list(prompt), tenant))

        self.driver.post(shadow)
        cached = await accepted
        await done
        return cached

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            self._prompts.pop(request_id, None)
            if self._streams.pop(request_id, None) is not None:
                try:
                    self.engine.abort_request(request_id)
                except KeyError:
                    pass

        self.driver.post(abort)

    # ------------------------------------------------------------------------------- the thread
    def start(self) -> "EngineLoop":
        self.driver.start(name="engine-loop")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.driver.stop(timeout)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            if out.finished and self.tracker is not None and out.request_id in self._prompts:
                prompt, tenant = self._prompts.pop(out.request_id)
                self.tracker.settle(prompt + list(out.token_ids), tenant)
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, out)
            if out.finished:
                del self._streams[out.request_id]

    def _after_turn(self) -> None:
        self._refresh_snapshot()
        if self.tracker is not None:
            self.tracker.check(time.monotonic())
        if not self._waiters:
            return
        engine, now = self.engine, time.monotonic()
        need = engine.n_min
        keep = []
        for w in self._waiters:
            if engine.shadow_pending_tokens(w.session_id) < need or now >= w.deadline or w.future.done():
                if self.tracker is not None:
                    self.tracker.settle(w.prompt, w.tenant)
                _resolve(w.loop, w.future, True)
            else:
                keep.append(w)
        self._waiters = keep

    def _crashed(self, exc: BaseException) -> None:
        """A crashed engine fails its requests instead of hanging them."""
        for loop, queue in list(self._streams.values()):
            loop.call_soon_threadsafe(queue.put_nowait, RuntimeError("engine loop crashed"))
        for w in self._waiters:
            _resolve(w.loop, w.future, error=RuntimeError("engine loop crashed"))

    def _refresh_snapshot(self) -> None:
        engine = self.engine
        st = engine.stats
        self.snapshot = {**engine.load(), "prompt_tokens": st.prompt_tokens,
                         "cached_prompt_tokens": st.cached_prompt_tokens, "shadow_tokens": st.shadow_tokens,
                         "iterations": st.iterations, "busy_time_s": st.busy_time_s}
