"""Throwaway TLS material for tests (openssl, installed by scripts/install-tools.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def self_signed(tmp: Path) -> tuple[str, str]:
    """A self-signed EC cert for 127.0.0.1 and its key in `tmp`: (cert path, key path)."""
    tmp.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    assert openssl, "openssl missing"
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return str(cert), str(key)
