"""Bind mode's settings: the bound endpoint, topic templates, the replay template, the relay.

On a bound endpoint many publishers connect to one SUB, and a SUB does not say which peer sent a
frame; the topic does. llm-d's deployments set each engine's topic to `kv@<pod-ip>:<port>@<model>`
and read the pod and the model back from it. A template is literal text with the fields `{pod}`
(required: each pod is its own stream) and `{model}`; a plain topic (no field) is a prefix, as in
connect mode. A replay endpoint may name the pod's address as `{pod_ip}` (`tcp://{pod_ip}:5559`), and a
`metrics_url` the pod's `{pod}` or `{pod_ip}` (`http://{pod_ip}:8000/metrics`): each pod's engine is
scraped at its own address.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field

from kvobserve.config.model import ConfigError, WorkerConfig
from kvobserve.config.values import (
    at_least,
    check_url,
    check_zmq_endpoint,
    is_wildcard,
    split_host_port,
)

TOPIC_FIELDS = ("pod", "model")
REPLAY_FIELDS = ("pod_ip",)
POD_URL_FIELDS = ("pod", "pod_ip")  # a metrics_url for each pod
_FIELD = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True)
class TopicTemplate:
    """A parsed `topic`: its subscription prefix and, with fields, how to read them back."""

    text: str
    prefix: str  # the literal text before the first field: what the topic must start with
    fields: tuple[str, ...] = ()
    _regex: re.Pattern[str] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def parse(cls, text: str, where: str) -> TopicTemplate:
        """`text` as a template; ConfigError naming `where` and the value when it is not one."""
        names = _FIELD.findall(text)
        if not names:
            if "{" in text or "}" in text:
                raise ConfigError(f"{where}: unbalanced brace in {text!r}")
            return cls(text, text)
        bad = [n for n in names if n not in TOPIC_FIELDS]
        if bad:
            raise ConfigError(
                f"{where}: unknown field {{{bad[0]}}} in {text!r}; a topic template has "
                + " and ".join(f"{{{f}}}" for f in TOPIC_FIELDS)
            )
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: a field appears twice in {text!r}")
        if "pod" not in names:
            raise ConfigError(f"{where}: {text!r} has no {{pod}}: each publisher is one pod")
        parts = _FIELD.split(text)  # literal, name, literal, name, ..., literal
        if "{" in "".join(parts[::2]) or "}" in "".join(parts[::2]):
            raise ConfigError(f"{where}: unbalanced brace in {text!r}")
        if any(not lit for lit in parts[2:-1:2]):
            raise ConfigError(f"{where}: two fields without text between them in {text!r}")
        pattern = "".join(
            re.escape(p)
            if i % 2 == 0
            else f"(?P<{p}>.+?)"
            if i < len(parts) - 2
            else f"(?P<{p}>.+)"
            for i, p in enumerate(parts)
        )
        return cls(text, parts[0], tuple(names), re.compile(pattern + r"\Z", re.S))

    @property
    def templated(self) -> bool:
        """Whether the topic names each publisher (has fields)."""
        return self._regex is not None

    def match(self, topic: str) -> dict[str, str] | None:
        """The fields a topic carries ({} for a plain prefix it starts with); None: not ours."""
        if self._regex is None:
            return {} if topic.startswith(self.prefix) else None
        m = self._regex.match(topic)
        return m.groupdict() if m is not None else None


def pod_ip(pod: str) -> str:
    """The address part of a pod id `ip:port` (`[v6]:port` too); the id itself without a port."""
    if pod.startswith("["):
        host, sep, _ = pod[1:].partition("]")
        return host if sep else pod
    host, sep, port = pod.rpartition(":")
    return host if sep and port.isdigit() and ":" not in host else pod


def fill_pod(template: str, pod: str, ip: str | None = None) -> str:
    """`template` for one pod: `{pod}` its id (a topic's `{pod}`, a Kubernetes pod's name),
    `{pod_ip}` its address (by default the address part of the id; IPv6 in brackets)."""
    ip = pod_ip(pod) if ip is None else ip
    return template.replace("{pod_ip}", f"[{ip}]" if ":" in ip else ip).replace("{pod}", pod)


def pod_url_fields(text: str) -> list[str]:
    """The fields a URL template names (`{pod}`, `{pod_ip}`)."""
    return _FIELD.findall(text)


def check_pod_url(text: str, where: str) -> str:
    """A URL that may name `{pod}` and `{pod_ip}` (filled for each pod): valid once filled;
    ConfigError naming `where` and the value otherwise."""
    bad = [n for n in pod_url_fields(text) if n not in POD_URL_FIELDS]
    if bad:
        raise ConfigError(
            f"{where}: unknown field {{{bad[0]}}} in {text!r}; a URL may name "
            + " and ".join(f"{{{f}}}" for f in POD_URL_FIELDS)
            + ", filled for each pod"
        )
    check_url(fill_pod(text, "10.0.0.1:8000"), where)
    return text


def check_replay_template(text: str, where: str) -> str:
    """A replay endpoint whose only field is `{pod_ip}`; ConfigError naming `where` otherwise."""
    names = _FIELD.findall(text)
    bad = [n for n in names if n not in REPLAY_FIELDS]
    if bad:
        raise ConfigError(
            f"{where}: unknown field {{{bad[0]}}} in {text!r}; a replay endpoint may name "
            "{pod_ip}, the address of the pod in the topic"
        )
    return text


def bind_host_problem(endpoint: str) -> str | None:
    """Why this machine cannot bind `endpoint`, or None. libzmq binds a wildcard, a network
    interface's name, or an address of this machine (a name is resolved); the engines' endpoint
    names this machine from outside (`tcp://collector:5557`, a Service), which is often not
    something it can bind. Whether an address is this machine's is asked by binding a throwaway
    socket to it."""
    if not endpoint.startswith("tcp://"):
        return None
    host, port = split_host_port(endpoint[6:])
    if is_wildcard(host) or host in _interfaces():
        return None
    fix = f"bind tcp://*:{port} (every address of this machine; the engines connect to its name)"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return f"{host!r} in {endpoint!r} does not resolve here, so it cannot be bound: {fix}"
    if any(_local(info[0], str(info[4][0])) for info in infos):
        return None
    what = "is" if _is_ip(host) else f"is {', '.join(sorted({str(i[4][0]) for i in infos}))},"
    return (
        f"{host!r} in {endpoint!r} {what} not an address of this machine, so it cannot be "
        f"bound: {fix}"
    )


def _local(family: int, addr: str) -> bool:
    """Whether this machine has the address `addr` (a socket can bind it)."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((addr, 0))
    except OSError:
        return False
    return True


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _interfaces() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


