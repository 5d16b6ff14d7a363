"""One stream's checkpoint: copied, encoded, refused when it is not to be trusted, restored."""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvobserve.analysis.analytics import REMOVE_UNKNOWN, AnalyticsOptions, CacheAnalytics
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.checkpoint import (
    StreamCopy,
    checkpoint_of,
    copy_stream,
    encode_copy,
    restore_index,
    state_mark,
)
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.trust import COMPLETE, FROM_START, Trust
from kvobserve.wire.checkpoint import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    CheckpointRefused,
    PublisherIdentity,
    StreamCheckpoint,
    StreamIdentity,
    TierState,
    decode_checkpoint,
    encode_checkpoint,
    pack_times,
    unpack_times,
)
from kvobserve.wire.kv_events import BlockHash, decode_message, decode_payload
from tests.unit.test_blocks import VERSIONS, capture_messages

IDENT = StreamIdentity(
    "sglang-a", 3, "sglang", "tcp://10.0.0.5:5560", "kv-events", "tcp://10.0.0.5:5660"
)
CONFIG = "0123456789abcdef"
T0 = 1_795_291_773.25


def payload(ts: float, events: list[dict[str, Any]], rank: int = 3) -> bytes:
    """A batch as SGLang 0.5.23 publishes it: `[ts, events, dp_rank]`, map events."""
    return msgspec.msgpack.encode([ts, events, rank])


def store_ev(hashes: list[BlockHash], size: int = 16, medium: str = "GPU", lora: str | None = None,
             parent: BlockHash | None = None) -> dict[str, Any]:  # fmt: skip
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [7] * size * len(hashes), "block_size": size, "lora_id": None,
            "medium": medium, "lora_name": lora}  # fmt: skip


