"""Property tests: random and mutated Dynamo messages make the decoders raise WireError only."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import given

from kvobserve.simulate import dynamo_encode as enc
from kvobserve.wire import dynamo as d
from kvobserve.wire.dynamo_subject import parse_subject
from kvobserve.wire.errors import REASONS, WireError
from tests.unit.test_fuzz_decoders import FUZZ, SEEDS, _mutate, fuzz_frames, fuzz_payload

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo-captures"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


NATS = [
    (ln["subject"], base64.b64decode(ln["body"]))
    for v, f in [("1.6.1", "nats.jsonl"), ("1.2.1", "nats-event-plane.jsonl"),
                 ("1.2.1", "nats-jetstream.jsonl"), ("0.7.1", "nats-jetstream.jsonl")]
    for ln in _lines(ROOT / v / f)
]  # fmt: skip
ZMQ = [
    [base64.b64decode(f) for f in ln["frames"]]
    for ln in _lines(ROOT / "1.6.1" / "zmq-direct.jsonl")
]
BODIES = [b for _, b in NATS if b[:1] != b"{"]
PAYLOADS = [d.decode_envelope(b).payload for b in BODIES]
KV = [p for b, p in zip(BODIES, PAYLOADS, strict=True) if d.decode_envelope(b).topic == "kv-events"]
KV.append(enc.kv_events_payload([enc.router_event(1, 1, enc.tier_cleared("disk"), session_id="s")]))
JSON = [b for _, b in NATS if b[:1] == b"{"]
SUBJECTS = sorted({s for s, _ in NATS})


def _decode_all(msg: d.DynamoMessage) -> None:
    """Every payload decoder on the message, then the mapping (which must not raise at all)."""
    for decode in (d.decode_active_load, d.decode_fpm):
        try:
            decode(msg)
        except WireError as exc:
            assert exc.reason in REASONS
    events = d.decode_router_events(msg)
    d.to_batches(events, 1.0, 16)


def _nats(rng: random.Random) -> list[Any]:
    subject, body = rng.choice(NATS)
    if rng.random() < 0.2:
        subject = _mutate(rng, subject.encode()).decode("utf-8", "replace")
    body = fuzz_payload(rng, JSON if body[:1] == b"{" and rng.random() < 0.5 else BODIES)
    return [(lambda: _decode_all(d.decode_nats_message(subject, body)),)]


def _zmq(rng: random.Random) -> list[Any]:
    frames = fuzz_frames(rng, ZMQ)
    return [(lambda: _decode_all(d.decode_zmq_message(frames)),)]


def _payload(rng: random.Random) -> list[Any]:
    kv = fuzz_payload(rng, KV)
    other = fuzz_payload(rng, PAYLOADS)
    return [
        (lambda: _decode_all(d.DynamoMessage("kv-events", kv, "msgpack")),),
        (lambda: _decode_all(d.DynamoMessage("x", other, "msgpack")),),
        (
            lambda: _decode_all(
                d.DynamoMessage("kv-events", _mutate(rng, rng.choice(JSON)), "json")
            ),
        ),
    ]


def _subject(rng: random.Random) -> list[Any]:
    s = _mutate(rng, rng.choice(SUBJECTS).encode()).decode("utf-8", "replace")
    return [(lambda: parse_subject(s),)]


CASES: dict[str, Callable[[random.Random], list[Any]]] = {
    "nats": _nats,
    "zmq": _zmq,
    "payload": _payload,
    "subject": _subject,
}


def _outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except WireError as exc:
        assert exc.reason in REASONS
        return exc.reason
    except Exception as exc:
        raise AssertionError(f"raised {exc!r}") from exc
    return "ok"


@FUZZ
@given(seed=SEEDS)
def test_dynamo_decoders_raise_only_wire_error(seed: int) -> None:
    rng = random.Random(seed)
    for build in CASES.values():
        for (call,) in build(rng):
            _outcome(call)


def test_fuzz_inputs_reach_success_and_each_error_path() -> None:
    rng = random.Random(11)
    seen: dict[str, set[str]] = {name: set() for name in CASES}
    for _ in range(2000):
        for name, build in CASES.items():
            for (call,) in build(rng):
                seen[name].add(_outcome(call))
    assert {"ok", "msgpack", "schema"} <= seen["nats"], seen
    assert {"ok", "msgpack", "schema", "frame_count", "seq_length"} <= seen["zmq"], seen
    assert {"ok", "msgpack", "schema"} <= seen["payload"], seen
    assert {"ok", "schema"} <= seen["subject"], seen
