"""A Kubernetes API server for pods on 127.0.0.1, playing recorded responses (tests/fixtures/kubernetes).

It speaks the list/watch protocol as kube-apiserver does: `GET /api/v1/namespaces/NS/pods` lists
the pods matching `labelSelector` with the collection's resourceVersion; with `watch=true` it
streams one JSON watch event per line (chunked) after `resourceVersion`, until `timeoutSeconds`;
a resourceVersion older than the history it keeps is answered with an ERROR event carrying a
410 Expired Status. The test drives it: `apply` a recorded event (pushed to open watches), or
`expire` (apply events no watch sees, forget the history, end the open watches), as a cluster
whose etcd compacted while the client was away.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from kvobserve.simulate.ports import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubernetes"
Obj = dict[str, Any]


def recorded_list() -> Obj:
    """The PodList the API server answered first."""
    return json.loads((FIXTURES / "pods-list.json").read_text())


def recorded_events() -> list[Obj]:
    """The watch events that followed, one per line as streamed."""
    return [json.loads(line) for line in (FIXTURES / "pods-watch.jsonl").read_text().splitlines()]


def recorded_expiry() -> Obj:
    """The ERROR event of a watch from a compacted resourceVersion."""
    return json.loads((FIXTURES / "watch-expired.json").read_text())


def _requirements(selector: str) -> list[tuple[str, str, set[str]]]:
    """`k=v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`: the forms a client sends."""
    out = []
    for part in re.split(r",(?![^(]*\))", selector):
        part = part.strip()
        if m := re.fullmatch(r"(\S+?)\s+(in|notin)\s+\((.*)\)", part):
            out.append((m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}))
        elif m := re.fullmatch(r"(\S+?)(!=|==|=)(\S*)", part):
            out.append((m.group(1), "!=" if m.group(2) == "!=" else "=", {m.group(3)}))
        elif part:
            out.append((part.lstrip("!"), "!" if part.startswith("!") else "exists", set()))
    return out


def selected(pod: Obj, selector: str) -> bool:
    """Whether a pod's labels satisfy every requirement of the selector."""
    labels = pod["metadata"].get("labels", {})
    for key, op, values in _requirements(selector):
        has, value = key in labels, labels.get(key)
        ok = {
            "=": has and value in values,
            "!=": not has or value not in values,
            "in": has and value in values,
            "notin": not has or value not in values,
            "exists": has,
            "!": not has,
        }[op]
        if not ok:
            return False
    return True


def _json(doc: Obj, status: int = 200) -> web.Response:
    """A JSON body with the API server's exact Content-Type (no charset: lightkube compares)."""
    return web.Response(
        body=json.dumps(doc).encode(), status=status, headers={"Content-Type": "application/json"}
    )