def remove_ev(hashes: list[BlockHash], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def workload(n: int, *, seed: int = 1, kind: str = "signed", per: int = 3,
             keep: int = 250) -> Iterator[bytes]:  # fmt: skip
    """`n` batches: each stores `per` blocks on the GPU (every 7th one of them a short page, every
    5th batch under a LoRA adapter, every 4th also on CPU), removes what it stored `keep`
    batches before."""
    rng = random.Random(seed)

    def h() -> BlockHash:
        if kind == "signed":
            return rng.getrandbits(64) - (1 << 63)
        if kind == "unsigned":
            return rng.getrandbits(64) | (1 << 63)  # past int64: vLLM's uint64
        return rng.randbytes(32)

    live: list[list[BlockHash]] = []
    for i in range(n):
        hs = [h() for _ in range(per)]
        evs = [store_ev(hs[:-1]), store_ev(hs[-1:], size=16 if i % 7 else 5,
                                            lora="adapter-a" if i % 5 == 0 else None)]  # fmt: skip
        if i % 4 == 0:
            evs.append(store_ev(hs[:1], medium="CPU_PINNED"))
        live.append(hs)
        if len(live) > keep:
            gone = live.pop(0)
            evs.append(remove_ev(gone))
            if (i - keep) % 4 == 0:
                evs.append(remove_ev(gone[:1], medium="CPU_PINNED"))
        yield payload(T0 + i * 0.013, evs)


def fed(payloads: Iterator[bytes] | list[bytes], analytics: bool = False) -> StreamSequencer:
    sq = StreamSequencer(3, replay=True)
    if analytics:
        sq.index.analytics = CacheAnalytics(trust=sq.trust)
    for seq, p in enumerate(payloads):
        sq.on_batch(decode_payload("kv-events", seq, p), p, float(seq))
    return sq


def anchor(sq: StreamSequencer) -> bytes:
    """The payload of the last applied seq (the sequencer keeps its recent ones)."""
    return next(p for q, p in sq._recent if q == sq.last_seq)


def copied(sq: StreamSequencer, config: str = CONFIG) -> StreamCopy:
    c = copy_stream(IDENT, sq, anchor(sq), config, PublisherIdentity("kv-events", 3))
    assert c is not None
    return c


def resident(idx: BlockIndex) -> dict[str, dict[BlockHash, float]]:
    return {m: dict(t.resident) for m, t in idx.tiers.items()}


@pytest.mark.parametrize("kind", ["signed", "unsigned", "bytes"])
def test_a_restored_index_is_the_index_and_goes_on_as_it_would(kind: str) -> None:
    batches = list(workload(900, kind=kind))
    sq = fed(batches[:600])
    data = encode_copy(copied(sq), "0.1.0", 1000.0)
    ck = decode_checkpoint(data, IDENT, CONFIG)
    idx = BlockIndex()
    assert restore_index(ck, idx) == sum(sq.index.blocks.values())
    assert resident(idx) == resident(sq.index)  # hashes and their store times, every tier
    assert (idx.blocks, idx.tokens, idx.block_size) == (sq.index.blocks, sq.index.tokens, 16)
    assert idx.tiers["GPU"].odd == sq.index.tiers["GPU"].odd and idx.tiers["GPU"].odd
    # one float object per batch, as apply_batch shares them: not one per block
    times = idx.tiers["GPU"].resident.values()
    assert len(set(map(id, times))) == len(set(times)) < len(idx.tiers["GPU"].resident)
    assert (ck.last_seq, ck.last_ts, ck.anchor) == (599, T0 + 599 * 0.013, batches[599])
    assert (ck.trust_state, ck.trust_reason) == ("complete", "from_start")
    assert ck.publisher == PublisherIdentity("kv-events", 3)
    # the rest of the stream applied to both: the same blocks, and blocks stored before the
    # checkpoint leave with the lifetimes their original store times give
    for seq, p in enumerate(batches[600:], 600):
        b = decode_payload("kv-events", seq, p)
        idx.apply_batch(b)
        sq.index.apply_batch(b)
    assert resident(idx) == resident(sq.index) and idx.tokens == sq.index.tokens
    restored, original = idx.lifetime["GPU"], sq.index.lifetime["GPU"]
    assert restored.count == 300 * 3  # the 300 removals since, each of 3 blocks
    assert restored.sum == pytest.approx(300 * 3 * 250 * 0.013)  # each lived 250 batches
    assert restored.count < original.count  # counters count from the new process's start


def test_int_hashes_cost_at_most_16_bytes_a_block_and_32_byte_hashes_say_what_they_cost() -> None:
    for kind, most in (("signed", 16.0), ("unsigned", 16.0), ("bytes", 40.0)):
        sq = fed(workload(400, kind=kind, per=4, keep=1000))  # 1,600 GPU blocks, 100 on CPU
        c = copied(sq)
        data = encode_copy(c, "0.1.0", 1000.0)
        per_block = (len(data) - len(c.anchor)) / c.blocks
        assert per_block <= most, (kind, per_block)
        if kind == "bytes":
            assert per_block > 32 + 6  # the hash itself and 6 bytes of store time


def test_store_times_are_lossless_also_when_they_share_no_top_bits() -> None:
    rng = random.Random(3)
    today = [T0 + rng.random() * 1e5 for _ in range(500)]
    odd = [0.0, -1.5, 1e-300, T0, 2.0**60, float("inf")]  # no top 16 bits in common
    for times, shared in ((today, True), (odd, False), ([], True)):
        low, mid, top = pack_times(times)
        back = unpack_times(TierState("GPU", len(times), ts_low=low, ts_mid=mid, ts_top=top))
        assert back == times
        assert (top >= 0) == shared
    low, mid, top = pack_times(today)
    assert (len(low), len(mid)) == (4 * 500, 2 * 500)  # 6 bytes a block


def test_copy_is_none_without_a_batch_or_without_the_last_batchs_payload() -> None:
    sq = StreamSequencer(3, replay=True)
    assert copy_stream(IDENT, sq, b"x", CONFIG) is None  # nothing applied yet
    sq = fed(workload(5))
    assert copy_stream(IDENT, sq, None, CONFIG) is None  # no anchor: nothing to resume from
    assert copy_stream(IDENT, sq, anchor(sq), CONFIG) is not None


def test_the_state_mark_changes_with_every_batch_and_restart() -> None:
    batches = list(workload(10))
    sq = fed(batches[:5])
    a = state_mark(sq)
    sq.on_batch(decode_payload("kv-events", 5, batches[5]), batches[5], 5.0)
    b = state_mark(sq)
    assert a != b and state_mark(sq) == b
    other = list(workload(3, seed=2))  # another publisher instance: seq falls back, goes on
    for seq, p in enumerate(other):
        sq.on_batch(decode_payload("kv-events", seq, p), p, 6.0 + seq)
    assert sq.restarts == 1 and state_mark(sq) not in (a, b)


def test_restore_needs_an_empty_index() -> None:
    sq = fed(workload(10))
    ck = decode_checkpoint(encode_copy(copied(sq), "0.1.0", 1.0))
    with pytest.raises(ValueError, match="already holds blocks"):
        restore_index(ck, sq.index)


# --- what is refused ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good() -> bytes:
    return encode_copy(copied(fed(workload(300))), "0.1.0", 1000.0)


def refused(
    data: bytes, ident: StreamIdentity | None = IDENT, config: str | None = CONFIG
) -> CheckpointRefused:
    with pytest.raises(CheckpointRefused) as exc:
        decode_checkpoint(data, ident, config)
    return exc.value


def test_every_truncation_is_refused_as_truncated(good: bytes) -> None:
    cuts = sorted({*range(1, 40), *random.Random(1).sample(range(40, len(good)), 200)})
    for cut in cuts:
        exc = refused(good[:cut])
        assert exc.reason == "truncated", (cut, exc)
    assert str(refused(good[:9])) == f"truncated: 9 bytes, the header alone is {HEADER_BYTES}"
    assert str(refused(good[:-100])).startswith(f"truncated: {len(good) - HEADER_BYTES - 100} of ")


def test_every_corruption_is_refused_as_corrupt(good: bytes) -> None:
    rng = random.Random(2)
    for pos in rng.sample(range(HEADER_BYTES, len(good)), 300):
        bad = bytearray(good)
        bad[pos] ^= 1 << rng.randrange(8)
        exc = refused(bytes(bad))
        assert (exc.reason, str(exc)) == ("corrupt", "corrupt: checksum mismatch"), pos
    assert str(refused(good + b"\0")) == "corrupt: 1 bytes after the body"
    big = struct.pack("<7sBII", MAGIC, FORMAT_VERSION, 1 << 31, 0)
    assert refused(big).reason == "corrupt"


def test_a_body_whose_checksum_is_right_but_whose_columns_disagree_is_corrupt() -> None:
    ck = checkpoint_of(copied(fed(workload(50))), "0.1.0", 1.0)
    t = ck.tiers[0]
    for bad in (
        msgspec.structs.replace(t, count=t.count + 1),
        msgspec.structs.replace(t, ts_mid=t.ts_mid[:-2]),
        msgspec.structs.replace(t, odd_tokens=[*t.odd_tokens, 3]),
    ):
        data = encode_checkpoint(msgspec.structs.replace(ck, tiers=[bad, *ck.tiers[1:]]))
        assert refused(data).reason == "corrupt"
    body = b"\x93\x01\x02"  # msgpack, but not a checkpoint's shape
    framed = struct.pack("<7sBII", MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body)) + body
    assert str(refused(framed)).startswith("corrupt: body: ")


