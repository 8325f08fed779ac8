"""One engine driver: steps an `LLMEngine` for the simulator, the engine demo and the built-in server.

An engine steps only when it has work, at its own pace, and each iteration's outputs go to whoever
orchestrates (the cluster core, an HTTP handler). Two ways to drive time:

- discrete events (the simulator, virtual clock): `begin()` schedules and executes one iteration if the
  engine is idle and has work, and returns it (`it.start + it.duration` is when it ends); the caller moves
  the clock there and calls `end()`, which applies it and returns its outputs;
- its own thread (the engine demo and the server, wall clock): `start()` runs `begin` / `end` in a daemon
  thread while the engine has work; other threads hand it work with `post(fn)` (run on that thread between
  iterations) or hold `lock` while they touch the engine, then `wake()` it. Each iteration's outputs go
  to `on_outputs(outputs)` outside the lock; `on_turn()` runs after every turn of the loop (an iteration,
  or an idle wait of at most `idle_poll_s`: shadow work blocked for a while is offered again). A crash
  ends the thread and is kept in `error`, and `on_error(exc)` tells the owner.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable


class EngineDriver:
    """Steps one engine (see module docstring). `busy_s`: seconds of iterations completed."""

    def __init__(self, engine, on_outputs: Callable | None = None, on_turn: Callable | None = None,
                 on_error: Callable | None = None, idle_poll_s: float = 0.02) -> None:
        if not (callable(getattr(engine, "schedule_step", None)) and callable(getattr(engine, "complete_step", None))):
            raise TypeError(f"engine must have schedule_step() and complete_step(it), got {type(engine).__name__}")
        if not idle_poll_s > 0:
            raise ValueError(f"idle_poll_s must be > 0, got {idle_poll_s!r}")
        self.engine = engine
        self.on_outputs, self.on_turn, self.on_error = on_outputs, on_turn, on_error
        self.idle_poll_s = float(idle_poll_s)
        self.iteration = None                  # the iteration begun and not ended yet
        self.busy_s = 0.0
        self.error: BaseException | None = None
        self.lock = threading.Lock()           # held by the thread while it steps or runs posted work
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ discrete events
    def begin(self):
        """Schedule and execute an iteration at the engine's `clock.now()` if none is in flight and the
        engine has work; returns it (None: nothing to run)."""
        if self.iteration is not None or not self.engine.has_work():
            return None
        self.iteration = self.engine.schedule_step()
        return self.iteration

    def end(self) -> list:
        """Apply the iteration begun last (the clock is at its end); returns its RequestOutputs."""
        it, self.iteration = self.iteration, None
        if it is None:
            raise RuntimeError("end() without an iteration in flight")
        self.busy_s += it.duration
        return self.engine.complete_step(it)

    # ----------------------------------------------------------------------------------- own thread
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, name: str = "engine-driver") -> "EngineDriver":
        if self.running:
            raise RuntimeError("the driver thread is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn()` on the driver's thread before its next iteration (RuntimeError if it is not running)."""
        if not self.running:
            raise RuntimeError(f"the engine driver is not running{': ' + repr(self.error) if self.error else ''}")
        self._posted.put(fn)
        self._wake.set()

    def wake(self) -> None:
        """New work was handed to the engine: stop waiting."""
        self._wake.set()

    def _run(self) -> None:
        clock = self.engine.clock
        try:
            while not self._stop.is_set():
                outputs = None
                with self.lock:
                    while True:                                  # work handed over by other threads
                        try:
                            self._posted.get_nowait()()
                        except queue.Empty:
                            break
                    it = self.begin()
                    if it is not None:
                        clock.advance(it.duration)               # a wall clock has moved by itself
                        outputs = self.end()
                if it is None:
                    self._wake.wait(self.idle_poll_s)
                    self._wake.clear()
                elif outputs and self.on_outputs is not None:
                    self.on_outputs(outputs)
                if self.on_turn is not None:
                    self.on_turn()
        except BaseException as exc:           # the owner fails its requests instead of hanging them
            self.error = exc
            if self.on_error is not None:
                self.on_error(exc)
            raise
