"""Byte-exact KV-event encoders, one set of msgspec structs per engine wire format.

Each struct set mirrors the field list and struct flags of that engine version as documented in
research/wire-formats.md and the capture README, so msgspec writes the same bytes the engine does:
tagged arrays with trailing nils (array_like ignores omit_defaults), fixmap with omitted None fields
(SGLang 0.5.23), and map16 headers for vLLM 0.33 (msgspec sizes the header for the 16 declared keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import Struct

Hash = int | bytes
TokenIds = list[Any]  # ints, or [a, b] bigram pairs

END_SEQ = b"\xff" * 8
SGLANG_047_ROOT_PARENT = (
    5740354900026072187  # hash(()) in CPython: 0.4.7 hashes the root's empty key
)


class Batch(Struct, array_like=True, gc=False):
    """`[ts, events, dp_rank]` as every version sends it (omit_defaults would be ignored anyway)."""

    ts: float
    events: list[Any]
    dp_rank: int | None = None


# --- SGLang 0.4.7 and vLLM 0.10: 6-element tagged arrays --------------------------------------


class _Stored6(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None


class _Removed2(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]


class _ClearedArr(Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


# --- SGLang 0.5.12 (0.5.10-0.5.16) and 0.5.19 (0.5.18-0.5.19): + medium -----------------------


class _Stored7(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _CacheSaltMeta(Struct, omit_defaults=True, gc=False):
    cache_salt: str | None = None


class _Stored8Salt(Struct, array_like=True, tag="BlockStored", gc=False):
    """SGLang 0.5.18/19 `BlockStoredWithMetadata`: element 7 is a `{"cache_salt": ...}` map."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    metadata: _CacheSaltMeta


