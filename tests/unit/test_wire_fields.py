"""Every field of every version shape, and fields no version has sent yet: the hot path keeps what
it uses and skips the rest, the tap view shows all of it, side KV-cache groups are set aside."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import KvBatch, decode_payload
from kvobserve.wire.kv_view import batch_to_dict, batch_view

H1, H2, PARENT = 2**64 - 5, -(2**63), 1234567
BYTES_HASH = bytes(range(32))
TOKENS = list(range(32))
LOOKAHEAD = [[16], []]
EXTRA_KEYS = [["sql-lora", "tenant-salt-1"], ["sql-lora"]]
ODD_VALUE = {"nested": [1, {"deeper": b"\x01\x02"}], "n": 3.5}  # a field nobody has sent yet

_enc = msgspec.msgpack.encode


def map16(fields: dict[str, Any]) -> bytes:
    """A msgpack map with a map16 header whatever its size, as vLLM 0.33 sends it."""
    body = b"".join(_enc(k) + _enc(v) for k, v in fields.items())
    return b"\xde" + len(fields).to_bytes(2, "big") + body


def payload(*events: Any) -> bytes:
    """A batch `[ts, events, dp_rank]`; bytes events go in as they are."""
    raw = [e if isinstance(e, bytes) else _enc(e) for e in events]
    return b"\x93" + _enc(1.5) + _array_header(len(raw)) + b"".join(raw) + b"\x02"


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


def decode(p: bytes) -> KvBatch:
    return decode_payload("kv-events", 7, p)


def view_events(p: bytes, token_ids: bool = False) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = batch_view(decode(p), p, token_ids)["events"]
    return events


STORED_CORE = {
    "type": "BlockStored",
    "block_hashes": [H1, H2],
    "parent_block_hash": PARENT,
    "block_size": 16,
    "num_tokens": 32,
}


def stored_array(n_after_tag: int, *trailing: Any) -> list[Any]:
    """A vLLM array-form BlockStored with its first n fields after the tag, every one set."""
    full = [[H1, H2], PARENT, TOKENS, 16, 3, "GPU", "sql-lora", EXTRA_KEYS, 0]
    full += ["full_attention", None]
    return ["BlockStored", *full[:n_after_tag], *trailing]


# (version shape, event as sent, hot-path fields, what tap prints). Versions append fields, so an
# element past a short layout is the next version's field; only elements past the longest known
# layout (vLLM 0.23's 12) are trailing unknowns.
ARRAY_CASES: list[tuple[str, list[Any], dict[str, Any], dict[str, Any]]] = [
    (
        "sglang-0.4/vllm-0.10: 6 elements",
        stored_array(5),
        {**STORED_CORE, "medium": None},
        {**STORED_CORE, "medium": None, "lora_id": 3},
    ),
    (
        "sglang-0.5.12: + medium",
        stored_array(6),
        {**STORED_CORE, "medium": "GPU"},
        {**STORED_CORE, "medium": "GPU", "lora_id": 3},
    ),
    (
        "sglang-0.5.19: 8 elements, a metadata map",
        [*stored_array(6), {"cache_salt": "salt-1", "future_meta": 1}, "future"],
        {**STORED_CORE, "medium": "GPU"},
        {**STORED_CORE, "medium": "GPU", "lora_id": 3, "cache_salt": "salt-1",
         "unknown_fields": {"metadata": {"future_meta": 1}}, "trailing_fields": ["future"]},
    ),
    (
        "vllm-0.17: + lora_name, extra_keys",
        stored_array(8),
        {**STORED_CORE, "medium": "GPU", "lora_name": "sql-lora"},
        {**STORED_CORE, "medium": "GPU", "lora_id": 3, "lora_name": "sql-lora",
         "extra_keys": EXTRA_KEYS},
    ),
    (
        "vllm-0.21: + group_idx",
        stored_array(9),
        {**STORED_CORE, "medium": "GPU", "lora_name": "sql-lora"},
        {**STORED_CORE, "medium": "GPU", "lora_id": 3, "lora_name": "sql-lora",
         "extra_keys": EXTRA_KEYS, "group_idx": 0},
    ),
    (
        "vllm-0.23: 12 elements, + group_idx, kv_cache_spec_kind/_sliding_window",
        stored_array(11, "future", ODD_VALUE),
        {**STORED_CORE, "medium": "GPU", "lora_name": "sql-lora"},
        {**STORED_CORE, "medium": "GPU", "lora_id": 3, "lora_name": "sql-lora",
         "extra_keys": EXTRA_KEYS, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
         "trailing_fields": ["future", {"nested": [1, {"deeper": "0102"}], "n": 3.5}]},
    ),
    (
        "vllm-0.21-0.23 BlockRemoved: + group_idx",
        ["BlockRemoved", [H1], "CPU", 0, "future"],
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "CPU", "group_idx": 0,
         "trailing_fields": ["future"]},
    ),
    (
        "sglang-0.4/vllm-0.10 BlockRemoved: 2 elements",
        ["BlockRemoved", [H2]],
        {"type": "BlockRemoved", "block_hashes": [H2], "medium": None},
        {"type": "BlockRemoved", "block_hashes": [H2], "medium": None},
    ),
    (
        "AllBlocksCleared with a trailing element",
        ["AllBlocksCleared", "future"],
        {"type": "AllBlocksCleared"},
        {"type": "AllBlocksCleared", "trailing_fields": ["future"]},
    ),
]  # fmt: skip


@pytest.mark.parametrize(("shape", "event", "hot", "view"), ARRAY_CASES, ids=lambda c: c)
def test_array_form_every_field(
    shape: str, event: list[Any], hot: dict[str, Any], view: dict[str, Any]
) -> None:
    p = payload(event)
    batch = decode(p)
    assert (batch.unknown_events, batch.other_group_events) == (0, 0)
    assert batch_to_dict(batch)["events"] == [hot]
    assert view_events(p) == [view]


V33_STORED = {
    "type": "BlockStored",
    "block_hashes": [H1, H2],
    "parent_block_hash": PARENT,
    "token_ids": TOKENS,
    "block_size": 16,
    "lora_id": 3,
    "medium": "GPU",
    "lora_name": "sql-lora",
    "extra_keys": EXTRA_KEYS,
    "group_idx": 0,
    "kv_cache_spec_kind": "mla_attention",
    "locality": "LOCAL",
    "ownership": "tier-2",
    "session_id": "session-42",
    "lookahead_token_ids": LOOKAHEAD,
}
V33_REMOVED = {"type": "BlockRemoved", "block_hashes": [H1], "medium": "STORAGE", "group_idx": 0}
V33_REMOVED |= {"locality": "REMOTE", "ownership": "tier-2"}
S23_STORED = {
    "type": "BlockStored",
    "block_hashes": [H2],
    "parent_block_hash": None,
    "token_ids": [[1, 2], [2, 3]],  # bigram pairs
    "block_size": 2,
    "lora_id": None,
    "medium": "CPU_PINNED",
    "cache_salt": "salt-1",
    "session_id": "session-42",
    "lora_name": "sql-lora",
}


def test_vllm_033_map16_every_field_and_unknown_keys() -> None:
    stored = {"future_key": ODD_VALUE, **V33_STORED, "zz": None}  # unknown keys before and after
    p = payload(map16(stored), map16({**V33_REMOVED, "future_key": 1}))
    batch = decode(p)
    assert (batch.unknown_events, batch.other_group_events) == (0, 0)
    assert batch_to_dict(batch)["events"] == [
        {**STORED_CORE, "medium": "GPU", "lora_name": "sql-lora"},
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "STORAGE"},
    ]
    want = {k: v for k, v in V33_STORED.items() if k != "token_ids"} | {"num_tokens": 32}
    # unknown keys are shown as sent, null included
    want["unknown_fields"] = {
        "future_key": {"nested": [1, {"deeper": "0102"}], "n": 3.5},
        "zz": None,
    }
    got = view_events(p, token_ids=True)
    assert got[0] == want | {"token_ids": TOKENS}
    assert got[0]["lookahead_token_ids"] == [[16], []]  # lists, one per block hash
    assert got[1] == V33_REMOVED | {"unknown_fields": {"future_key": 1}}
    # the fields tap printed before come first, in the same order
    assert list(got[0])[:6] == [*STORED_CORE, "medium"]


def test_sglang_0523_map_every_field_in_any_key_order() -> None:
    reordered = dict(reversed(list(S23_STORED.items()))) | {"future_key": "x"}
    p = payload(reordered, {"block_hashes": [H2], "type": "BlockRemoved", "medium": "CPU_PINNED"})
    batch = decode(p)
    assert batch_to_dict(batch, token_ids=True)["events"] == [
        {"type": "BlockStored", "block_hashes": [H2], "parent_block_hash": None, "block_size": 2,
         "num_tokens": 2, "medium": "CPU_PINNED", "lora_name": "sql-lora",
         "token_ids": [[1, 2], [2, 3]]},
        {"type": "BlockRemoved", "block_hashes": [H2], "medium": "CPU_PINNED"},
    ]  # fmt: skip
    got = view_events(p)[0]
    assert {k: got[k] for k in ("cache_salt", "session_id", "lora_name")} == {
        "cache_salt": "salt-1",
        "session_id": "session-42",
        "lora_name": "sql-lora",
    }
    assert "lora_id" not in got and got["unknown_fields"] == {"future_key": "x"}


def test_bytes_hashes_are_hex_in_both_views() -> None:
    p = payload(map16({**V33_STORED, "block_hashes": [BYTES_HASH], "parent_block_hash": None}))
    assert batch_to_dict(decode(p))["events"][0]["block_hashes"] == [BYTES_HASH.hex()]
    assert view_events(p)[0]["block_hashes"] == [BYTES_HASH.hex()]


@pytest.mark.parametrize(
    "unknown",
    [["BlockMigrated", [H1], {"to": "CPU"}], {"type": "BlockMigrated", "block_hashes": [H1]}],
    ids=["array", "map"],
)
def test_unknown_event_tags_are_counted_skipped_and_shown(unknown: Any) -> None:
    p = payload(stored_array(6), unknown, {"type": "AllBlocksCleared", "future": 1})
    batch = decode(p)
    assert batch.unknown_events == 1
    assert [e["type"] for e in batch_to_dict(batch)["events"]] == [
        "BlockStored",
        "AllBlocksCleared",
    ]
    got = view_events(p)
    assert got[1]["type"] == "BlockMigrated" and got[1]["unknown_event"] is True
    rest = unknown[1:] if isinstance(unknown, list) else {"block_hashes": [H1]}
    assert got[1]["fields"] == rest
    assert got[2] == {"type": "AllBlocksCleared", "unknown_fields": {"future": 1}}


def _side(kind: str, group: int, spec: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": kind, "block_hashes": [H1], "medium": "GPU", "group_idx": group}
    if kind == "BlockStored":
        ev |= {"parent_block_hash": None, "token_ids": TOKENS[:16], "block_size": 16}
        ev |= {"lora_id": None, "kv_cache_spec_kind": spec}
        if spec == "sliding_window":
            ev["kv_cache_spec_sliding_window"] = 1024
    return ev


@pytest.mark.parametrize(
    ("event", "main"),
    [
        (_side("BlockStored", 0, "full_attention"), True),
        (_side("BlockStored", 0, "mla_attention"), True),
        (_side("BlockStored", 0, "sink_full_attention"), True),
        (_side("BlockStored", 0, None), True),
        (_side("BlockRemoved", 0, None), True),
        (_side("BlockStored", 1, "full_attention"), False),  # several full-attention groups
        (_side("BlockStored", 0, "sliding_window"), False),
        (_side("BlockStored", 2, "mamba"), False),
        (_side("BlockStored", 0, "a_kind_from_the_future"), False),
        (_side("BlockRemoved", 1, None), False),
    ],
)
def test_side_kv_cache_groups_are_set_aside_in_both_forms(
    event: dict[str, Any], main: bool
) -> None:
    keys = list(event)
    if event["type"] == "BlockStored":
        keys = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size"]
        keys += ["lora_id", "medium", "lora_name", "extra_keys", "group_idx"]
        keys += ["kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
    array = [event.get(k) for k in keys]
    cleared = {"type": "AllBlocksCleared"}
    for form in (event, array):
        # alone (the batch decoder), and beside an unknown tag (the event-by-event decoder)
        for p in (payload(form, cleared), payload(form, ["Future"], cleared)):
            batch = decode(p)
            assert batch.other_group_events == (0 if main else 1)
            assert len(batch.events) == (2 if main else 1)
            view = view_events(p)[0]
            assert view.get("other_group", False) is not main
            assert view["group_idx"] == event["group_idx"]


def test_a_bad_group_is_still_a_schema_error() -> None:
    for bad in ({**_side("BlockStored", 0, None), "group_idx": "zero"}, _side("BlockStored", 0, 5)):
        with pytest.raises(WireError) as info:
            decode(payload(bad))
        assert info.value.reason == "schema"


def test_group_keys_on_events_that_have_none_change_nothing() -> None:
    # the hot path reads group_idx on stores and removes, kv_cache_spec_kind on stores only
    cleared = {"type": "AllBlocksCleared", "group_idx": 3, "kv_cache_spec_kind": [1]}
    removed = {"type": "BlockRemoved", "block_hashes": [H1], "kv_cache_spec_kind": [1]}
    p = payload(cleared, removed)
    batch = decode(p)
    assert len(batch.events) == 2 and batch.other_group_events == 0
    got = view_events(p)
    assert got[0] == {
        "type": "AllBlocksCleared",
        "unknown_fields": {"group_idx": 3, "kv_cache_spec_kind": [1]},
    }
    assert got[1] == {
        "type": "BlockRemoved",
        "block_hashes": [H1],
        "medium": None,
        "unknown_fields": {"kv_cache_spec_kind": [1]},
    }
