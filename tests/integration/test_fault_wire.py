"""Fault matrix, wire side: hostile input found by fuzz/fuzz_wire.py must be counted or refused,
never crash a command or exhaust memory (each a bug in a module owned elsewhere: see the report
in docs/reliability.md)."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvobserve.wire.errors import WireError
from kvobserve.wire.snapshot import decode_snapshot, encode_snapshot
from tests.integration.conftest import make_snapshot
from tests.integration.fleet_helpers import ROOT

pytestmark = pytest.mark.integration

# NONE, LONG_BINPUT 2**31-1, STOP: the C unpickler sizes its memo to the index (32 GiB zeroed)
_MEMO_BOMB = b"\x80\x02Nr\xff\xff\xff\x7f."
_DECODE_IN_A_BOX = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # this box has 2 GiB of address space
from kvobserve.wire.scheduler import decode_kv_metrics
try:
    decode_kv_metrics(bytes.fromhex(sys.argv[1]), allow_pickle=True)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_opt_in_pickle_refuses_a_memo_bomb_before_allocating() -> None:
    # Without the 2 GiB box this 11-byte payload makes the decoder allocate tens of GB.
    out = subprocess.run(
        [sys.executable, "-c", _DECODE_IN_A_BOX, _MEMO_BOMB.hex()],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("WireError"), out.stdout
    assert "MemoryError" not in out.stdout, f"refused only because memory ran out: {out.stdout}"


def test_a_snapshot_with_invalid_utf8_is_a_wire_error() -> None:
    bad = encode_snapshot(make_snapshot("node-0")).replace(b"node-0", b"node-\xff")
    with pytest.raises(WireError) as exc:
        decode_snapshot(bad)
    assert exc.value.reason == "msgpack"


def test_tap_survives_a_batch_whose_lazy_fields_do_not_decode(tmp_path: Path) -> None:
    def event(slot7: bytes, tokens: bytes = b"\x92\x01\x02") -> bytes:
        # vLLM 0.23 array form: tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name
        return b"\x98\xabBlockStored\x91\x01\xc0" + tokens + b"\x10\xc0\xa3GPU" + slot7

    def line(seq: int, ev: bytes) -> str:
        payload = b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x91" + ev + b"\x00"
        frames = [b"kv", seq.to_bytes(8, "big"), payload]
        return json.dumps({"source": "live", "frames": [base64.b64encode(f).decode() for f in frames]})  # fmt: skip

    f = tmp_path / "frames.jsonl"
    f.write_text("\n".join([
        line(0, event(b"\xa4lora")),  # a good batch
        line(1, event(b"\xa2\xff\xfe")),  # lora_name: a str of invalid UTF-8
        line(2, event(b"\xc0", tokens=b"\x07")),  # token_ids: not an array
        line(3, event(b"\xc0")),  # a good batch
    ]) + "\n")  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "kvobserve", "tap", "--file", str(f), "--token-ids"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 0
    printed = [json.loads(x)["seq"] for x in out.stdout.splitlines()]
    assert printed[0] == 0 and printed[-1] == 3, "the good batches around the bad ones"
