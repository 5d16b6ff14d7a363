"""Replay request encoding and reply decoding, both layouts, and every malformed shape."""

from __future__ import annotations

import json

import pytest

from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import END_SEQ
from kvobserve.wire.replay import decode_replay_message, encode_replay_request, is_end_marker
from tests.unit.test_captures import CAPTURES, load_lines

LIVE = load_lines(CAPTURES / "sglang-0.5.23")[0]["frames"]  # [b"kv-events", seq 0, payload]
PAYLOAD = LIVE[2]
SEQ5 = (5).to_bytes(8, "big")


def test_request_frames_match_what_the_capture_dealer_sent() -> None:
    meta = json.loads((CAPTURES / "sglang-0.5.23" / "meta.json").read_text())
    sent = meta["replay_requests"][0]
    assert [f.hex() for f in encode_replay_request(sent["start_seq"])] == sent[
        "request_frames_sent_by_dealer"
    ]
    assert encode_replay_request(2**64 - 2) == [b"", b"\xff" * 7 + b"\xfe"]


@pytest.mark.parametrize("bad", [-1, 2**64 - 1, 2**64])
def test_request_rejects_seq_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        encode_replay_request(bad)


def test_three_frame_reply_takes_the_subscription_topic() -> None:
    batch = decode_replay_message([b"", SEQ5, PAYLOAD], topic="sub-topic")
    assert batch is not None
    assert (batch.topic, batch.seq, batch.dp_rank) == ("sub-topic", 5, 0)
    assert batch.events[0].kind == "BlockStored"
    default = decode_replay_message([b"", SEQ5, PAYLOAD])
    assert default is not None and default.topic == ""


def test_four_frame_reply_carries_its_own_topic() -> None:
    batch = decode_replay_message([b"", b"kv-events", SEQ5, PAYLOAD], topic="ignored")
    assert batch is not None
    assert (batch.topic, batch.seq) == ("kv-events", 5)


@pytest.mark.parametrize(
    "frames", [[b"", END_SEQ, b""], [b"", b"", END_SEQ, b""], [b"", b"kv-events", END_SEQ, b""]]
)
def test_end_markers_decode_to_none(frames: list[bytes]) -> None:
    assert is_end_marker(frames)
    assert decode_replay_message(frames, "t") is None


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "frame_count"),
        ([b""], "frame_count"),
        ([b"", PAYLOAD], "frame_count"),
        ([b"", b"t", SEQ5, PAYLOAD, b"x"], "frame_count"),
        ([b"x", SEQ5, PAYLOAD], "frame_count"),  # no empty delimiter (a ROUTER id leaked)
        ([b"x", b"t", SEQ5, PAYLOAD], "frame_count"),
        ([b"", b"\x00" * 7, PAYLOAD], "seq_length"),
        ([b"", b"t", b"\x00" * 9, PAYLOAD], "seq_length"),
        ([b"", END_SEQ, PAYLOAD], "schema"),  # end seq but a payload
        ([b"", SEQ5, b""], "msgpack"),  # an empty payload is not an end marker for seq 5
        ([b"", SEQ5, b"\xc1"], "msgpack"),
        ([b"", SEQ5, b"\x93\xa1x\x90\x00"], "schema"),
    ],
)
def test_malformed_replies_raise_wire_error(frames: list[bytes], reason: str) -> None:
    assert not is_end_marker(frames)
    with pytest.raises(WireError) as info:
        decode_replay_message(frames, "t")
    assert info.value.reason == reason


def test_oversize_payload_is_refused() -> None:
    with pytest.raises(WireError) as info:
        decode_replay_message([b"", SEQ5, PAYLOAD], max_payload=len(PAYLOAD) - 1)
    assert info.value.reason == "oversize"
    assert decode_replay_message([b"", SEQ5, PAYLOAD], max_payload=len(PAYLOAD)) is not None
