"""A simulated Dynamo KV indexer: `GET /dump`, `POST /query`, `GET /health`, with injectable drift.

It is fed every RouterEvent the simulated Dynamo workers deliver on the event plane and keeps a
router's view per (worker_id, dp_rank, tier). Modes: `faithful` (applies everything at once),
`lag` (the last `lag_events` events of every rank are not applied yet), `lose_removals` (ignores
`removed` events), `miss_worker` (ignores one worker entirely). `injected()` says, against the
publishers' truth, how many phantom and missing blocks that makes. The answer formats are those
of Dynamo's standalone indexer (docs/dynamo.md "Drift"): the dump lists `stored` RouterEvents
of at most 64 blocks each (not walked as a radix tree: only the blocks matter to a reader).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvobserve.simulate import dynamo_encode as enc
from kvobserve.simulate.dynamo_relay import apply
from kvobserve.simulate.serve import ThreadedApp

ViewKey = tuple[int, int, str]  # (worker_id, dp_rank, tier)


class SimIndexer:
    """The router's view and the HTTP server that shows it."""

    def __init__(
        self,
        mode: str = "faithful",
        lag_events: int = 8,
        miss_worker_id: int | None = None,
        block_size: int = 16,
        model: str = "sim-model",
    ) -> None:
        self.mode, self.lag_events, self.miss_worker_id = mode, lag_events, miss_worker_id
        self.block_size, self.model = block_size, model
        self.lock = threading.Lock()
        self.view: dict[tuple[int, int], dict[str, set[int]]] = {}
        self._pending: dict[tuple[int, int], deque[tuple[Any, str]]] = {}
        self.events_seen = 0
        self.port = 0
        self._server: ThreadedApp | None = None

    # --- the router's view ------------------------------------------------------------------

    def feed(self, events: list[dict[str, Any]]) -> None:
        """RouterEvents of one delivered message (call with `lock` held)."""
        for ev in events:
            self.events_seen += 1
            key = (ev["worker_id"], ev["event"]["dp_rank"])
            if self.mode == "miss_worker" and key[0] == self.miss_worker_id:
                continue
            data, tier = ev["event"]["data"], ev.get("storage_tier", "device")
            if self.mode == "lose_removals" and isinstance(data, dict) and "removed" in data:
                continue
            if self.mode == "lag":
                q = self._pending.setdefault(key, deque())
                q.append((data, tier))
                if len(q) <= self.lag_events:
                    continue
                data, tier = q.popleft()
            apply(self.view.setdefault(key, {}), data, tier)

    def blocks(self) -> dict[ViewKey, set[int]]:
        """(worker_id, dp_rank, tier) -> blocks, non-empty only (call with `lock` held)."""
        return {
            (w, r, t): set(b) for (w, r), tiers in self.view.items() for t, b in tiers.items() if b
        }

    def injected(self, truth: dict[ViewKey, set[int]]) -> dict[str, dict[str, int]]:
        """Per `worker/rank/tier`: router and engine blocks, phantom and missing, vs `truth`."""
        mine = self.blocks()
        out = {}
        for key in sorted(mine.keys() | {k for k, b in truth.items() if b}):
            r, e = mine.get(key, set()), truth.get(key, set())
            out["/".join(map(str, key))] = {
                "router_blocks": len(r),
                "engine_blocks": len(e),
                "phantom": len(r - e),
                "missing": len(e - r),
            }
        return out

    def dump(self) -> dict[str, Any]:
        """The `/dump` document."""
        with self.lock:
            blocks = self.blocks()
        events, eid = [], 0
        for (w, r, tier), hashes in sorted(blocks.items()):
            ordered = sorted(hashes)
            for i in range(0, len(ordered), 64):
                chunk = [enc.block(h, h ^ 0x5A5A5A5A5A5A5A5A) for h in ordered[i : i + 64]]
                events.append(enc.router_event(w, eid, enc.stored(chunk), r, storage_tier=tier))
                eid += 1
        return {f"{self.model}:default": {"block_size": self.block_size, "events": events}}

    def tree_sizes(self) -> dict[str, dict[str, int]]:
        """`/query`'s tree_sizes: device-tier blocks per worker and rank."""
        with self.lock:
            return {
                str(w): {str(r): len(t.get("device", ()))}
                for (w, r), t in sorted(self.view.items())
            }

    # --- HTTP ---------------------------------------------------------------------------------

    def start(self, host: str, port: int) -> int:
        """Serve on host:port (0 = a free port) in a thread of its own; returns the port."""
        self._server = ThreadedApp(host, port, "sim-indexer", "indexer_port")
        self.port = self._server.start(self._app)
        return self.port

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/dump", self._json(self.dump))
        app.router.add_post("/query", self._json(self._query))
        app.router.add_get("/health", self._json(lambda: {"status": "ok"}))
        return app

    @staticmethod
    def _json(body: Callable[[], Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            return web.Response(text=json.dumps(body()), content_type="application/json")

        return handle

    def _query(self) -> dict[str, Any]:
        return {"scores": {}, "frequencies": [], "tree_sizes": self.tree_sizes()}

    def stop(self) -> None:
        """Stop serving; idempotent."""
        if self._server is not None:
            self._server.stop()
