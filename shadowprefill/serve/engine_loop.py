"""The engine thread: steps one `LLMEngine` while it has work and hands results to asyncio handlers.

`LLMEngine` is not thread-safe, so one thread owns it. HTTP handlers (on the server's event loop) post
commands (`add`, `add_shadow`, `abort`) through a queue; the thread runs them between iterations and
delivers every `RequestOutput` to the request's `asyncio.Queue` through `loop.call_soon_threadsafe`.
A shadow submission (`add_shadow`) resolves once this engine has nothing left to run for it: the job's
whole pages are cached, what is left is below the smallest chunk `n_min`, the job was dropped (a routed
call of the session arrived here), or `shadow_wait_s` passed. After each iteration the thread refreshes
`snapshot`, the numbers `/metrics` exports, so a metrics scrape never waits for the engine.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback

from shadowprefill.engine import LLMEngine


class _Waiter:
    __slots__ = ("loop", "future", "session_id", "deadline")

    def __init__(self, loop, future, session_id: str, deadline: float) -> None:
        self.loop, self.future, self.session_id, self.deadline = loop, future, session_id, deadline


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
    """Owns `engine` and steps it in a daemon thread (`start()` / `stop()`)."""

    def __init__(self, engine: LLMEngine, shadow_wait_s: float = 60.0, idle_poll_s: float = 0.02) -> None:
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"engine must be an LLMEngine, got {type(engine).__name__}")
        self.engine = engine
        self.shadow_wait_s = float(shadow_wait_s)
        self.idle_poll_s = float(idle_poll_s)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._waiters: list[_Waiter] = []
        self.snapshot: dict = {}
        self.error: str | None = None
        self._refresh_snapshot()

    # ------------------------------------------------------------------ called from the event loop
    async def add_request(self, request_id: str, prompt: list[int], max_tokens: int, priority: str,
                          session_id: str | None, tenant: str) -> asyncio.Queue:
        """Queue a request; returns the queue its RequestOutputs arrive on (ValueError/TypeError if refused)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._post(("add", loop, accepted, outputs, request_id, prompt, max_tokens, priority, session_id, tenant))
        await accepted
        return outputs

    async def add_shadow(self, session_id: str, prompt: list[int], tenant: str) -> int:
        """Make `prompt` the session's shadow target; returns the prompt tokens cached at submission and
        resolves when the engine has nothing left to run for it (see module docstring)."""
        loop = asyncio.get_running_loop()
        accepted, done = loop.create_future(), loop.create_future()
        self._post(("shadow", loop, accepted, done, session_id, prompt, tenant))
        cached = await accepted
        await done
        return cached

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"the engine loop is not running{': ' + self.error if self.error else ''}")
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------------------- the thread
    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if engine.has_work():
                    for out in engine.step():
                        self._deliver(out)
                    self._refresh_snapshot()
                else:
                    self._refresh_snapshot()
                    self._wake.wait(self.idle_poll_s)
                    self._wake.clear()
                self._check_waiters()
        except BaseException:                # a crashed engine fails its requests instead of hanging them
            self.error = traceback.format_exc(limit=3)
            for loop, outputs in list(self._streams.values()):
                loop.call_soon_threadsafe(outputs.put_nowait, RuntimeError("engine loop crashed"))
            for w in self._waiters:
                _resolve(w.loop, w.future, error=RuntimeError("engine loop crashed"))
            raise

    def _drain_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, loop, accepted, outputs, rid, prompt, max_tokens, priority, session_id, tenant = cmd
                try:
                    engine.add_request(rid, prompt, max_tokens, priority=priority, session_id=session_id,
                                       tenant=tenant)
                except (ValueError, TypeError) as exc:
                    _resolve(loop, accepted, error=exc)
                    continue
                self._streams[rid] = (loop, outputs)
                _resolve(loop, accepted, True)
            elif kind == "shadow":
                _, loop, accepted, done, session_id, prompt, tenant = cmd
                try:
                    cached = engine.cached_prefix_tokens(prompt, tenant=tenant)[0]
                    engine.add_shadow(session_id, prompt, tenant=tenant)
                except (ValueError, TypeError) as exc:
                    _resolve(loop, accepted, error=exc)
                    continue
                _resolve(loop, accepted, cached)
                self._waiters.append(_Waiter(loop, done, session_id, time.monotonic() + self.shadow_wait_s))
            elif kind == "abort":
                rid = cmd[1]
                if self._streams.pop(rid, None) is not None:
                    try:
                        engine.abort_request(rid)
                    except KeyError:
                        pass

    def _deliver(self, out) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        loop, outputs = entry
        loop.call_soon_threadsafe(outputs.put_nowait, out)
        if out.finished:
            del self._streams[out.request_id]

    def _check_waiters(self) -> None:
        if not self._waiters:
            return
        engine, now = self.engine, time.monotonic()
        need = max(engine.config.n_min, 1)
        keep = []
        for w in self._waiters:
            if engine.shadow_pending_tokens(w.session_id) < need or now >= w.deadline or w.future.done():
                _resolve(w.loop, w.future, True)
            else:
                keep.append(w)
        self._waiters = keep

    def _refresh_snapshot(self) -> None:
        engine = self.engine
        st = engine.stats
        self.snapshot = {**engine.load(), "prompt_tokens": st.prompt_tokens,
                         "cached_prompt_tokens": st.cached_prompt_tokens, "shadow_tokens": st.shadow_tokens,
                         "iterations": st.iterations, "busy_time_s": st.busy_time_s}
