"""Follow the pods of a label selector through the Kubernetes API (`[worker.kubernetes]`).

List the pods, then watch from the list's resourceVersion, so that no change between the two is
missed. A watch that ends or breaks resumes from the last resourceVersion seen, after a backoff
when it failed; one that expired (410 Gone, as an HTTP status or an ERROR event) lists the pods
again and reconciles: pods deleted while nobody watched are dropped then. A failure is a state
with a reason (`connecting`, `down`), never an exception out of the task.

Which pods are streams (the rule, docs/kubernetes.md): a pod becomes one when it is Running and
Ready with an IP; it stays one while it keeps that IP, is not terminating (deletionTimestamp) and
has not ended (Succeeded, Failed), Ready or not: a readiness probe that fails under load does not
stop the engine's publisher, and dropping the stream would lose its events and block index.

The client is lightkube (the `kubernetes` extra): pods decode into msgspec structs, an expired
watch surfaces as ApiError 410, and a service-account token that rotates is read again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvobserve.aio import cancel_and_wait
from kvobserve.config import KubernetesConfig
from kvobserve.config.kubernetes import parse_selector
from kvobserve.sources.health import Health
from kvobserve.sources.stream_events import RecentEvents

if TYPE_CHECKING:
    from lightkube import AsyncClient
    from lightkube.resources.core_v1 import Pod

log = logging.getLogger(__name__)
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
RBAC_HINT = "a Role with get, list and watch on pods (deploy/kubernetes/llm-d-per-pod/rbac.yaml)"

OnPods = Callable[[dict[str, str]], Awaitable[None] | None]  # the streaming pods: name -> IP


def _ready(pod: Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _ip(pod: Pod) -> str:
    return (pod.status.podIP if pod.status else None) or ""


def _ended(pod: Pod) -> bool:
    """Terminating, or every container ended: its publisher is going or gone."""
    meta, status = pod.metadata, pod.status
    return bool(meta and meta.deletionTimestamp) or (
        status is not None and status.phase in ("Succeeded", "Failed")
    )


def streams_of(pods: dict[str, Pod], current: dict[str, str]) -> dict[str, str]:
    """The pods that are streams now (name -> IP), given those that were (`current`)."""
    out = {}
    for name, pod in pods.items():
        ip = _ip(pod)
        if not ip or _ended(pod):
            continue
        running = pod.status is not None and pod.status.phase == "Running"
        if current.get(name) == ip or (running and _ready(pod)):  # a stream stays, Ready or not
            out[name] = ip
    return out


def _status_code(exc: BaseException) -> int | None:
    """The HTTP status of an API error (lightkube's ApiError or an HTTP status error)."""
    from lightkube import ApiError

    if isinstance(exc, ApiError) and exc.status is not None:
        return exc.status.code
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) if response is not None else None


def _message(exc: BaseException) -> str:
    from lightkube import ApiError

    if isinstance(exc, ApiError) and exc.status is not None and exc.status.message:
        return exc.status.message
    response = getattr(exc, "response", None)  # a status whose body was not read (a watch)
    if response is not None and getattr(response, "reason_phrase", None):
        return str(response.reason_phrase)
    return str(exc) or type(exc).__name__


