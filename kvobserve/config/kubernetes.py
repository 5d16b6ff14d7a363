"""Checks of a `[[worker]]` with a `[worker.kubernetes]` table: its pods, found by a label selector.

Each Ready pod of the selector is a worker `{id}/{pod name}` (docs/kubernetes.md); the pod's IP
and the table's ports replace the endpoint keys of an engine worker.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

from kvobserve.config.bind import check_pod_url, pod_url_fields
from kvobserve.config.dynamo import ENGINE_STREAM_KEYS, reject_dynamo_keys
from kvobserve.config.model import ConfigError, KubernetesConfig, WorkerConfig
from kvobserve.config.values import at_least
from kvobserve.engines import PROFILES

EXTRA = "pip install 'kvobserve[kubernetes]'"
# Engine keys a pod worker does not take: the pods' addresses and the table's ports replace them
# (those of a Dynamo worker, but for the two that mean the same for every pod).
POD_REPLACED_KEYS = tuple(
    k for k in ENGINE_STREAM_KEYS if k not in ("probe_extra_ports", "version", "metrics_url")
)
TOPIC_FIELDS = ("pod", "pod_ip", "namespace")
# A requirement: (key, operator, values); operators =, !=, in, notin, exists, !exists.
Requirement = tuple[str, str, tuple[str, ...]]

# Label keys and values as the API server checks them: an optional DNS-subdomain prefix and a
# name of at most 63 characters; a value of at most 63 characters, possibly empty.
_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}"
_VALUE = rf"(?:{_NAME})?"
_EQUALITY = re.compile(rf"^({_KEY})\s*(==|!=|=)\s*({_VALUE})$")
_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s*\((.*)\)$")
_EXISTS = re.compile(rf"^(!?)\s*({_KEY})$")
_NAMESPACE = re.compile(r"^[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?$")


def _split(text: str) -> list[str]:
    """The requirements of a selector: commas outside parentheses separate them."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def parse_selector(text: str, field: str) -> tuple[Requirement, ...]:
    """A label selector (`app=vllm,tier!=cache,role in (decode,both),!canary`) as requirements."""
    if not text.strip():
        raise ConfigError(f"{field}: missing; a label selector such as 'app=vllm' (got {text!r})")
    out: list[Requirement] = []
    for part in _split(text):
        req = part.strip()
        if m := _EQUALITY.match(req):
            op = "!=" if m.group(2) == "!=" else "="
            out.append((m.group(1), op, (m.group(3),)))
        elif m := _SET.match(req):
            values = tuple(v.strip() for v in m.group(3).split(","))
            if not all(re.fullmatch(_VALUE, v) for v in values):
                raise ConfigError(f"{field}: bad values in {req!r} of selector {text!r}")
            out.append((m.group(1), m.group(2), values))
        elif m := _EXISTS.match(req):
            out.append((m.group(2), "!exists" if m.group(1) else "exists", ()))
        else:
            raise ConfigError(
                f"{field}: cannot read {req!r} in selector {text!r} (key=value, key!=value, "
                "key in (a,b), key notin (a,b), key or !key, comma-separated)"
            )
    return tuple(out)


def pod_topic(template: str, pod: str, pod_ip: str, namespace: str) -> str:
    """The subscription prefix of one pod: the template with its fields filled in."""
    return template.format(pod=pod, pod_ip=pod_ip, namespace=namespace)


def _check_topic(template: str, field: str) -> None:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc} in {template!r}") from None
    for name in names:
        if name not in TOPIC_FIELDS:
            raise ConfigError(
                f"{field}: unknown field {{{name}}} in {template!r}; "
                f"known: {', '.join('{' + f + '}' for f in TOPIC_FIELDS)}"
            )


def _has_client() -> bool:
    try:
        import lightkube  # noqa: F401 - only whether it imports
    except ImportError:
        return False
    return True


def build_kubernetes(where: str, k: dict[str, Any], dp_size: int) -> KubernetesConfig:
    """Validate one `[worker.kubernetes]` table (keys and types checked already)."""
    cfg = KubernetesConfig(**k)
    parse_selector(cfg.selector, f"{where}.selector")
    if cfg.namespace and not _NAMESPACE.match(cfg.namespace):
        raise ConfigError(f"{where}.namespace: not a Kubernetes namespace name: {cfg.namespace!r}")
    for key, low in (("port", 1), ("replay_port", 0)):
        value = at_least(getattr(cfg, key), low, f"{where}.{key}")
        if value + dp_size - 1 > 65535:
            raise ConfigError(f"{where}.{key}: {value} + {dp_size} ranks pass port 65535")
    ports = set(range(cfg.port, cfg.port + dp_size))
    if cfg.replay_port and ports & set(range(cfg.replay_port, cfg.replay_port + dp_size)):
        raise ConfigError(
            f"{where}.replay_port: {cfg.replay_port} overlaps the KV-event ports "
            f"{cfg.port}-{cfg.port + dp_size - 1} of {dp_size} ranks"
        )
    _check_topic(cfg.topic, f"{where}.topic")
    if cfg.kubeconfig and not Path(cfg.kubeconfig).expanduser().is_file():
        raise ConfigError(f"{where}.kubeconfig: no such file: {cfg.kubeconfig!r}")
    if not _has_client():
        raise ConfigError(
            f"{where}: pod discovery needs the Kubernetes client lightkube, which is not "
            f"installed: {EXTRA}"
        )
    return cfg


def build_kubernetes_worker(where: str, w: dict[str, Any], node_rank: int) -> WorkerConfig:
    """Validate one `[[worker]]` with a `[worker.kubernetes]` table; errors name the field."""
    engine = w.get("engine")
    pods = [n for n, p in PROFILES.items() if p.pods]
    if engine not in pods:
        raise ConfigError(
            f"{where}.engine: must be {' or '.join(map(repr, pods))} with [worker.kubernetes], "
            f"got {engine!r}"
        )
    reject_dynamo_keys(where, w, engine)
    for key in POD_REPLACED_KEYS:
        if key in w:
            instead = "set topic in [worker.kubernetes]" if key == "topic" else (
                "each Ready pod's IP and the ports of [worker.kubernetes] replace it"
            )  # fmt: skip
            raise ConfigError(
                f"{where}.{key}: not with [worker.kubernetes] ({w[key]!r}); {instead}"
            )
    if "metrics_url" in w:  # each pod's engine at its own address
        url = check_pod_url(w["metrics_url"], f"{where}.metrics_url")
        if not pod_url_fields(url):
            raise ConfigError(
                f"{where}.metrics_url: {url!r} would be every pod's; name the pod's address, "
                "e.g. 'http://{pod_ip}:8000/metrics' (filled for each pod)"
            )
    w.setdefault("id", engine)
    if "/" in w["id"] or not w["id"].strip():
        raise ConfigError(
            f"{where}.id: {w['id']!r}: must be non-empty without '/' (pods are '{{id}}/{{pod}}')"
        )
    dp_size = at_least(w.get("dp_size", 1), 1, f"{where}.dp_size")
    at_least(w.get("capacity_tokens", 0), 0, f"{where}.capacity_tokens")
    at_least(w.get("probe_extra_ports", 1), 0, f"{where}.probe_extra_ports")
    k = build_kubernetes(f"{where}.kubernetes", w.pop("kubernetes"), dp_size)
    return WorkerConfig(**{"leader": node_rank == 0, **w, "kubernetes": k})