class RecordedApi:
    """The API server; `requests` records (verb, query) of every pods request."""

    def __init__(
        self,
        namespace: str = "llm-d",
        *,
        token: str | None = None,
        tls: tuple[str, str] | None = None,
        listing: Obj | None = None,
        port: int | None = None,
    ) -> None:
        self.namespace, self.token, self.tls = namespace, token, tls
        first = listing or recorded_list()
        self.pods: dict[str, Obj] = {p["metadata"]["name"]: p for p in first["items"]}
        self.rv = int(first["metadata"]["resourceVersion"])
        self.history: list[tuple[int, Obj]] = []  # (resourceVersion, watch event)
        self.compacted = self.rv  # a watch from before this gets 410
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.forbidden = False  # answer 403 (no RBAC) while set
        self._watches: set[asyncio.Queue[Obj | None]] = set()
        self._closing = False
        self._runner: web.AppRunner | None = None
        self.port = port or free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> RecordedApi:
        """Serve on 127.0.0.1 (HTTPS with `tls`)."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*self.tls)
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=ctx).start()
        return self

    async def close(self) -> None:
        """End every watch and stop serving."""
        self._closing = True  # a watch that comes in now ends at once
        for q in list(self._watches):
            q.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def kubeconfig(self, path: Path, ca: str | None = None) -> Path:
        """A kubeconfig file pointing at this server (namespace in its context)."""
        cluster: Obj = {"server": self.url}
        if ca:
            cluster["certificate-authority"] = ca
        user = {"token": self.token} if self.token else {}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "recorded", "cluster": cluster}],
            "users": [{"name": "tester", "user": user}],
            "contexts": [
                {
                    "name": "recorded",
                    "context": {
                        "cluster": "recorded",
                        "user": "tester",
                        "namespace": self.namespace,
                    },
                }
            ],
            "current-context": "recorded",
        }
        path.write_text(json.dumps(doc))  # JSON is YAML
        return path

    # --- driving it -----------------------------------------------------------------------------

    def _record(self, event: Obj) -> Obj:
        event = copy.deepcopy(event)
        pod = event["object"]
        self.rv = int(pod["metadata"]["resourceVersion"])
        name = pod["metadata"]["name"]
        if event["type"] == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod
        self.history.append((self.rv, event))
        return event

    def apply(self, event: Obj) -> None:
        """One recorded event: the cluster changes, every open watch is told."""
        recorded = self._record(event)
        for q in self._watches:
            q.put_nowait(recorded)

    def expire(self, events: list[Obj] = ()) -> None:  # type: ignore[assignment]
        """`events` happen unwatched, the history is compacted, and open watches end: the next
        watch from an older resourceVersion gets 410 Gone."""
        for e in events:
            self._record(e)
        self.compacted = self.rv
        self.history.clear()
        for q in list(self._watches):
            q.put_nowait(None)

    # --- serving --------------------------------------------------------------------------------

    def _status(self, code: int, reason: str, message: str) -> web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code}  # fmt: skip
        return _json(body, status=code)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        watch = query.get("watch") in ("true", "1")
        self.requests.append(("watch" if watch else "list", query))
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return self._status(401, "Unauthorized", "Unauthorized")
        ns = request.match_info["namespace"]
        if self.forbidden:
            msg = (f'pods is forbidden: User "system:serviceaccount:{ns}:kvobserve" cannot '
                   f'{"watch" if watch else "list"} resource "pods" in API group "" in the '
                   f'namespace "{ns}"')  # fmt: skip
            return self._status(403, "Forbidden", msg)
        selector = query.get("labelSelector", "")
        if not watch:  # another namespace has none of these pods
            items = [p for p in self.pods.values() if selected(p, selector)]
            meta = {"resourceVersion": str(self.rv)}
            doc = {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}
            return _json(doc if ns == self.namespace else {**doc, "items": []})
        if ns != self.namespace:
            selector = "kube-api.test/other-namespace"  # no pod has it: nothing is streamed
        return await self._watch(request, selector, query)

    async def _watch(
        self, request: web.Request, selector: str, query: dict[str, str]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        since = int(query.get("resourceVersion") or self.rv)
        if since < self.compacted:
            error = recorded_expiry()
            error["object"]["message"] = f"too old resource version: {since} ({self.rv})"
            await resp.write(json.dumps(error).encode() + b"\n")
            return resp
        q: asyncio.Queue[Obj | None] = asyncio.Queue()
        if self._closing:
            return resp
        self._watches.add(q)
        try:
            for rv, event in self.history:
                if rv > since:
                    q.put_nowait(event)
            timeout = float(query.get("timeoutSeconds") or 1800)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while (event := await q.get()) is not None:
                        if selected(event["object"], selector):
                            await resp.write(json.dumps(event).encode() + b"\n")
        finally:
            self._watches.discard(q)
        return resp


@contextlib.contextmanager
def serving_in_thread(**kw: Any) -> Iterator[RecordedApi]:
    """A RecordedApi on its own event loop in a thread, for tests that run kvobserve processes."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="recorded-api", daemon=True)
    thread.start()
    api = RecordedApi(**kw)
    try:
        asyncio.run_coroutine_threadsafe(api.start(), loop).result(timeout=10)
        yield api
    finally:
        asyncio.run_coroutine_threadsafe(api.close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()