class PodWatch:
    """Lists and watches the pods of one `[worker.kubernetes]` table; `on_change` gets the
    streaming pods (name -> IP) each time that set changes."""

    def __init__(
        self,
        worker_id: str,
        cfg: KubernetesConfig,
        *,
        on_change: OnPods | None = None,
        events: RecentEvents | None = None,
        service_account: str = SERVICE_ACCOUNT,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        watch_timeout_s: float = 290.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.worker_id, self.cfg = worker_id, cfg
        self.on_change, self.events = on_change, events
        self.service_account = service_account
        self.backoff_s, self.watch_timeout_s = backoff_s, watch_timeout_s
        self._wall = wall
        # (key, operator) pairs, which lightkube's selector builder takes as well as a dict
        # (its signature says dict): a selector may name a key twice (`tier!=a,tier!=b`)
        self._labels = [
            (k, _operator(op, values)) for k, op, values in parse_selector(cfg.selector, "selector")
        ]
        self.namespace = cfg.namespace  # the client's, when the config has none (at start)
        self.server = ""  # the API server, once the client is configured
        self.health = Health(f"pod discovery of {worker_id}", "starting", "listing pods", wall())
        self.pods: dict[str, Pod] = {}  # every selected pod, as last seen
        self.streams: dict[str, str] = {}  # the streaming pods: name -> IP
        self.resource_version: str | None = None
        self.lists_total = self.watch_events_total = self.expired_total = 0
        self.errors_total = 0
        self._client: AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def where(self) -> str:
        """What is watched, for the source table: server, namespace and selector."""
        ns = self.namespace or "(the client's namespace)"
        return f"{self.server or 'kubernetes'} pods in {ns} -l {self.cfg.selector}"

    async def start(self) -> None:
        """Start listing and watching in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"pods {self.worker_id}")

    async def close(self) -> None:
        """Stop watching and close the client; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def list_once(self, timeout_s: float = 5.0) -> None:
        """One list and no watch (`kvobserve check`); raises what the list raised; closes."""
        try:
            client = self._client or self._connect()
            async with asyncio.timeout(timeout_s):
                await self._list(client)
        finally:
            await self.close()

    def summary(self) -> list[dict[str, Any]]:
        """Every selected pod as last seen: name, IP, phase, Ready, streaming."""
        return [
            {
                "name": name,
                "ip": _ip(pod) or None,
                "phase": (pod.status.phase if pod.status else None) or "Unknown",
                "ready": _ready(pod),
                "terminating": bool(pod.metadata and pod.metadata.deletionTimestamp),
                "stream": name in self.streams,
            }
            for name, pod in sorted(self.pods.items())
        ]

    # --- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                client = self._client or self._connect()
                if self.resource_version is None:
                    await self._list(client)
                await self._watch(client)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is a state with a reason; retried
                failures += 1
                self.errors_total += 1
                low, high = self.backoff_s
                delay = min(high, low * 2 ** (failures - 1))
                state, reason = self.describe(exc)  # logged once while it stays the same
                self.health.set(state, reason, self._wall())
                await asyncio.sleep(delay)

    def _connect(self) -> AsyncClient:
        """The client, from the configured kubeconfig or (in a pod) the service account."""
        from lightkube import AsyncClient, ConfigError, KubeConfig

        k = self.cfg
        if k.kubeconfig:
            config = KubeConfig.from_file(k.kubeconfig)
        else:  # as kubectl: in a pod its service account, else $KUBECONFIG (its first file)
            try:
                config = KubeConfig.from_service_account(self.service_account)
            except (ConfigError, KeyError):  # no account, or no KUBERNETES_SERVICE_HOST
                path = (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0]
                config = KubeConfig.from_file(path or "~/.kube/config")
        client = AsyncClient(config=config, namespace=k.namespace or None)
        self.namespace = client.namespace
        single = config.get()
        self.server = str(single.cluster.server) if single is not None else ""
        self._client = client
        return client

    async def _list(self, client: AsyncClient) -> None:
        """Every selected pod now; reconcile with what was known."""
        from lightkube.resources.core_v1 import Pod

        ns, labels = self.namespace, self._labels
        listed = client.list(Pod, namespace=ns, labels=labels)  # type: ignore[call-overload]
        pods = {p.metadata.name: p async for p in listed if p.metadata and p.metadata.name}
        self.resource_version = listed.resourceVersion
        self.lists_total += 1
        self.pods = pods  # a pod deleted since the last list is gone from it
        await self._update()

    async def _watch(self, client: AsyncClient) -> None:
        """Apply watch events until the watch ends (resume) or expires (list again)."""
        from lightkube.resources.core_v1 import Pod

        stream = client.watch(  # type: ignore[call-overload]
            Pod,
            namespace=self.namespace,
            labels=self._labels,
            resource_version=self.resource_version,
            server_timeout=int(self.watch_timeout_s),
        ).__aiter__()
        try:
            while True:
                try:  # a watch that goes silent past the server's own timeout is dead
                    kind, pod = await asyncio.wait_for(
                        stream.__anext__(), self.watch_timeout_s + 15
                    )
                except TimeoutError:
                    return  # resume from the last resourceVersion
                except StopAsyncIteration:
                    return
                self._apply(kind, pod)
                await self._update()
        except Exception as exc:
            if _status_code(exc) != 410:
                raise
            self.expired_total += 1
            self._event(f"watch expired (410 Gone: {_message(exc)}); listing the pods again")
            log.info("pods of %s: watch expired (%s); listing again", self.worker_id, exc)
            self.resource_version = None
        finally:
            await stream.aclose()

    def _apply(self, kind: str, pod: Pod) -> None:
        meta = pod.metadata
        if meta is None:
            return
        self.watch_events_total += 1
        self.resource_version = meta.resourceVersion or self.resource_version
        if kind == "BOOKMARK" or not meta.name:
            return
        if kind == "DELETED":
            self.pods.pop(meta.name, None)
        else:
            self.pods[meta.name] = pod

    async def _update(self) -> None:
        """The health and, when the streaming pods changed, the callback."""
        new = streams_of(self.pods, self.streams)
        old, self.streams = self.streams, new
        for name in sorted(old.keys() - new.keys()):
            pod = self.pods.get(name)
            why = "deleted" if pod is None else "terminating" if _ended(pod) else "lost its IP"
            self._event(f"pod {name} {why}: its streams end", name)
        for name in sorted(new.keys() - old.keys()):
            self._event(f"pod {name} Running and Ready at {new[name]}: watching it", name)
        if new != old and self.on_change is not None:  # planned first: `up` means watched
            result = self.on_change(dict(new))
            if inspect.isawaitable(result):
                await result
        state = "up" if new else "undiscovered"
        reason = f"watching: {len(new)} of {len(self.pods)} selected pods stream"
        if not new:
            reason = f"watching: none of {len(self.pods)} selected pods is Running and Ready"
        self.health.set(state, reason, self._wall())

    # --- reporting ------------------------------------------------------------------------------

    def _event(self, message: str, pod: str = "") -> None:
        if self.events is not None:
            wid = f"{self.worker_id}/{pod}" if pod else self.worker_id
            self.events.add("discovery", message, worker_id=wid)

    def describe(self, exc: BaseException) -> tuple[str, str]:
        """(state, reason) of a failed list or watch."""
        from lightkube import ConfigError

        server = self.server or "the API server"
        if isinstance(exc, ConfigError):
            return "down", (
                f"no Kubernetes client configuration ({exc}): outside a pod, set "
                "[worker.kubernetes] kubeconfig or $KUBECONFIG"
            )
        code = _status_code(exc)
        if code in (401, 403):
            what = "refused the credentials" if code == 401 else "forbids it"
            return "down", (
                f"HTTP {code} listing pods in {self.namespace}: {server} {what} "
                f"({_message(exc)}); the service account needs {RBAC_HINT}"
            )
        if code is not None:
            return "down", f"HTTP {code} from {server}: {_message(exc)}"
        if isinstance(exc, OSError | TimeoutError) or "Connect" in type(exc).__name__:
            return "connecting", f"cannot reach {server}: {_message(exc)}"
        if type(exc).__module__.startswith(("httpx", "httpcore")):
            return "connecting", f"{server}: {type(exc).__name__}: {_message(exc)}"
        log.warning("pods of %s: %s", self.worker_id, exc, exc_info=exc)
        return "down", f"{type(exc).__name__}: {_message(exc)}"


def _operator(op: str, values: tuple[str, ...]) -> Any:
    """A lightkube selector operator for one parsed requirement."""
    from lightkube import operators

    if op == "=":
        return operators.equal(values[0])
    if op == "!=":
        return operators.not_equal(values[0])
    if op == "in":
        return operators.in_(values)
    if op == "notin":
        return operators.not_in(values)
    return operators.exists() if op == "exists" else operators.not_exists()
