"""The NATS client's TLS context and its start-up error (kvobserve/transport/nats.py)."""

from __future__ import annotations

import ssl


class NatsConnectError(Exception):
    """The first connection (or the KV bucket) could not be set up; the message says why."""


def build_ssl_context(
    ca: str | None, cert: str | None, key: str | None, *, force: bool = False
) -> ssl.SSLContext | None:
    """A client TLS context from PEM files; None when no TLS is asked for."""
    if not (ca or cert or key or force):
        return None
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise NatsConnectError(f"nats tls_ca {ca!r}: cannot load: {exc}") from None
    if cert or key:
        if not (cert and key):
            raise NatsConnectError("nats tls_cert/tls_key: set both or neither")
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise NatsConnectError(f"nats tls_cert {cert!r} / tls_key {key!r}: {exc}") from None
    return ctx