def check_bind_worker(where: str, w: WorkerConfig) -> None:
    """The bind-mode keys of one SGLang/vLLM worker agree; ConfigError naming the field if not."""
    tpl = TopicTemplate.parse(w.topic, f"{where}.topic")
    replay = w.replay_endpoint or ""
    at_least(w.relay_queue, 1, f"{where}.relay_queue")
    if w.metrics_url and pod_url_fields(w.metrics_url) and not tpl.templated:
        raise ConfigError(
            f"{where}.metrics_url: {w.metrics_url!r} names a pod's field, filled for each pod; "
            f"pods are named by a topic template with {{pod}} ({where}.bind and {where}.topic "
            "= 'kv@{pod}@{model}') or found by [worker.kubernetes]"
        )
    if w.bind is None:
        if w.relay_to is not None:
            raise ConfigError(
                f"{where}.relay_to: {w.relay_to!r} forwards what a bound endpoint receives; "
                f"set {where}.bind too"
            )
        if tpl.templated:
            raise ConfigError(
                f"{where}.topic: {w.topic!r} is a template, which names each publisher that "
                f"connects to a bound endpoint; set {where}.bind too"
            )
        if "{" in replay:
            raise ConfigError(
                f"{where}.replay_endpoint: {replay!r} is a template; set {where}.bind and a "
                f"{where}.topic with {{pod}}"
            )
        return
    check_zmq_endpoint(w.bind, f"{where}.bind", ("tcp", "ipc"))
    if w.bind.startswith("tcp://") and split_host_port(w.bind[6:])[1] == 0:
        raise ConfigError(
            f"{where}.bind: port 0 in {w.bind!r}: the engines connect to a port they are given"
        )
    problem = bind_host_problem(w.bind) if w.leader else None  # only the leader binds
    if problem is not None:
        raise ConfigError(f"{where}.bind: {problem}")
    if w.kv_endpoint is not None:
        raise ConfigError(
            f"{where}.kv_endpoint: {w.kv_endpoint!r} with {where}.bind {w.bind!r}: the "
            "collector either connects to publishers that bind (kv_endpoint) or binds for "
            "publishers that connect (bind); pick one"
        )
    if replay:
        check_replay_template(replay, f"{where}.replay_endpoint")
        if "{pod_ip}" in replay and not tpl.templated:
            raise ConfigError(
                f"{where}.replay_endpoint: {replay!r} names {{pod_ip}}, which a topic template "
                f"with {{pod}} gives; {where}.topic is {w.topic!r}"
            )
        shown = fill_pod(replay, "10.0.0.1:8000")
        check_zmq_endpoint(shown, f"{where}.replay_endpoint", ("tcp", "ipc"))
        if shown.startswith("tcp://") and _wildcard(shown):
            raise ConfigError(
                f"{where}.replay_endpoint: wildcard host in {replay!r}: with bind the engines "
                "run elsewhere; give their address, or {pod_ip} with a topic template"
            )
    if w.relay_to is not None:
        check_zmq_endpoint(w.relay_to, f"{where}.relay_to", ("tcp", "ipc"))
        if w.relay_to.startswith("tcp://") and _wildcard(w.relay_to):
            raise ConfigError(
                f"{where}.relay_to: wildcard host in {w.relay_to!r}; give the address of the "
                "subscriber that binds there (llm-d's scheduler: tcp://<scheduler>:5556)"
            )
        if _same_endpoint(w.bind, w.relay_to, ranks := w.dp_size or 1):
            ports = f" (rank r binds and relays port + r, {ranks} ranks)" if ranks > 1 else ""
            raise ConfigError(
                f"{where}.relay_to: {w.relay_to!r} reaches {where}.bind {w.bind!r} on this "
                f"machine{ports}: every frame would come back"
            )


def _wildcard(endpoint: str) -> bool:
    return is_wildcard(split_host_port(endpoint.partition("://")[2])[0])


def _same_endpoint(bound: str, target: str, ranks: int) -> bool:
    """Whether relaying to `target` (rank r: port + r) reaches one of the `ranks` endpoints bound
    from `bound` on this host (the bound address itself, or loopback when every address is)."""
    if bound.startswith("ipc://") or target.startswith("ipc://"):
        return bound == target
    b_host, b_port = split_host_port(bound.partition("://")[2])
    t_host, t_port = split_host_port(target.partition("://")[2])
    local = t_host == "localhost" or (_is_ip(t_host) and _loopback(t_host))
    here = t_host == b_host or (is_wildcard(b_host) and local)
    return here and abs(b_port - t_port) < ranks


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.strip("[]")).is_loopback
