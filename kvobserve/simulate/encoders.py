"""Byte-exact KV-event encoders: one WireFormat per engine wire format, over the structs of
`wire_structs.py`, plus the request metadata each version sends (`WireFormat.request_meta`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvobserve.simulate.wire_structs import (
    Batch,
    CacheSaltMeta,
    ClearedArr,
    ClearedMap,
    Hash,
    Removed2,
    Removed3,
    RemovedS23,
    RemovedV23,
    RemovedV33,
    Stored6,
    Stored7,
    Stored8Salt,
    StoredS23,
    StoredV23,
    StoredV33,
    TokenIds,
)

END_SEQ = b"\xff" * 8
SGLANG_047_ROOT_PARENT = (
    5740354900026072187  # hash(()) in CPython: 0.4.7 hashes the root's empty key
)


@dataclass(frozen=True)
class StoreMeta:
    """Optional metadata on a store; each format keeps only the fields it has (`meta_fields`)."""

    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    extra_keys: list[Any] | None = None  # vLLM: one entry per block hash
    lookahead_token_ids: list[list[int]] | None = None  # vLLM 0.33: one list per block hash
    locality: str | None = None  # vLLM >= 0.27: "LOCAL" | "REMOTE"
    ownership: str | None = None  # vLLM >= 0.29: the offloading tier that made the event
    group_idx: int | None = None  # vLLM >= 0.21: None means the format's default group
    kv_cache_spec_kind: str | None = None  # vLLM >= 0.22
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class RemoveMeta:
    """Optional metadata on a removal (vLLM only)."""

    group_idx: int | None = None  # None means the format's default group
    locality: str | None = None
    ownership: str | None = None


_NO_META = StoreMeta()
_NO_REMOVE_META = RemoveMeta()
StoreFn = Callable[[list[Hash], Hash | None, TokenIds, int, str | None, StoreMeta], Any]
RemoveFn = Callable[[list[Hash], str | None, RemoveMeta], Any]


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
    meta_fields: frozenset[str]  # the request metadata this version sends (see request_meta)

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

    def removed(
        self, hashes: list[Hash], medium: str | None = "GPU", meta: RemoveMeta = _NO_REMOVE_META
    ) -> Any:
        """A BlockRemoved struct of this version."""
        return self.make_removed(hashes, medium, meta)

    def request_meta(self, n: int, tokens: Sequence[Any], block_size: int) -> StoreMeta:
        """The metadata request number `n` carries: fixed shares, no random draws (so the
        workload stays the same), only the fields this version sends. vLLM's per-block fields
        are built for the full blocks of `tokens`."""
        fields = self.meta_fields
        session = f"session-{n // 3 % 64}" if n % 3 == 0 and "session_id" in fields else None
        salt = f"tenant-salt-{n // 5 % 4}" if n % 5 == 0 else None
        lora = n % 7 == 0
        lookahead = n % 11 == 0 and "lookahead_token_ids" in fields
        if not (session or salt or lora or lookahead):
            return _NO_META
        if self.engine == "sglang":
            return StoreMeta(
                cache_salt=salt if "cache_salt" in fields else None,
                session_id=session,
                lora_name="sql-lora" if lora and "lora_name" in fields else None,
            )
        n_blocks = len(tokens) // block_size if block_size else 0
        extra_keys = None
        if "extra_keys" in fields and (lora or salt):
            # vLLM: the LoRA name on every block, the cache salt on the first one only
            extra_keys = [["sql-lora"] if lora else None for _ in range(n_blocks)]
            if salt and n_blocks:
                extra_keys[0] = [*(extra_keys[0] or []), salt]
        return StoreMeta(
            lora_id=1 if lora else None,
            lora_name="sql-lora" if lora and "lora_name" in fields else None,
            session_id=session,
            extra_keys=extra_keys,
            # the token after each block (none after the last one)
            lookahead_token_ids=[
                list(tokens[(i + 1) * block_size : (i + 1) * block_size + 1])
                for i in range(n_blocks)
            ]
            if lookahead
            else None,
        )

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
    return Stored6(h, p, t, bs, x.lora_id)


def _s_arr7(
    h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta
) -> Any:
    return Stored7(h, p, t, bs, x.lora_id, m)


def _s_s19(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    if x.cache_salt is not None:
        return Stored8Salt(h, p, t, bs, x.lora_id, m, CacheSaltMeta(x.cache_salt))
    return Stored7(h, p, t, bs, x.lora_id, m)


def _s_s23(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return StoredS23(h, p, t, bs, x.lora_id, m, x.cache_salt, x.session_id, x.lora_name)


def _group(x: StoreMeta | RemoveMeta) -> int:
    return 0 if x.group_idx is None else x.group_idx  # vLLM >= 0.21 sends group 0 by default


def _s_v23(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return StoredV23(
        h, p, t, bs, x.lora_id, m, x.lora_name, x.extra_keys, _group(x), x.kv_cache_spec_kind,
        x.kv_cache_spec_sliding_window,
    )  # fmt: skip


def _s_v33(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return StoredV33(
        h, p, t, bs, x.lora_id, m, x.lora_name, x.extra_keys, _group(x), x.kv_cache_spec_kind,
        x.kv_cache_spec_sliding_window, x.locality, x.ownership, x.session_id,
        x.lookahead_token_ids,
    )  # fmt: skip


def _r_arr2(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return Removed2(h)


def _r_arr3(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return Removed3(h, m)


def _r_s23(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return RemovedS23(h, m)


def _r_v23(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return RemovedV23(h, m, _group(x))


def _r_v33(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return RemovedV33(h, m, _group(x), x.locality, x.ownership)


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
    meta: str = "",
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
        meta_fields=frozenset(meta.split()),
    )


_V33_META = "lora_id lora_name extra_keys session_id lookahead_token_ids"


FORMATS: dict[str, WireFormat] = {
    f.name: f
    for f in (
        _fmt(
            "sglang-0.4", "sglang", (0, 4), _s_arr6, _r_arr2, ClearedArr(),
            medium=False, hash_kind="int64", root_parent=SGLANG_047_ROOT_PARENT,
        ),
        _fmt(
            "sglang-0.5.12", "sglang", (5, 12), _s_arr7, _r_arr3, ClearedArr(),
            medium=True, hash_kind="int64",
        ),
        _fmt(
            "sglang-0.5.19", "sglang", (5, 19), _s_s19, _r_arr3, ClearedArr(),
            medium=True, hash_kind="int64", meta="cache_salt", per_node=True,
        ),
        # 0.5.22 and 0.5.23 share the wire (maps, lora_name, topic in replay); they differ only in
        # what /server_info says, so 0.5.22 exists to simulate that version's discovery
        _fmt(
            "sglang-0.5.22", "sglang", (5, 22), _s_s23, _r_s23, ClearedMap(),
            medium=True, hash_kind="int64", meta="cache_salt session_id lora_name", per_node=True,
            topic_replay=True,
        ),
        _fmt(
            "sglang-0.5.23", "sglang", (5, 23), _s_s23, _r_s23, ClearedMap(),
            medium=True, hash_kind="int64", meta="cache_salt session_id lora_name", per_node=True,
            topic_replay=True,
        ),
        _fmt(
            "vllm-0.10", "vllm", (10, 0), _s_arr6, _r_arr2, ClearedArr(),
            medium=False, hash_kind="uint64", meta="lora_id",
        ),
        _fmt(
            "vllm-0.23", "vllm", (23, 0), _s_v23, _r_v23, ClearedArr(),
            medium=True, hash_kind="uint64", meta="lora_id lora_name extra_keys", group_idx=0,
        ),
        _fmt(
            "vllm-0.33", "vllm", (33, 0), _s_v33, _r_v33, ClearedMap(),
            medium=True, hash_kind="uint64", meta=_V33_META, topic_replay=True, group_idx=0,
        ),
        _fmt(
            "vllm-0.33-bytes", "vllm", (33, 0), _s_v33, _r_v33, ClearedMap(),
            medium=True, hash_kind="bytes32", meta=_V33_META, topic_replay=True, group_idx=0,
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


_STORE_META_KEYS = tuple(StoreMeta.__dataclass_fields__)
_REMOVE_META_KEYS = tuple(RemoveMeta.__dataclass_fields__)


def _hash_from_json(v: Any) -> Hash | None:
    if isinstance(v, str):
        return bytes.fromhex(v)
    return v


def event_from_dict(fmt: WireFormat, ev: dict[str, Any]) -> Any:
    """The version struct for one event in expected.json form (used by the capture tests)."""
    kind = ev["type"]
    if kind == "BlockStored":
        meta = StoreMeta(**{k: ev.get(k) for k in _STORE_META_KEYS})
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
            RemoveMeta(**{k: ev.get(k) for k in _REMOVE_META_KEYS}),
        )
    if kind == "AllBlocksCleared":
        return fmt.cleared
    raise ValueError(f"event type: unknown {kind!r}")
