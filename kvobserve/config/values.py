"""Checks and conversions of single configuration values; errors name the field and the value."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from kvobserve.config.model import ConfigError

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", ""})  # bind-all: meaningless to connect to
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def split_host_port(text: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or ':port' -> (host without brackets, port); ValueError otherwise."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        sep = sep if ":" not in host else ""
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {text!r}")
    return host, int(port)


def check_type(value: Any, typ: type, field: str) -> Any:
    """A value of the declared type (an int is accepted as float; a bool is not an int)."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is list and isinstance(value, list):  # lists hold strings only (zmq_endpoints)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{field}[{i}]: expected str, got {item!r}")
        return value
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{field}: expected {typ.__name__}, got {value!r}")
    return value


def convert(value: Any, typ: type, field: str) -> Any:
    """A flag or env string converted to `typ`; non-strings are only type-checked."""
    if not isinstance(value, str) or typ is str:
        return check_type(value, typ, field)
    if typ is list:  # a flag or env value: comma-separated
        return [part.strip() for part in value.split(",") if part.strip()]
    text = value.strip().lower()
    try:
        return _BOOLS[text] if typ is bool else typ(text)
    except (KeyError, ValueError):
        raise ConfigError(f"{field}: expected {typ.__name__}, got {value!r}") from None


def did_you_mean(word: object, known: Iterable[str], cutoff: float = 0.6) -> str:
    """The hint "; did you mean 'x'?" for the known word closest to `word` ("": none is close)."""
    close = difflib.get_close_matches(str(word), list(known), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_choice(value: Any, allowed: Sequence[str], field: str) -> Any:
    """`value` when it is one of `allowed`; else an error naming them and the closest one."""
    if value in allowed:
        return value
    hint = did_you_mean(value, allowed)
    raise ConfigError(f"{field}: must be one of {', '.join(allowed)}, got {value!r}{hint}")


def at_least(value: Any, low: float, field: str, *, strict: bool = False) -> Any:
    """`value` when >= low (> low when strict)."""
    if value < low or (strict and value == low):
        raise ConfigError(f"{field}: must be {'>' if strict else '>='} {low}, got {value!r}")
    return value


def host_of(value: str, field: str, shown: str = "") -> str:
    """A 'host:port' with a host ('[::1]:9477' for IPv6); returns the host."""
    try:
        host, _ = split_host_port(value)
    except ValueError:
        host = ""
    if not host:
        raise ConfigError(f"{field}: expected {shown}host:port, got {shown + value!r}")
    return host


def check_url(value: str, field: str, schemes: tuple[str, ...] = ("http", "https")) -> str:
    """A URL of one of `schemes` with a host (and a numeric port, if any)."""
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises on a non-numeric or out-of-range port
    except ValueError:
        parts = urlsplit("")
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(f"{field}: expected {schemes[0]}://host[:port], got {value!r}")
    return value


def is_wildcard(host: str) -> bool:
    """A bind-all host (`*`, `0.0.0.0`, `::`) or none: in an endpoint, the node owning the rank."""
    return host.strip("[]") in WILDCARD_HOSTS


def check_zmq_endpoint(
    value: str, field: str, schemes: tuple[str, ...], *, wildcard_ok: bool = True
) -> str:
    """A ZMQ endpoint of one of `schemes`; tcp needs `host:port`, where the host may be a wildcard
    (`tcp://*:5557`, `tcp://:5557`): each collector then connects at its own `[collector] host`.
    `wildcard_ok=False` where nothing resolves a wildcard (Dynamo's ZMQ endpoints)."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in schemes:
        want = " or ".join(f"{s}://" for s in schemes)
        raise ConfigError(f"{field}: expected a {want} endpoint, got {value!r}")
    if scheme != "tcp" and not rest:
        raise ConfigError(f"{field}: empty {scheme} address in {value!r}")
    if scheme == "tcp":
        try:
            host, _ = split_host_port(rest)
        except ValueError:
            raise ConfigError(f"{field}: expected tcp://host:port, got {value!r}") from None
        if not wildcard_ok and is_wildcard(host):
            raise ConfigError(f"{field}: wildcard host in {value!r}; give the engine's address")
    return value


def check_host(value: str, field: str) -> str:
    """A host to connect to (name, IPv4 or IPv6, brackets dropped); not a wildcard."""
    host = value.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if is_wildcard(host) or any(c in host for c in "/[] \t"):
        raise ConfigError(
            f"{field}: expected the address this node's engines are reached at, got {value!r}"
        )
    return host


def check_subject_token(value: str, field: str) -> str:
    """Used in NATS subjects: letters, digits, '-' and '_' only."""
    if not _TOKEN.match(value):
        raise ConfigError(f"{field}: only letters, digits, '-' and '_' allowed, got {value!r}")
    return value


def check_pair(t: Mapping[str, Any], a: str, b: str, where: str) -> None:
    """Both of two settings or neither (secret values are not echoed)."""
    for x, y in ((a, b), (b, a)):
        if t.get(x) and not t.get(y):
            raise ConfigError(f"{where}.{y}: missing ({where}.{x} is set); set both or neither")
