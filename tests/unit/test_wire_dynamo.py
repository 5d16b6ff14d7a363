"""Dynamo event-plane decoding: subjects, envelope, ZMQ framing, payload forms, every variant,
unknown keys and variants, and the WireError reason of each kind of bad input."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvobserve.simulate import dynamo_encode as enc
from kvobserve.wire import dynamo as d
from kvobserve.wire.dynamo_subject import (
    Subject,
    decode_segment,
    encode_segment,
    parse_subject,
    subject_for,
    subscription_subjects,
)
from kvobserve.wire.errors import WireError

W = 13426986283238471908  # a worker id >= 2^63, as Dynamo hands out
SUBJ = "namespace.dynamo.component.backend.endpoint.generate.kv-events"


def reason(fn: Any, *args: Any) -> str:
    with pytest.raises(WireError) as info:
        fn(*args)
    return info.value.reason


def kv_message(events: list[dict[str, Any]], single: bool = False, **env: Any) -> d.DynamoMessage:
    payload = enc.kv_events_payload(events, single)
    body = enc.envelope("kv-events", env.get("pid", 7), env.get("seq", 0), 1_000, payload)
    return d.decode_nats_message(SUBJ, body)


# --- subjects ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("subject", "expected"),
    [
        (SUBJ, Subject("endpoint", "dynamo", "kv-events", "backend", "generate")),
        (
            "namespace.dynamo.component.backend.kv-events",
            Subject("component", "dynamo", "kv-events", "backend"),
        ),
        (
            "namespace.dynamo.component.backend.kv_events",
            Subject("component", "dynamo", "kv_events", "backend"),
        ),
        ("namespace.dynamo.kv_metrics", Subject("namespace", "dynamo", "kv_metrics")),
        (
            "namespace-dynamo-component-backend-kv-events.queue",
            Subject("jetstream", "dynamo", "queue", "backend"),
        ),
        (
            "namespace.team%7Ea.component.back%20end.endpoint.gen%2Fx.forward-pass-metrics",
            Subject("endpoint", "team~a", "forward-pass-metrics", "back end", "gen/x"),
        ),
    ],
)
def test_every_subject_form_parses(subject: str, expected: Subject) -> None:
    assert parse_subject(subject) == expected


@pytest.mark.parametrize(
    "subject",
    [
        "namespace.a.component.b.endpoint.c",  # 6 tokens
        "namespace.a.component.b.endpointX.c.kv-events",
        "foo.a.component.b.kv-events",
        "namespace",
        "namespace-a-b-kv-events.queue",  # no "-component-"
        "namespace-a-component-b-component-c-kv-events.queue",  # ambiguous split
        "namespace-a-component-b-kv-events.other",
        "namespace.a%2.kv_metrics",  # bad escape
        "namespace.%FF.kv_metrics",  # not UTF-8
    ],
)
def test_other_subjects_are_schema_errors(subject: str) -> None:
    assert reason(parse_subject, subject) == "schema"


def test_segment_encoding_round_trips_and_escapes_the_escape() -> None:
    for name in ["a.b", "é", "a%2Eb", "x y/z", "Ns_1-ok", ""]:
        assert decode_segment(encode_segment(name)) == name
    assert encode_segment("a%2Eb") == "a%252Eb" and encode_segment("a.b") == "a%2Eb"
    assert subject_for("my.ns", "backend", "generate", "kv-events") == (
        "namespace.my%2Ens.component.backend.endpoint.generate.kv-events"
    )


def test_subscription_subjects_cover_each_form_and_nothing_else() -> None:
    assert subscription_subjects("dynamo", ("kv-events",)) == [
        "namespace.dynamo.component.*.endpoint.*.kv-events"
    ]
    every = subscription_subjects(None, legacy=True, jetstream=True)
    assert "namespace.*.component.*.endpoint.*.forward-pass-metrics" in every
    assert "namespace.*.component.*.kv-events" in every  # 1.2.x
    assert "namespace.*.kv_metrics" in every  # 1.2.x load
    assert "namespace.*.component.*.kv_events" in every  # <= 2025 JSON
    assert {"*.kv-events", "*.queue"} <= set(every)
    assert len(every) == len(set(every)) == 10
    assert subscription_subjects("a.b")[0].startswith("namespace.a%2Eb.")


# --- envelope and ZMQ framing ---------------------------------------------------------------


def test_envelope_by_name_in_any_order_with_unknown_keys_counted() -> None:
    body = msgspec.msgpack.encode(
        {"payload": b"\x90", "future": [1], "published_at_ns": 5, "topic": "kv-events",
         "sequence": 3, "publisher_id": 2**53 - 1, "published_at": 9}
    )  # fmt: skip
    msg = d.decode_envelope(body)
    assert (msg.topic, msg.publisher_id, msg.sequence, msg.published_at_ms) == (
        "kv-events", 2**53 - 1, 3, 9,
    )  # fmt: skip
    assert (msg.published_at_ns, msg.unknown_keys, msg.payload) == (5, 1, b"\x90")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\xc1", "msgpack"),
        (b"\x85", "msgpack"),  # truncated map
        (msgspec.msgpack.encode({"topic": "t"}), "schema"),  # fields missing
        (msgspec.msgpack.encode([1, 2, 3, 4, 5]), "schema"),
        (
            msgspec.msgpack.encode(
                {"topic": 1, "publisher_id": 1, "sequence": 1, "published_at": 1, "payload": b""}
            ),
            "schema",
        ),
    ],
)
def test_bad_envelopes(body: bytes, why: str) -> None:
    assert reason(d.decode_envelope, body) == why


def test_oversize_body_is_refused_before_decoding() -> None:
    body = enc.envelope("kv-events", 1, 0, 1, b"\x90" * 100)
    assert reason(d.decode_envelope, body, 50) == "oversize"
    assert reason(d.decode_nats_message, SUBJ, b"{" + b" " * 60, 50) == "oversize"


def zmq(topic: str = "kv-events", pid: int = 5, seq: int = 9) -> list[bytes]:
    body = enc.envelope("kv-events", 5, 9, 1, enc.kv_events_payload([]))
    return enc.zmq_frames(topic, pid, seq, body)


def test_zmq_header_disagreements_are_reported_not_fatal() -> None:
    assert d.decode_zmq_message(zmq()).header_mismatch == ()
    assert d.decode_zmq_message(zmq(topic=SUBJ)).header_mismatch == ()  # broker mode: full subject
    assert d.decode_zmq_message(zmq("other", 6, 10)).header_mismatch == (
        "topic", "publisher_id", "sequence",
    )  # fmt: skip


def test_zmq_framing_errors() -> None:
    f = zmq()
    assert reason(d.decode_zmq_message, f[:3]) == "frame_count"
    assert reason(d.decode_zmq_message, [*f, b""]) == "frame_count"
    assert reason(d.decode_zmq_message, [f[0], f[1][:7], f[2], f[3]]) == "seq_length"
    assert reason(d.decode_zmq_message, [f[0], f[1], f[2] + b"\x00", f[3]]) == "seq_length"
    assert reason(d.decode_zmq_message, [*f[:3], b"\x01\x00"]) == "msgpack"
    assert reason(d.decode_zmq_message, [*f[:3], b"\x02" + f[3][1:]]) == "schema"
    assert reason(d.decode_zmq_message, [*f[:3], f[3][:-1]]) == "msgpack"  # length disagrees
    assert reason(d.decode_zmq_message, [*f[:3], f[3] + b"\x00"]) == "msgpack"


# --- payload forms and variants -------------------------------------------------------------


def every_variant() -> list[dict[str, Any]]:
    b = [
        enc.block(11, 99),
        enc.block(12, 98, {"mm_objects": [{"mm_hash": 1, "offsets": [[0, 4]]}]}),
    ]
    return [
        enc.router_event(W, 1, enc.stored(b, None, 0)),
        enc.router_event(W, 2, enc.stored([enc.block(13, 97)], 12, 32), storage_tier="host_pinned"),
        enc.router_event(W, 3, enc.removed([13]), storage_tier="disk"),
        enc.router_event(W, 4, enc.tier_cleared("host_pinned")),
        enc.router_event(W, 5, enc.CLEARED, storage_tier="external"),
    ]


def test_array_payload_every_variant_maps_onto_kvobserve_events() -> None:
    got = d.decode_router_events(kv_message(every_variant()))
    assert not got.single and (got.unknown_keys, got.unknown_variants) == (0, 0)
    batches = d.to_batches(got, 1.0, block_size=16)
    assert [(k, b.seq, b.dp_rank) for k, b, _ in batches] == [((W, 0), i, 0) for i in range(5)]
    ev = [b.events[0] for _, b, _ in batches]
    assert [e.kind for e in ev] == [
        "BlockStored", "BlockStored", "BlockRemoved", "TierCleared", "AllBlocksCleared",
    ]  # fmt: skip
    s0, s1 = ev[0], ev[1]
    assert isinstance(s0, d.DynamoStored) and isinstance(s1, d.DynamoStored)
    assert (s0.block_hashes, s0.parent_block_hash, s0.medium, s0.block_size) == (
        [11, 12],
        None,
        "GPU",
        16,
    )
    assert (s1.block_hashes, s1.parent_block_hash, s1.medium) == ([13], 12, "CPU")
    assert s0.lora() is None and s0.num_tokens == 0
    assert ev[2].medium == "DISK" and ev[2].block_hashes == [13]  # type: ignore[attr-defined]
    assert ev[3].medium == "CPU"  # type: ignore[attr-defined]
    assert all(
        raw == msgspec.msgpack.encode(e)
        for (_, _, raw), e in zip(batches, every_variant(), strict=True)
    )


def test_single_map_payload_without_optional_keys() -> None:
    ev = enc.router_event(W, 7, enc.removed([1, 2]), 3, storage_tier=None, residency_domain=None)
    got = d.decode_router_events(kv_message([ev], single=True))
    assert got.single and got.events[0].tier == "device"
    ((key, batch, _),) = d.to_batches(got, 2.5)
    assert key == (W, 3) and batch.seq == 6 and batch.ts == 2.5 and batch.events[0].medium == "GPU"  # type: ignore[attr-defined]


def test_legacy_json_body_on_legacy_subjects() -> None:
    ev = enc.router_event(W, 1, enc.stored([enc.block(5, 6, legacy=True)], legacy=True),
                          storage_tier=None, residency_domain=None)  # fmt: skip
    for subject in ["namespace.dynamo.component.backend.kv_events",
                    enc.stream_subject("dynamo", "backend", "queue")]:  # fmt: skip
        msg = d.decode_nats_message(subject, enc.router_event_json(ev))
        assert (msg.encoding, msg.topic, msg.publisher_id) == ("json", "kv-events", None)
        got = d.decode_router_events(msg)
        assert got.events[0].event.data.stored.blocks[0].block_hash == 5  # type: ignore[union-attr]
    bad = d.decode_nats_message(SUBJ, b'{"worker_id": "x"}')
    assert reason(d.decode_router_events, bad) == "schema"


def test_unknown_keys_and_variants_are_counted_and_skipped() -> None:
    known = enc.router_event(W, 1, enc.CLEARED)
    extra = {**enc.router_event(W, 2, enc.removed([1])), "new_field": 1, "other": {"x": 1}}
    new_variant = enc.router_event(W, 3, {"moved": {"to": "disk"}})
    new_unit = enc.router_event(W, 4, "flushed")
    with_all = enc.router_event(W, 5, enc.CLEARED, state_source={"owner": 1}, session_id="s")
    got = d.decode_router_events(kv_message([known, extra, new_variant, new_unit, with_all]))
    assert (got.unknown_keys, got.unknown_variants) == (2, 2)
    assert [e.event.event_id for e in got.events] == [1, 2, 5]
    assert [b.seq for _, b, _ in d.to_batches(got, 0.0)] == [0, 1, 4]  # the skipped ids: a gap


def test_events_sharing_an_event_id_form_one_batch() -> None:
    # pre-2026 relays stamped every event of an engine batch with the engine seq
    evs = [enc.router_event(W, 4, enc.removed([1])), enc.router_event(W, 4, enc.removed([2])),
           enc.router_event(W, 4, enc.removed([3]), 1)]  # fmt: skip
    batches = d.to_batches(d.decode_router_events(kv_message(evs)), 0.0)
    assert [(k, len(b.events)) for k, b, _ in batches] == [((W, 0), 2), ((W, 1), 1)]
    assert batches[0][2] == msgspec.msgpack.encode(evs[0]) + msgspec.msgpack.encode(evs[1])


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"", "schema"),
        (b"\x05", "schema"),  # neither array nor map
        (b"\x91\x05", "schema"),  # an array of non-maps
        (b"\x92\x80", "msgpack"),  # truncated
        (msgspec.msgpack.encode([{"worker_id": 1}]), "schema"),  # no event
        (msgspec.msgpack.encode([{"worker_id": -1.5, "event": {}}]), "schema"),
        (enc.kv_events_payload([enc.router_event(1, 1, {"stored": {"blocks": "x"}})]), "schema"),
        (enc.kv_events_payload([enc.router_event(1, 1, [1])]), "schema"),
        (
            msgspec.msgpack.encode({"worker_id": 1, "event": {"event_id": 1, "data": b"\xa1\xc2"}}),
            "schema",
        ),
    ],
)
def test_bad_kv_payloads(payload: bytes, why: str) -> None:
    msg = d.DynamoMessage("kv-events", payload, "msgpack")
    assert reason(d.decode_router_events, msg) == why


# --- kv_metrics and forward-pass-metrics -----------------------------------------------------


def test_active_load_with_and_without_waiting_requests() -> None:
    old = d.decode_active_load(enc.active_load(W, 1, 10, None, 20))
    assert (old.worker_id, old.dp_rank, old.kv_used_blocks, old.waiting_requests) == (
        W,
        1,
        20,
        None,
    )
    new = d.decode_active_load(enc.active_load(W, 0, waiting_requests=4))
    assert new.waiting_requests == 4 and new.active_decode_blocks is None
    assert reason(d.decode_active_load, msgspec.msgpack.encode({"dp_rank": 0})) == "schema"


def test_fpm_decodes_and_heartbeat_is_all_zero() -> None:
    beat = d.decode_fpm(enc.forward_pass_metrics(str(W), 1, 7, 0.0))
    assert (beat.worker_id, beat.dp_rank, beat.counter_id, beat.wall_time) == (str(W), 1, 7, 0.0)
    busy = d.decode_fpm(enc.forward_pass_metrics("w", 0, 8, 0.02, (1, 2, 0.5, 3, 4, 5, 0.25)))
    assert busy.scheduled_requests.sum_prefill_kv_tokens == 3
    assert busy.scheduled_requests.var_decode_kv_tokens == 0.25
    assert reason(d.decode_fpm, b"\x81\xa1a\x01") == "schema"


def test_medium_mapping_is_documented_and_unknown_tiers_kept() -> None:
    assert d.TIER_MEDIUM == {
        "device": "GPU",
        "host_pinned": "CPU",
        "disk": "DISK",
        "external": "EXTERNAL",
    }
    assert d.medium_of("nvme_pool") == "nvme_pool"
