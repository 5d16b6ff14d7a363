"""Real Dynamo bytes (1.6.1, 1.2.1, 0.7.1): the decoder reads them as expected.json says, and
the simulator's encoder reproduces every one of them byte for byte."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate import dynamo_encode as enc
from kvobserve.wire import dynamo as d
from kvobserve.wire.dynamo_subject import parse_subject

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo-captures"
NATS_FILES = [
    ("1.6.1", "nats.jsonl", "nats"),
    ("1.2.1", "nats-event-plane.jsonl", "nats-event-plane"),
    ("1.2.1", "nats-jetstream.jsonl", "nats-jetstream"),
    ("0.7.1", "nats-jetstream.jsonl", "nats-jetstream"),
]


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def nats_cases() -> list[tuple[str, str, bytes, dict[str, Any]]]:
    out = []
    for version, name, key in NATS_FILES:
        expected = json.loads((ROOT / version / "expected.json").read_text())[key]
        lines = jsonl(ROOT / version / name)
        assert len(lines) == len(expected)
        for line, exp in zip(lines, expected, strict=True):
            out.append((version, line["subject"], base64.b64decode(line["body"]), exp))
    return out


def zmq_cases() -> list[tuple[list[bytes], dict[str, Any]]]:
    expected = json.loads((ROOT / "1.6.1" / "expected.json").read_text())["zmq-direct"]
    lines = jsonl(ROOT / "1.6.1" / "zmq-direct.jsonl")
    frames = [[base64.b64decode(f) for f in ln["frames"]] for ln in lines]
    return list(zip(frames, expected, strict=True))


NATS = nats_cases()
ZMQ = zmq_cases()


def check_payload(msg: d.DynamoMessage, payload: Any) -> None:
    """The typed decode of `msg` agrees with the generic decode of its payload."""
    if msg.topic == "kv-events":
        events = payload if isinstance(payload, list) else [payload]
        got = d.decode_router_events(msg)
        assert got.single == (not isinstance(payload, list))
        assert (got.unknown_keys, got.unknown_variants) == (0, 0)
        assert len(got.events) == len(events) > 0
        for ev, exp in zip(got.events, events, strict=True):
            assert ev.worker_id == exp["worker_id"]
            assert ev.tier == exp.get("storage_tier", "device")
            ce, data = ev.event, exp["event"]["data"]
            assert (ce.event_id, ce.dp_rank) == (exp["event"]["event_id"], exp["event"]["dp_rank"])
            if data == "cleared":
                assert ce.data == "cleared"
            elif "stored" in data:
                assert not isinstance(ce.data, str) and ce.data.stored is not None
                s = ce.data.stored
                assert [b.block_hash for b in s.blocks] == [
                    b["block_hash"] for b in data["stored"]["blocks"]
                ]
                assert s.parent_hash == data["stored"]["parent_hash"]
            else:
                assert not isinstance(ce.data, str) and ce.data.removed is not None
                r = ce.data.removed
                assert r.block_hashes == data["removed"]["block_hashes"]
    elif msg.topic == "kv_metrics":
        load = d.decode_active_load(msg)
        assert {k: getattr(load, k) for k in payload} == payload
    else:
        fpm = d.decode_fpm(msg)
        assert (fpm.worker_id, fpm.dp_rank, fpm.counter_id) == (
            payload["worker_id"],
            payload["dp_rank"],
            payload["counter_id"],
        )
        assert (
            fpm.scheduled_requests.sum_prefill_tokens
            == (payload["scheduled_requests"]["sum_prefill_tokens"])
        )


@pytest.mark.parametrize(("version", "subject", "body", "exp"), NATS)
def test_nats_capture_decodes_to_expected(
    version: str, subject: str, body: bytes, exp: dict[str, Any]
) -> None:
    msg = d.decode_nats_message(subject, body)
    assert msg.subject == parse_subject(subject)
    if exp["encoding"] == "json":
        assert msg.encoding == "json" and msg.topic == "kv-events"
        assert msg.publisher_id is None
        check_payload(msg, exp["router_event"])
        return
    env = exp["envelope"]
    assert (msg.topic, msg.publisher_id, msg.sequence, msg.published_at_ms) == (
        env["topic"],
        env["publisher_id"],
        env["sequence"],
        env["published_at"],
    )
    assert msg.unknown_keys == 0 and msg.published_at_ns is None
    assert msg.subject is not None and msg.subject.topic == msg.topic
    check_payload(msg, exp["payload"])


@pytest.mark.parametrize(("frames", "exp"), ZMQ)
def test_zmq_direct_capture_decodes_to_expected(frames: list[bytes], exp: dict[str, Any]) -> None:
    msg = d.decode_zmq_message(frames)
    assert msg.header_mismatch == ()
    assert (msg.topic, msg.publisher_id, msg.sequence) == (
        exp["topic_frame"],
        exp["publisher_id_frame"],
        exp["sequence_frame"],
    )
    check_payload(msg, exp["payload"])


def encode_router_event(ev: dict[str, Any], legacy: bool = False) -> dict[str, Any]:
    """Rebuild one RouterEvent with the encoder's builders from its decoded values."""
    e, data = ev["event"], ev["event"]["data"]
    if data == "cleared":
        built: Any = enc.CLEARED
    elif "stored" in data:
        s = data["stored"]
        blocks = [enc.block(b["block_hash"], b["tokens_hash"], legacy=legacy) for b in s["blocks"]]
        built = enc.stored(blocks, s["parent_hash"], s.get("start_position"), legacy=legacy)
    else:
        built = enc.removed(data["removed"]["block_hashes"])
    return enc.router_event(
        ev["worker_id"],
        e["event_id"],
        built,
        e["dp_rank"],
        storage_tier=ev.get("storage_tier"),
        residency_domain=ev.get("residency_domain"),
    )