def test_what_is_not_a_checkpoint_says_so(good: bytes) -> None:
    for data in (b"", b'{"k": 1}\n' * 5, b"\x89PNG\r\n\x1a\n" + bytes(30), b"KVOCKP"[:3]):
        exc = refused(data)
        assert exc.reason == ("truncated" if data[:1] in (b"", b"K") else "not_checkpoint"), data


@pytest.mark.parametrize("version", [FORMAT_VERSION - 1, FORMAT_VERSION + 1])
def test_another_format_version_is_refused_by_name(good: bytes, version: int) -> None:
    other = good[:7] + bytes([version]) + good[8:]
    exc = refused(other)
    assert exc.reason == "format"
    assert str(exc) == (f"format: format version {version}; this kvobserve reads version "
                        f"{FORMAT_VERSION}")  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("worker_id", "sglang-b"), ("dp_rank", 4), ("engine", "vllm"),
     ("endpoint", "tcp://10.0.0.6:5560"), ("topic", "kv@pod-1@m"), ("replay_endpoint", None)],
)  # fmt: skip
def test_another_streams_or_another_plans_checkpoint_is_refused(good: bytes, field: str,
                                                                 value: object) -> None:  # fmt: skip
    ident = msgspec.structs.replace(IDENT, **{field: value})
    exc = refused(good, ident)
    assert exc.reason == "plan"
    assert f"with {field} {getattr(IDENT, field)!r}, the plan has {value!r}" in str(exc)