class _Removed3(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


# --- SGLang 0.5.23 (0.5.20+): tagged map, None optionals omitted --------------------------------


class _StoredS23(Struct, omit_defaults=True, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _RemovedS23(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


class _ClearedMap(Struct, omit_defaults=True, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


# --- vLLM 0.23 (0.22-0.23): 12-element tagged arrays ------------------------------------------


class _StoredV23(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _RemovedV23(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


# --- vLLM 0.33: tagged map, 16 declared keys -> map16 header -----------------------------------


class _StoredV33(Struct, omit_defaults=True, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class _RemovedV33(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class StoreMeta:
    """Optional request metadata on a store; each format keeps only the fields it has."""

    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    extra_keys: list[Any] | None = None


_NO_META = StoreMeta()
StoreFn = Callable[[list[Hash], Hash | None, TokenIds, int, str | None, StoreMeta], Any]
RemoveFn = Callable[[list[Hash], str | None], Any]


@dataclass(frozen=True)
class WireFormat:
    """One engine version's wire behaviour: event structs, hash kind, block and replay semantics."""

    name: str
    engine: str  # "sglang" | "vllm"
    has_medium: bool
    hash_kind: str  # "int64" (signed) | "uint64" | "bytes32"
    per_page_stores: bool  # SGLang: one BlockStored per page, short last page allowed
    removed_per_node: bool  # SGLang >= 0.5.19: one BlockRemoved lists a whole radix node
    replay_with_topic: bool  # 4-frame replay replies and end marker
    group_idx: int | None  # vLLM >= 0.20 sets group_idx = 0
    root_parent: Hash | None
    make_stored: StoreFn
    make_removed: RemoveFn
    cleared: Any
    version: tuple[int, int]

    def stored(
        self,
        hashes: list[Hash],
        parent: Hash | None,
        token_ids: TokenIds,
        block_size: int,
        medium: str | None = "GPU",
        meta: StoreMeta = _NO_META,
    ) -> Any:
        """A BlockStored struct of this version (medium dropped where the version has none)."""
        return self.make_stored(hashes, parent, token_ids, block_size, medium, meta)

    def removed(self, hashes: list[Hash], medium: str | None = "GPU") -> Any:
        """A BlockRemoved struct of this version."""
        return self.make_removed(hashes, medium)

    def wire_medium(self, medium: str | None) -> str | None:
        """The medium as this version puts it on the wire (None where it has no field)."""
        return medium if self.has_medium else None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[Any], dp_rank: int | None) -> bytes:
    """One msgpack batch payload `[ts, events, dp_rank]`."""
    return _encoder.encode(Batch(ts, events, dp_rank))


def _s_arr6(
    h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta
) -> Any:
    return _Stored6(h, p, t, bs, x.lora_id)


def _s_arr7(
    h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta
) -> Any:
    return _Stored7(h, p, t, bs, x.lora_id, m)


def _s_s19(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    if x.cache_salt is not None:
        return _Stored8Salt(h, p, t, bs, x.lora_id, m, _CacheSaltMeta(x.cache_salt))
    return _Stored7(h, p, t, bs, x.lora_id, m)


def _s_s23(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return _StoredS23(h, p, t, bs, x.lora_id, m, x.cache_salt, x.session_id, x.lora_name)


def _s_v23(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return _StoredV23(h, p, t, bs, x.lora_id, m, x.lora_name, x.extra_keys, 0)


def _s_v33(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return _StoredV33(
        h, p, t, bs, x.lora_id, m, x.lora_name, x.extra_keys, 0, session_id=x.session_id
    )


def _fmt(
    name: str,
    engine: str,
    version: tuple[int, int],
    stored: StoreFn,
    removed: RemoveFn,
    cleared: Any,
    *,
    medium: bool,
    hash_kind: str,
    per_node: bool = False,
    topic_replay: bool = False,
    group_idx: int | None = None,
    root_parent: Hash | None = None,
) -> WireFormat:
    return WireFormat(
        name=name,
        engine=engine,
        has_medium=medium,
        hash_kind=hash_kind,
        per_page_stores=engine == "sglang",
        removed_per_node=per_node,
        replay_with_topic=topic_replay,
        group_idx=group_idx,
        root_parent=root_parent,
        make_stored=stored,
        make_removed=removed,
        cleared=cleared,
        version=version,
    )


FORMATS: dict[str, WireFormat] = {
    f.name: f
    for f in (
        _fmt(
            "sglang-0.4", "sglang", (0, 4), _s_arr6, lambda h, m: _Removed2(h), _ClearedArr(),
            medium=False, hash_kind="int64", root_parent=SGLANG_047_ROOT_PARENT,
        ),
        _fmt(
            "sglang-0.5.12", "sglang", (5, 12), _s_arr7, _Removed3, _ClearedArr(),
            medium=True, hash_kind="int64",
        ),
        _fmt(
            "sglang-0.5.19", "sglang", (5, 19), _s_s19, _Removed3, _ClearedArr(),
            medium=True, hash_kind="int64", per_node=True,
        ),
        # 0.5.22 and 0.5.23 share the wire (maps, lora_name, topic in replay); they differ only in
        # what /server_info says, so 0.5.22 exists to simulate that version's discovery
        _fmt(
            "sglang-0.5.22", "sglang", (5, 22), _s_s23, _RemovedS23, _ClearedMap(),
            medium=True, hash_kind="int64", per_node=True, topic_replay=True,
        ),
        _fmt(
            "sglang-0.5.23", "sglang", (5, 23), _s_s23, _RemovedS23, _ClearedMap(),
            medium=True, hash_kind="int64", per_node=True, topic_replay=True,
        ),
        _fmt(
            "vllm-0.10", "vllm", (10, 0), _s_arr6, lambda h, m: _Removed2(h), _ClearedArr(),
            medium=False, hash_kind="uint64",
        ),
        _fmt(
            "vllm-0.23", "vllm", (23, 0), _s_v23, lambda h, m: _RemovedV23(h, m, 0), _ClearedArr(),
            medium=True, hash_kind="uint64", group_idx=0,
        ),
        _fmt(
            "vllm-0.33", "vllm", (33, 0), _s_v33, lambda h, m: _RemovedV33(h, m, 0), _ClearedMap(),
            medium=True, hash_kind="uint64", topic_replay=True, group_idx=0,
        ),
        _fmt(
            "vllm-0.33-bytes", "vllm", (33, 0), _s_v33, lambda h, m: _RemovedV33(h, m, 0),
            _ClearedMap(), medium=True, hash_kind="bytes32", topic_replay=True, group_idx=0,
        ),
    )
}  # fmt: skip


def get_format(name: str) -> WireFormat:
    """The format by name; ValueError naming the value and the choices otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"format: unknown wire format {name!r}; choose one of {sorted(FORMATS)}"
        ) from None


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The PUB message `[topic, seq(8 B BE), payload]`."""
    return [topic, seq.to_bytes(8, "big"), payload]


def replay_frames(fmt: WireFormat, topic: bytes, seq_bytes: bytes, payload: bytes) -> list[bytes]:
    """One replayed batch as the DEALER sees it (3 frames, or 4 with topic)."""
    if fmt.replay_with_topic:
        return [b"", topic, seq_bytes, payload]
    return [b"", seq_bytes, payload]


def replay_end(fmt: WireFormat) -> list[bytes]:
    """The end-of-replay marker as the DEALER sees it."""
    if fmt.replay_with_topic:
        return [b"", b"", END_SEQ, b""]
    return [b"", END_SEQ, b""]


def _hash_from_json(v: Any) -> Hash | None:
    if isinstance(v, str):
        return bytes.fromhex(v)
    return v


def event_from_dict(fmt: WireFormat, ev: dict[str, Any]) -> Any:
    """The version struct for one event in expected.json form (used by the capture tests)."""
    kind = ev["type"]
    if kind == "BlockStored":
        meta = StoreMeta(
            lora_id=ev.get("lora_id"),
            lora_name=ev.get("lora_name"),
            cache_salt=ev.get("cache_salt"),
            session_id=ev.get("session_id"),
            extra_keys=ev.get("extra_keys"),
        )
        return fmt.stored(
            [_hash_from_json(h) for h in ev["block_hashes"]],  # type: ignore[misc]
            _hash_from_json(ev.get("parent_block_hash")),
            ev.get("token_ids", []),
            ev["block_size"],
            ev.get("medium"),
            meta,
        )
    if kind == "BlockRemoved":
        return fmt.removed(
            [_hash_from_json(h) for h in ev["block_hashes"]],  # type: ignore[misc]
            ev.get("medium"),
        )
    if kind == "AllBlocksCleared":
        return fmt.cleared
    raise ValueError(f"event type: unknown {kind!r}")
