"""Run an aiohttp application on 127.0.0.1 in a background thread (tests, replay) or in the foreground (CLI).

`AppThread(make_app, host, port)` starts its own event loop in a daemon thread, builds the app there
(`make_app()` may be a coroutine function, for apps that create clients bound to that loop), binds the
port (0 = an ephemeral one, read back from `.port`) and serves until `stop()`. Start-up errors are raised
in the caller's thread.
"""
from __future__ import annotations

import asyncio
import inspect
import threading

from aiohttp import web


async def _build(make_app) -> web.Application:
    app = make_app()
    if inspect.isawaitable(app):
        app = await app
    if not isinstance(app, web.Application):
        raise TypeError(f"make_app must return an aiohttp web.Application, got {type(app).__name__}")
    return app


class AppThread:
    """An aiohttp app served from a daemon thread; `url` is its base URL once started."""

    def __init__(self, make_app, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self._make_app = make_app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.app: web.Application | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "AppThread":
        self._thread = threading.Thread(target=self._run, name=f"aiohttp-{self.port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error!r}") from self._error
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self.app = loop.run_until_complete(_build(self._make_app))
            self._runner = web.AppRunner(self.app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as exc:          # report to start(), then end the thread
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and open connections, run the app's cleanup, end the thread."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def __enter__(self) -> "AppThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(make_app, host: str, port: int) -> None:
    """Serve in the foreground until interrupted (the CLI's servers)."""
    async def build():
        return await _build(make_app)
    web.run_app(build(), host=host, port=port, access_log=None, print=lambda s: print(s, flush=True))