def test_a_checkpoint_of_another_configuration_is_refused(good: bytes) -> None:
    exc = refused(good, IDENT, "fedcba9876543210")
    assert str(exc) == ("config: written under configuration 0123456789abcdef, this one is "
                        "fedcba9876543210")  # fmt: skip
    assert decode_checkpoint(good).identity == IDENT  # unchecked when not asked


def test_publisher_identity_tells_what_differs() -> None:
    had = PublisherIdentity("kv@pod-1@m", 3, 77)
    assert had.differs(PublisherIdentity("kv@pod-1@m", 3, 77)) == ""
    assert had.differs(PublisherIdentity("", None, None)) == ""  # the live one shows nothing
    assert had.differs(PublisherIdentity("kv@pod-1@m", 3, 78)) == "instance 77 -> 78"
    assert had.differs(PublisherIdentity("kv@pod-2@m")) == "topic 'kv@pod-1@m' -> 'kv@pod-2@m'"


# --- the analytics ------------------------------------------------------------------------


def test_lora_blocks_resume_with_the_index() -> None:
    sq = fed(workload(300), analytics=True)
    want = sq.index.analytics.lora_blocks  # type: ignore[union-attr]
    assert want["GPU"]["adapter-a"] > 0
    idx = BlockIndex()
    idx.analytics = CacheAnalytics()
    restore_index(decode_checkpoint(encode_copy(copied(sq), "v", 1.0)), idx)
    assert idx.analytics is not None and idx.analytics.lora_blocks == want
    assert idx.analytics.lora_of == sq.index.analytics.lora_of  # type: ignore[union-attr]


def test_silent_loss_evidence_waits_one_restore_window_after_a_resume() -> None:
    """vLLM removes a hash twice when it held two copies; the window that would have told the
    second removal from a lost event is not in the checkpoint, so evidence waits it out."""
    batches = list(workload(40, keep=10))
    sq = fed(batches, analytics=True)
    idx = BlockIndex()
    trust = Trust()
    trust.set(COMPLETE, FROM_START)  # what the resume gives back: evidence counts only then
    idx.analytics = CacheAnalytics(AnalyticsOptions(restore_window_s=60.0), trust)
    ck = decode_checkpoint(encode_copy(copied(sq), "v", 1.0))
    restore_index(ck, idx)
    gone = msgspec.msgpack.decode(batches[-1])[1][-1]["block_hashes"]  # removed just before
    last = ck.last_ts or 0.0
    for seq, ts in ((40, last + 1.0), (41, last + 59.0)):
        idx.apply_batch(decode_payload("kv-events", seq, payload(ts, [remove_ev(gone)])))
    assert idx.analytics.silent_loss[REMOVE_UNKNOWN] == 0
    idx.apply_batch(decode_payload("kv-events", 42, payload(last + 61.0, [remove_ev(gone)])))
    assert idx.analytics.silent_loss[REMOVE_UNKNOWN] == len(gone)


@pytest.mark.parametrize("version", VERSIONS)
def test_engine_captures_round_trip(version: str) -> None:
    """The engines' own bytes: every version's events, int and 32-byte hashes."""
    live = capture_messages(version)
    rank = live[0]["dp_rank"]
    sq = StreamSequencer(rank, replay=False)
    for m in (m for m in live if m["dp_rank"] == rank):
        b = decode_message(m["frames"])
        sq.on_batch(b, m["frames"][2], float(b.seq))
    assert sum(sq.index.blocks.values()) > 0
    c = copy_stream(IDENT, sq, anchor(sq), CONFIG)
    assert c is not None
    idx = BlockIndex()
    restore_index(decode_checkpoint(encode_copy(c, "v", 1.0), IDENT, CONFIG), idx)
    assert resident(idx) == resident(sq.index) and idx.tokens == sq.index.tokens


def test_a_checkpoint_struct_has_no_field_names_on_disk() -> None:
    """Array-encoded: the per-stream overhead is the identity's values, not its keys."""
    data = encode_copy(copied(fed(workload(20))), "0.1.0", 1.0)
    assert b"worker_id" not in data and b"ts_low" not in data
    assert isinstance(decode_checkpoint(data), StreamCheckpoint)
