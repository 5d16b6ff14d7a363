"""An aiohttp application served on a private event loop in a thread of its own (the simulator's
engine HTTP server and its Dynamo indexer)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from aiohttp import web


class ThreadedApp:
    """Serve `make_app()` on host:port (0 = a free port) until `stop()`."""

    def __init__(self, host: str, port: int, name: str, what: str) -> None:
        self.host = host
        self.port = port
        self._name = name  # the thread's name
        self._what = what  # the setting named in a bind error (http_port, indexer_port)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_ev: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self, make_app: Callable[[], web.Application]) -> int:
        """Serve in the background; the bound port (OSError if it cannot bind)."""
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main(make_app)), name=self._name, daemon=True
        )
        self._thread.start()
        self._ready.wait(5.0)
        if self._error is not None or self._loop is None:
            raise OSError(f"{self._what}: cannot serve on {self.host}:{self.port}: {self._error}")
        return self.port

    async def _main(self, make_app: Callable[[], web.Application]) -> None:
        runner = web.AppRunner(make_app(), access_log=None)
        try:
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = runner.addresses[0][1]
            self._loop = asyncio.get_running_loop()
            self._stop_ev = asyncio.Event()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            await runner.cleanup()
            return
        self._ready.set()
        await self._stop_ev.wait()
        await runner.cleanup()

    def stop(self) -> None:
        """Stop serving; idempotent."""
        if self._loop is not None and self._stop_ev is not None:
            self._loop.call_soon_threadsafe(self._stop_ev.set)
            self._loop = None
        if self._thread is not None:
            self._thread.join(2.0)
            self._thread = None