def encode_payload(topic: str, p: Any) -> bytes:
    if topic == "kv-events":
        if isinstance(p, list):
            return enc.kv_events_payload([encode_router_event(e) for e in p])
        return enc.kv_events_payload([encode_router_event(p)], single=True)
    if topic == "kv_metrics":
        return enc.active_load(
            p["worker_id"],
            p["dp_rank"],
            p["active_decode_blocks"],
            p["active_prefill_tokens"],
            p["kv_used_blocks"],
        )
    s, q = p["scheduled_requests"], p["queued_requests"]
    return enc.forward_pass_metrics(
        p["worker_id"], p["dp_rank"], p["counter_id"], p["wall_time"],
        tuple(s.values()), tuple(q.values()),
    )  # fmt: skip


@pytest.mark.parametrize(("version", "subject", "body", "exp"), NATS)
def test_encoder_reproduces_nats_capture(
    version: str, subject: str, body: bytes, exp: dict[str, Any]
) -> None:
    subj = parse_subject(subject)
    if exp["encoding"] == "json":
        # 0.7.1 had neither storage_tier, start_position nor mm_extra_info
        rebuilt = encode_router_event(exp["router_event"], legacy=version == "0.7.1")
        assert enc.router_event_json(rebuilt) == body
        assert enc.stream_subject(subj.namespace, subj.component or "", subj.topic) == subject
        return
    env = exp["envelope"]
    payload = encode_payload(env["topic"], exp["payload"])
    built = enc.envelope(
        env["topic"], env["publisher_id"], env["sequence"], env["published_at"], payload
    )
    assert built == body
    assert enc.subject(subj.namespace, subj.component, subj.endpoint, subj.topic) == subject


@pytest.mark.parametrize(("frames", "exp"), ZMQ)
def test_encoder_reproduces_zmq_frames(frames: list[bytes], exp: dict[str, Any]) -> None:
    env = exp["envelope"]
    payload = encode_payload(env["topic"], exp["payload"])
    body = enc.envelope(
        env["topic"], env["publisher_id"], env["sequence"], env["published_at"], payload
    )
    assert enc.zmq_frames(env["topic"], env["publisher_id"], env["sequence"], body) == frames


def test_subject_encoding_matches_dynamo() -> None:
    for case in json.loads((ROOT / "1.6.1" / "subjects.json").read_text()):
        ns, comp, ep = case["endpoint_path"].split(".")
        assert enc.subject(ns, comp, ep, "kv-events") == case["subject"]
        parsed = parse_subject(case["subject"])
        assert (parsed.namespace, parsed.component, parsed.endpoint) == (ns, comp, ep)


def test_captured_script_arrives_as_stream_batches() -> None:
    # worker A's rank-0 stream over NATS: what the engine stand-in sent, in kvobserve's model
    batches: dict[tuple[int, int], list[Any]] = {}
    for _, subject, body, _ in NATS[: len(jsonl(ROOT / "1.6.1" / "nats.jsonl"))]:
        msg = d.decode_nats_message(subject, body)
        if msg.topic != "kv-events":
            continue
        assert msg.published_at_ms is not None
        events = d.decode_router_events(msg)
        for key, batch, _raw in d.to_batches(events, msg.published_at_ms / 1000, 16):
            batches.setdefault(key, []).append(batch)
    assert len(batches) == 4  # two workers x two DP ranks
    for key, seq in batches.items():
        assert [b.seq for b in seq] == list(range(len(seq))), key  # event_id 1.. -> seq 0..
        assert all(b.dp_rank == key[1] for b in seq)
    a0 = next(
        v for k, v in batches.items() if k[1] == 0 and v[0].events[0].block_hashes == [1001, 1002]
    )
    kinds = [(e.kind, getattr(e, "medium", None)) for b in a0 for e in b.events]
    assert kinds == [
        ("BlockStored", "GPU"), ("BlockStored", "GPU"), ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU"), ("AllBlocksCleared", None),
        ("BlockStored", "GPU"),
    ]  # fmt: skip
    assert a0[1].events[0].parent_block_hash == 1002
    assert a0[0].events[0].block_size == 16
